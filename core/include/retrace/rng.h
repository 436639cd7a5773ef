#pragma once
// Capture and restore of random-number-generator state: the CPU generator and each CUDA
// device's generator (seed + Philox offset). Everything random in a step goes through these
// generators, so restoring them reproduces dropout masks and random inits bit for bit.

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace retrace {

// Where a CUDA device's default generator stood inside the CUDA graph being captured on the
// device's current stream. Inside a graph, random kernels read seed and offset from device memory
// that CUDAGraph::replay() fills, plus a per-kernel offset counted from the start of the capture;
// that count is all a capture-time state can hold (docs/checkpoint.md).
struct GraphRngPosition {
  // graphsafe_get_state(): shares the generator's state object as it was (not a copy; PyTorch
  // forbids cloning a CUDA generator during capture).
  at::Generator state;
  std::uint64_t capture_id = 0;  // cudaStreamGetCaptureInfo's id of that capture
  std::uint64_t offset = 0;      // Philox offset counted from the start of the capture
};

// The state of one default generator.
struct GeneratorState {
  c10::Device device{c10::kCPU};
  // The generator's get_state() bytes: 5056 for the CPU mt19937 state, 16 (seed, offset) for a
  // CUDA generator. Empty when `graph` is set.
  std::vector<std::uint8_t> bytes;
  // Set instead of `bytes` when taken while the device's current stream was capturing a CUDA
  // graph. Such a state restores only during that same capture, inside an RngFork, and cannot
  // be serialized.
  std::optional<GraphRngPosition> graph;

  bool operator==(const GeneratorState& other) const;
};

// A value type holding the state of a set of default generators.
// Thread-safety: capture() and restore() lock each generator's mutex; the object itself is not
// synchronized.
class RngState {
 public:
  RngState() = default;

  // The CPU generator plus the default generator of each CUDA device listed (CPU devices in the
  // list are ignored). Cost: one get_state() per generator (a 5 KiB copy for the CPU). During
  // CUDA graph capture on a listed device, its position in the graph instead; throws
  // retrace::Error if that device's generator is not part of the capture (CUDAGraph registers
  // the default generator of the device current at capture_begin()).
  static RngState capture(const std::vector<c10::Device>& cuda_devices = {});
  // The CPU generator and every visible CUDA device's generator.
  static RngState capture_all();

  // Sets every generator captured here back to its captured state. Throws retrace::Error for a
  // CUDA device that is not visible, a state the generator rejects (naming the device), or a
  // state taken during CUDA graph capture that is restored outside that capture or outside an
  // RngFork on this thread.
  void restore() const;

  const std::vector<GeneratorState>& generators() const { return generators_; }
  bool empty() const { return generators_.empty(); }

  // Portable byte form (little-endian, versioned; docs/checkpoint.md). Throws retrace::Error if
  // a state was taken during CUDA graph capture.
  std::vector<std::uint8_t> serialize() const;
  // Parses serialize()'s output. Untrusted input: every length is checked before use, and each
  // state against what its generator accepts (CPU: 5056 bytes; CUDA: 16 bytes, offset a
  // multiple of 4); a bad buffer throws retrace::Error naming the byte offset.
  static RngState deserialize(const std::uint8_t* data, std::size_t size);

  bool operator==(const RngState& other) const { return generators_ == other.generators_; }
  bool operator!=(const RngState& other) const { return !(*this == other); }

 private:
  std::vector<GeneratorState> generators_;
};

// Which generators differ between `now` and `then`, in words ("the CPU generator's", "cuda:1's",
// "cuda:1's, which `then` did not have"); "" when they are equal.
std::string generators_differing(const RngState& now, const RngState& then, const std::string& then_name = "the other");

// RAII: saves the current state of the CPU generator and the given CUDA devices' generators,
// and restores it on destruction (torch.random.fork_rng).
// During CUDA graph capture a device's generator cannot be rewound in place: there the fork puts
// the generator's state object back as it found it, so restore a capture-time RngState inside
// the fork (as checkpoint's recompute does) to draw the same numbers again; draws made on the
// generator's own state inside the fork are not undone.
class RngFork {
 public:
  explicit RngFork(const std::vector<c10::Device>& cuda_devices = {});
  ~RngFork();
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngState saved_;
};

}  // namespace retrace
