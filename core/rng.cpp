#include <retrace/rng.h>

#include "bytes.h"
#include "cuda_hooks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <mutex>

namespace retrace {

namespace {

constexpr std::uint32_t kMagic = 0x474e5252;  // "RRNG"
constexpr std::uint16_t kFormatVersion = 1;
// A CPU state is 5056 bytes and a CUDA one 16; anything far larger is corrupt input.
constexpr std::uint32_t kMaxStateBytes = 1u << 20;
constexpr std::uint32_t kMaxGenerators = 1024;

at::Generator default_generator(c10::Device device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

GeneratorState capture_one(c10::Device device) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  GeneratorState s;
  s.device = device;
  if (device.is_cuda() && detail::cuda_stream_capturing(device.index())) {
    // get_state() is illegal during capture; the graph-safe state is a shared handle, so clone
    // it to freeze seed and offset as they are now.
    s.graph_state = gen.graphsafe_get_state().clone();
    return s;
  }
  at::Tensor state = gen.get_state();
  const auto* p = state.const_data_ptr<std::uint8_t>();
  s.bytes.assign(p, p + state.numel());
  return s;
}

void restore_one(const GeneratorState& s) {
  at::Generator gen = default_generator(s.device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  if (s.graph_state) {
    gen.graphsafe_set_state(s.graph_state->clone());
    return;
  }
  at::Tensor state = at::empty({static_cast<std::int64_t>(s.bytes.size())}, at::kByte);
  std::copy(s.bytes.begin(), s.bytes.end(), state.mutable_data_ptr<std::uint8_t>());
  gen.set_state(state);
}

std::vector<c10::Device> all_cuda_devices() {
  std::vector<c10::Device> out;
  const auto n = at::globalContext().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  for (c10::DeviceIndex i = 0; i < n; ++i) out.emplace_back(c10::kCUDA, i);
  return out;
}

}  // namespace

bool GeneratorState::operator==(const GeneratorState& other) const {
  if (device != other.device || bytes != other.bytes) return false;
  if (graph_state.has_value() != other.graph_state.has_value()) return false;
  if (!graph_state) return true;
  return graph_state->current_seed() == other.graph_state->current_seed() &&
         graph_state->get_offset() == other.graph_state->get_offset();
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
    if (g.graph_state) {
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
    r.fail("unsupported version " + std::to_string(version) + " (this build reads " +
           std::to_string(kFormatVersion) + ")");
  }
  const auto count = r.get<std::uint32_t>("generator count");
  if (count > kMaxGenerators) r.fail("generator count " + std::to_string(count) + " is implausible");
  RngState s;
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto type = r.get<std::int8_t>("device type");
    const auto index = r.get<std::int8_t>("device index");
    if (type != static_cast<std::int8_t>(c10::kCPU) && type != static_cast<std::int8_t>(c10::kCUDA)) {
      r.fail("device type " + std::to_string(type) + " is neither CPU nor CUDA");
    }
    const auto n = r.get<std::uint32_t>("state length");
    if (n > kMaxStateBytes) r.fail("state length " + std::to_string(n) + " exceeds the cap");
    GeneratorState g;
    g.device = c10::Device(static_cast<c10::DeviceType>(type), index);
    g.bytes = r.get_bytes(n, "generator state");
    s.generators_.push_back(std::move(g));
  }
  if (r.remaining() != 0) r.fail(std::to_string(r.remaining()) + " trailing bytes");
  return s;
}

RngFork::RngFork(const std::vector<c10::Device>& cuda_devices)
    : saved_(RngState::capture(cuda_devices)) {}

RngFork::~RngFork() {
  try {
    saved_.restore();
  } catch (...) {
    // A destructor must not throw; restoring a state we captured ourselves cannot fail short of
    // the device going away.
  }
}

}  // namespace retrace
