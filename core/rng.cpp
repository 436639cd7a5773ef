#include <retrace/rng.h>

#include "bytes.h"
#include "cuda_hooks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <mutex>
#include <optional>

namespace retrace {

namespace {

constexpr std::uint32_t kMagic = 0x474e5252;  // "RRNG"
constexpr std::uint16_t kFormatVersion = 1;
constexpr std::uint32_t kMaxGenerators = 1024;
// What each generator's get_state() returns and set_state() accepts (torch 2.11):
// CPUGeneratorImpl's CPUGeneratorImplState (mt19937 block plus cached normal samples; set_state
// also takes the 5048-byte legacy layout, which get_state() never writes), and
// CUDAGeneratorImpl's seed then Philox offset, each 8 bytes, the offset a multiple of 4
// (set_philox_offset_per_thread; see Note [Why enforce RNG offset % 4 == 0?]).
constexpr std::uint32_t kCpuStateBytes = 5056;
constexpr std::uint32_t kCudaStateBytes = 16;

// The devices whose generators an RngFork alive on this thread saved during CUDA graph capture.
// A capture-time state restores only inside such a fork: the restore installs a state object of
// its own, and only the fork's exit puts the graph's registered one back (see RngFork).
thread_local std::vector<c10::Device> graph_forks;

at::Generator default_generator(c10::Device device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

c10::DeviceIndex visible_cuda_devices() {
  return at::globalContext().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
}

// A state read from a trace may name a device this process does not have; LibTorch would answer
// with an internal check failure.
void check_visible(c10::Device device) {
  if (!device.is_cuda()) return;
  const c10::DeviceIndex n = visible_cuda_devices();
  if (device.index() < 0 || device.index() >= n) {
    throw Error("retrace::RngState::restore: the state is for " + device.str() + " but this process sees " +
                std::to_string(n) + " CUDA device(s); restore it where that device is visible");
  }
}

GeneratorState capture_one(c10::Device device) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  GeneratorState s;
  s.device = device;
  if (device.is_cuda() && detail::cuda_stream_capturing(device.index())) {
    // get_state() and cloning the generator are illegal during capture; what identifies the
    // state then is where the generator stands in the graph.
    s.graph = detail::cuda_graph_rng_position(gen, device.index());
    return s;
  }
  at::Tensor state = gen.get_state();
  const auto* p = state.const_data_ptr<std::uint8_t>();
  s.bytes.assign(p, p + state.numel());
  return s;
}

void restore_in_graph(const at::Generator& gen, const GeneratorState& s) {
  const std::uint64_t now = detail::cuda_capture_id(s.device.index());
  if (now != s.graph->capture_id) {
    throw Error("retrace::RngState::restore: the state of " + s.device.str() +
                " was taken during a CUDA graph capture and restores only during that same capture (" +
                (now == 0 ? "none is running on the device's current stream now" : "another one is running now") +
                "); outside it, the graph's seed and offset exist only on the device, as each replay sets them");
  }
  if (std::find(graph_forks.begin(), graph_forks.end(), s.device) == graph_forks.end()) {
    throw Error("retrace::RngState::restore: the state of " + s.device.str() +
                " was taken during CUDA graph capture and restores only inside a retrace::RngFork for that "
                "device on this thread: the graph's own generator state cannot be rewound during capture, so "
                "the fork must put it back before the capture ends");
  }
  detail::cuda_graph_rng_rewind(gen, s.device.index(), *s.graph);
}

void restore_one(const GeneratorState& s) {
  check_visible(s.device);
  at::Generator gen = default_generator(s.device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  if (s.graph) {
    restore_in_graph(gen, s);
    return;
  }
  // set_state() checks for graph capture on the current device's stream: make that this one.
  std::optional<c10::DeviceGuard> on_device;
  if (s.device.is_cuda()) on_device.emplace(s.device);
  at::Tensor state = at::empty({static_cast<std::int64_t>(s.bytes.size())}, at::kByte);
  std::copy(s.bytes.begin(), s.bytes.end(), state.mutable_data_ptr<std::uint8_t>());
  try {
    gen.set_state(state);
  } catch (const c10::Error& e) {
    throw Error("retrace::RngState::restore: the generator of " + s.device.str() +
                " rejected the state: " + e.what_without_backtrace());
  }
}

// RngFork's exit for a state taken during capture: the generator gets its state object back.
void put_back(const GeneratorState& s) {
  at::Generator gen = default_generator(s.device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.graphsafe_set_state(s.graph->state);
}

std::vector<c10::Device> all_cuda_devices() {
  std::vector<c10::Device> out;
  const c10::DeviceIndex n = visible_cuda_devices();
  for (c10::DeviceIndex i = 0; i < n; ++i) out.emplace_back(c10::kCUDA, i);
  return out;
}

}  // namespace

bool GeneratorState::operator==(const GeneratorState& other) const {
  if (device != other.device || bytes != other.bytes) return false;
  if (graph.has_value() != other.graph.has_value()) return false;
  if (!graph) return true;
  return graph->capture_id == other.graph->capture_id && graph->offset == other.graph->offset;
}

RngState RngState::capture(const std::vector<c10::Device>& cuda_devices) {
  RngState s;
  s.generators_.push_back(capture_one(c10::Device(c10::kCPU)));
  std::vector<c10::Device> seen;
  for (const c10::Device& d : cuda_devices) {
    if (!d.is_cuda()) continue;
    c10::Device dev(c10::kCUDA, d.has_index() ? d.index() : 0);
    if (std::find(seen.begin(), seen.end(), dev) != seen.end()) continue;
    seen.push_back(dev);
    s.generators_.push_back(capture_one(dev));
  }
  return s;
}

RngState RngState::capture_all() { return capture(all_cuda_devices()); }

void RngState::restore() const {
  for (const GeneratorState& g : generators_) restore_one(g);
}

std::vector<std::uint8_t> RngState::serialize() const {
  detail::ByteWriter w;
  w.put(kMagic);
  w.put(kFormatVersion);
  w.put(static_cast<std::uint32_t>(generators_.size()));
  for (const GeneratorState& g : generators_) {
    if (g.graph) {
      throw Error("retrace::RngState::serialize: the state of " + g.device.str() +
                  " was taken during CUDA graph capture and cannot be serialized; capture it "
                  "outside the graph");
    }
    w.put(static_cast<std::int8_t>(g.device.type()));
    w.put(static_cast<std::int8_t>(g.device.index()));
    w.put(static_cast<std::uint32_t>(g.bytes.size()));
    w.put_bytes(g.bytes.data(), g.bytes.size());
  }
  return w.take();
}

RngState RngState::deserialize(const std::uint8_t* data, std::size_t size) {
  detail::ByteReader r(data, size, "RNG state");
  if (r.get<std::uint32_t>("magic") != kMagic) r.fail("bad magic (not an RNG state)");
  const auto version = r.get<std::uint16_t>("version");
  if (version != kFormatVersion) {
    r.fail("unsupported version " + std::to_string(version) + " (this build reads " + std::to_string(kFormatVersion) +
           ")");
  }
  const auto count = r.get<std::uint32_t>("generator count");
  if (count > kMaxGenerators) r.fail("generator count " + std::to_string(count) + " is implausible");
  RngState s;
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::size_t type_at = r.offset();
    const auto type = r.get<std::int8_t>("device type");
    const auto index = r.get<std::int8_t>("device index");
    const bool cpu = type == static_cast<std::int8_t>(c10::kCPU);
    if (!cpu && type != static_cast<std::int8_t>(c10::kCUDA)) {
      r.fail_at(type_at, "device type " + std::to_string(type) + " is neither CPU nor CUDA");
    }
    // c10::Device checks its index only in debug builds.
    if (cpu ? (index != -1 && index != 0) : index < 0) {
      r.fail_at(type_at + 1, std::string(cpu ? "CPU" : "CUDA") + " device index " + std::to_string(index) +
                                 " is invalid (" + (cpu ? "-1 or 0" : "0 to 127") + ")");
    }
    const std::size_t length_at = r.offset();
    const auto n = r.get<std::uint32_t>("state length");
    const std::uint32_t expected = cpu ? kCpuStateBytes : kCudaStateBytes;
    if (n != expected) {
      const std::string layout = cpu ? "CPU generator state is " + std::to_string(expected) + " bytes (mt19937)"
                                     : "CUDA generator state is " + std::to_string(expected) + " bytes (seed, offset)";
      r.fail_at(length_at, "a " + layout + ", this one " + std::to_string(n));
    }
    GeneratorState g;
    g.device = c10::Device(static_cast<c10::DeviceType>(type), index);
    const std::size_t state_at = r.offset();
    g.bytes = r.get_bytes(n, "generator state");
    if (!cpu) {
      std::int64_t offset = 0;
      std::memcpy(&offset, g.bytes.data() + 8, sizeof offset);
      if (static_cast<std::uint64_t>(offset) % 4 != 0) {
        r.fail_at(state_at + 8, "CUDA Philox offset " + std::to_string(offset) + " is not a multiple of 4");
      }
    }
    s.generators_.push_back(std::move(g));
  }
  if (r.remaining() != 0) r.fail(std::to_string(r.remaining()) + " trailing bytes");
  return s;
}

RngFork::RngFork(const std::vector<c10::Device>& cuda_devices) : saved_(RngState::capture(cuda_devices)) {
  for (const GeneratorState& g : saved_.generators()) {
    if (g.graph) graph_forks.push_back(g.device);
  }
}

RngFork::~RngFork() {
  for (const GeneratorState& g : saved_.generators()) {
    if (!g.graph) continue;
    const auto it = std::find(graph_forks.rbegin(), graph_forks.rend(), g.device);
    if (it != graph_forks.rend()) graph_forks.erase(std::next(it).base());
  }
  for (const GeneratorState& g : saved_.generators()) {
    try {
      if (g.graph) {
        put_back(g);
      } else {
        restore_one(g);
      }
    } catch (...) {
      // A destructor must not throw; restoring a state we captured ourselves cannot fail short of
      // the device going away.
    }
  }
}

std::string generators_differing(const RngState& now, const RngState& then, const std::string& then_name) {
  if (now == then) return "";
  std::string out;
  const auto add = [&](const std::string& what) { out += (out.empty() ? "" : ", ") + what; };
  for (const GeneratorState& g : then.generators()) {
    const auto it = std::find_if(now.generators().begin(), now.generators().end(),
                                 [&](const GeneratorState& n) { return n.device == g.device; });
    if (it == now.generators().end()) {
      add(g.device.str() + "'s, which this process does not have");
    } else if (!(*it == g)) {
      add(g.device.is_cpu() ? std::string("the CPU generator's") : g.device.str() + "'s");
    }
  }
  for (const GeneratorState& n : now.generators()) {
    if (std::none_of(then.generators().begin(), then.generators().end(),
                     [&](const GeneratorState& g) { return g.device == n.device; })) {
      add(n.device.str() + "'s, which " + then_name + " did not have");
    }
  }
  return out.empty() ? "their order or encoding" : out;
}

}  // namespace retrace
