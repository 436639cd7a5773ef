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

// The state of one default generator.
struct GeneratorState {
  c10::Device device{c10::kCPU};
  // The generator's get_state() bytes: 5056 for the CPU mt19937 state, 16 (seed, offset) for a
  // CUDA generator. Empty when graph_state is set.
  std::vector<std::uint8_t> bytes;
  // Taken with graphsafe_get_state() while the device's current stream was capturing a CUDA
  // graph; such a state restores, but cannot be serialized.
  std::optional<at::Generator> graph_state;

  bool operator==(const GeneratorState& other) const;
};

// A value type holding the state of a set of default generators.
// Thread-safety: capture() and restore() lock each generator's mutex; the object itself is not
// synchronized.
class RngState {
 public:
  RngState() = default;

  // The CPU generator plus the default generator of each CUDA device listed (CPU devices in the
  // list are ignored). Cost: one get_state() per generator (a 5 KiB copy for the CPU).
  static RngState capture(const std::vector<c10::Device>& cuda_devices = {});
  // The CPU generator and every visible CUDA device's generator.
  static RngState capture_all();

  // Sets every generator captured here back to its captured state.
  void restore() const;

  const std::vector<GeneratorState>& generators() const { return generators_; }
  bool empty() const { return generators_.empty(); }

  // Portable byte form (little-endian, versioned; docs/checkpoint.md). Throws retrace::Error if
  // a state was taken during CUDA graph capture.
  std::vector<std::uint8_t> serialize() const;
  // Parses serialize()'s output. Untrusted input: every length is checked before use; a bad
  // buffer throws retrace::Error naming the byte offset.
  static RngState deserialize(const std::uint8_t* data, std::size_t size);

  bool operator==(const RngState& other) const { return generators_ == other.generators_; }
  bool operator!=(const RngState& other) const { return !(*this == other); }

 private:
  std::vector<GeneratorState> generators_;
};

// RAII: saves the current state of the CPU generator and the given CUDA devices' generators,
// and restores it on destruction (torch.random.fork_rng).
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
