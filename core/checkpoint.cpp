#include <retrace/checkpoint.h>

#include <retrace/autocast.h>
#include <retrace/observer.h>
#include <retrace/rng.h>
#include <retrace/verify.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <atomic>
#include <optional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace retrace {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<std::uint64_t> g_next_invocation{1};

struct SegmentCall;

struct ActiveFrame {
  const std::string* name;
  SegmentPhase phase;
  // The call whose dropout masks recompute_dropout() keeps (forward) or replays (recompute): set
  // when the forward's random numbers are preserved for the recompute.
  SegmentCall* tape = nullptr;
};
thread_local std::vector<ActiveFrame> t_active;
// The segment whose event the observers are handling on this thread (notify()).
thread_local std::vector<ActiveFrame> t_observed;

// Marks the calling thread as running a segment's phase for the scope.
class ActiveScope {
 public:
  ActiveScope(const std::string& name, SegmentPhase phase, SegmentCall* tape = nullptr) {
    t_active.push_back({&name, phase, tape});
  }
  ~ActiveScope() { t_active.pop_back(); }
};

// Bytes of bits [begin, end) from 8 elements each of `data`: bit k of byte i is data[8i + k] != 0.
// Float has an SSE2 path (two compares and movemasks a byte); the scalar loop ran one element at a
// time and cost a tiny model's selective recompute 3-8% a step (bench/README.md).
template <class scalar_t>
void pack_bytes(const scalar_t* data, std::uint8_t* bits, std::int64_t begin, std::int64_t end) {
  for (std::int64_t byte = begin; byte < end; ++byte) {
    const scalar_t* d = data + 8 * byte;
    std::uint8_t b = 0;
    for (int k = 0; k < 8; ++k) b |= static_cast<std::uint8_t>(static_cast<float>(d[k]) != 0.0f) << k;
    bits[byte] = b;
  }
}

// Elements [8 * begin, 8 * end) of `data` from their bits: `kept` where a bit is set, else 0.
template <class scalar_t>
void unpack_bytes(const std::uint8_t* bits, scalar_t kept, scalar_t* data, std::int64_t begin, std::int64_t end) {
  const scalar_t dropped(0);
  for (std::int64_t byte = begin; byte < end; ++byte) {
    const unsigned v = bits[byte];
    scalar_t* d = data + 8 * byte;
    for (int k = 0; k < 8; ++k) d[k] = ((v >> k) & 1u) ? kept : dropped;
  }
}

#if defined(__SSE2__)
template <>
void pack_bytes<float>(const float* data, std::uint8_t* bits, std::int64_t begin, std::int64_t end) {
  const __m128 zero = _mm_setzero_ps();
  for (std::int64_t byte = begin; byte < end; ++byte) {
    const float* d = data + 8 * byte;
    // cmpneq is true for NaN, as the scalar != is.
    const int lo = _mm_movemask_ps(_mm_cmpneq_ps(_mm_loadu_ps(d), zero));
    const int hi = _mm_movemask_ps(_mm_cmpneq_ps(_mm_loadu_ps(d + 4), zero));
    bits[byte] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
}

template <>
void unpack_bytes<float>(const std::uint8_t* bits, float kept, float* data, std::int64_t begin, std::int64_t end) {
  // Lane k of entry m is all ones where bit k of the nibble m is set.
  alignas(16) static const std::uint32_t kLanes[16][4] = {
      {0, 0, 0, 0},     {~0u, 0, 0, 0},     {0, ~0u, 0, 0},     {~0u, ~0u, 0, 0},
      {0, 0, ~0u, 0},   {~0u, 0, ~0u, 0},   {0, ~0u, ~0u, 0},   {~0u, ~0u, ~0u, 0},
      {0, 0, 0, ~0u},   {~0u, 0, 0, ~0u},   {0, ~0u, 0, ~0u},   {~0u, ~0u, 0, ~0u},
      {0, 0, ~0u, ~0u}, {~0u, 0, ~0u, ~0u}, {0, ~0u, ~0u, ~0u}, {~0u, ~0u, ~0u, ~0u}};
  const __m128 value = _mm_set1_ps(kept);
  for (std::int64_t byte = begin; byte < end; ++byte) {
    const unsigned v = bits[byte];
    float* d = data + 8 * byte;
    _mm_storeu_ps(d, _mm_and_ps(_mm_load_ps(reinterpret_cast<const float*>(kLanes[v & 15u])), value));
    _mm_storeu_ps(d + 4, _mm_and_ps(_mm_load_ps(reinterpret_cast<const float*>(kLanes[v >> 4])), value));
  }
}
#endif

// A dropout mask -- 0 or 1 before its scaling by 1/(1-p) -- kept as one bit an element in the
// noise tensor's memory order. The noise is laid out by empty_like, so it is dense and its n
// elements are the n slots from its data pointer. The bits are a CPU tensor, so the allocator
// (and CpuMemoryCounter) sees what is kept.
struct PackedMask {
  std::vector<std::int64_t> sizes, strides;
  at::TensorOptions options;
  at::Tensor bits;  // uint8, (n + 7) / 8

  static PackedMask pack(const at::Tensor& noise) {
    TORCH_INTERNAL_ASSERT(noise.is_non_overlapping_and_dense());
    const std::int64_t n = noise.numel();
    PackedMask m{noise.sizes().vec(), noise.strides().vec(), noise.options(), at::empty({(n + 7) / 8}, at::kByte)};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, noise.scalar_type(), "retrace_pack_mask", [&] {
      const scalar_t* data = noise.const_data_ptr<scalar_t>();
      std::uint8_t* bits = m.bits.mutable_data_ptr<std::uint8_t>();
      const std::int64_t whole = n / 8;  // bytes of 8 elements each; the last may hold fewer
      at::parallel_for(0, whole, 8192,
                       [&](std::int64_t begin, std::int64_t end) { pack_bytes<scalar_t>(data, bits, begin, end); });
      if (whole * 8 < n) {  // the last byte's elements, zero-padded to 8: their bits are 0
        scalar_t tail[8];
        std::fill(tail, tail + 8, scalar_t(0));
        std::copy(data + 8 * whole, data + n, tail);
        pack_bytes<scalar_t>(tail, bits + whole, 0, 1);
      }
    });
    return m;
  }

  // The noise again, in one pass: 0 where a bit is clear, else what at::dropout's noise.div_(1 - p)
  // makes of a drawn 1 -- computed by that same div_ on a one-element tensor, so the value is its
  // bits whatever the kernel does with the scalar (1.0f / float(1 - p) is not float(1.0 / (1 - p))
  // for every p).
  at::Tensor unpack(double p) const {
    at::Tensor noise = at::empty_strided(sizes, strides, options);
    const std::int64_t n = noise.numel();
    const at::Tensor one = at::ones({1}, options).div_(1 - p);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, noise.scalar_type(), "retrace_unpack_mask", [&] {
      const scalar_t kept = one.const_data_ptr<scalar_t>()[0];
      scalar_t* data = noise.mutable_data_ptr<scalar_t>();
      const std::uint8_t* b = bits.const_data_ptr<std::uint8_t>();
      const std::int64_t whole = n / 8;
      at::parallel_for(0, whole, 8192, [&](std::int64_t begin, std::int64_t end) {
        unpack_bytes<scalar_t>(b, kept, data, begin, end);
      });
      if (whole * 8 < n) {  // the last byte: all 8 rebuilt, as many kept as the tensor has left
        scalar_t tail[8];
        unpack_bytes<scalar_t>(b + whole, kept, tail, 0, 1);
        std::copy(tail, tail + (n - 8 * whole), data + 8 * whole);
      }
    });
    return noise;
  }
};

// at::dropout's noise on the CPU, drawn into `noise`: an empty tensor laid out as at::dropout lays
// out its noise (empty_like of the input), filled by bernoulli_(1 - p), then div_(1 - p).
at::Tensor draw_noise(at::Tensor noise, double p) {
  noise.bernoulli_(1 - p);
  noise.div_(1 - p);
  return noise;
}

// One recompute_dropout() call inside a segment's forward: its mask and the CPU generator's state
// after the draw (get_state(), a CPU tensor), which the recompute moves the generator to instead
// of drawing again, so any random op after it draws what it drew in the forward.
struct TapedDropout {
  PackedMask mask;
  at::Tensor after;
  double p = 0;
};

at::Tensor cpu_generator_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_generator_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

[[noreturn]] void fail(const std::string& segment, const std::string& what) {
  throw CheckpointError(segment, "retrace::checkpoint(\"" + segment + "\"): " + what);
}

// What backward needs to recompute one segment call. Held by the autograd node.
struct SegmentCall : torch::CustomClassHolder {
  std::string name;
  std::uint64_t invocation = 0;
  SegmentFn fn;
  CheckpointOptions options;
  std::vector<c10::Device> cuda_devices;
  RngState rng;
  AutocastState autocast;
  std::vector<bool> requires_grad;  // per user input
  std::size_t num_inputs = 0;       // user inputs
  bool anchored = false;            // an anchor input follows the user inputs
  c10::Device device{c10::kCPU};
  std::vector<TapedDropout> tape;          // recompute_dropout() calls of the forward, in order
  std::size_t replayed = 0;                // of the tape, by the recompute running now
  std::vector<std::int64_t> region_sizes;  // recompute_linear_input: the forward's region output
};

void check_outputs(const SegmentCall& call, const std::vector<at::Tensor>& outputs, const char* phase) {
  if (outputs.empty()) {
    fail(call.name, std::string("the segment function returned no tensor at ") + phase +
                        "; return at least one floating-point tensor");
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& out = outputs[i];
    if (!out.defined()) {
      fail(call.name, "output " + std::to_string(i) + " is undefined at " + phase + "; every output must be a tensor");
    }
    if (!out.is_floating_point()) {
      fail(call.name, "output " + std::to_string(i) + " is " + describe(out) +
                          ", not floating point; gradients cannot flow through it, so compute "
                          "integer results outside the checkpointed segment");
    }
    if (out.device() != call.device) {
      fail(call.name, "output " + std::to_string(i) + " is on " + out.device().str() + " but the inputs are on " +
                          call.device.str() + "; a segment must keep its inputs and outputs on one device");
    }
  }
}

void notify(const SegmentCall& call, SegmentPhase phase, const std::vector<at::Tensor>& inputs,
            std::vector<at::Tensor>& outputs, bool will_recompute) {
  if (!detail::observers_attached()) return;
  SegmentEvent event{call.name, call.invocation, phase, inputs, outputs, will_recompute};
  t_observed.push_back({&call.name, phase});
  struct Pop {
    ~Pop() { t_observed.pop_back(); }
  } pop;
  detail::notify_observers(event);
}

// The inputs as the recompute sees them: detached leaves with the callers' requires_grad.
std::vector<at::Tensor> detached_like_recompute(const SegmentCall& call, const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> out;
  out.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    out.push_back(inputs[i].detach().requires_grad_(call.requires_grad[i]));
  }
  return out;
}

// The tape's tensors (each mask's bits, then the generator state after it), moved out of the call
// to be saved with save_for_backward: autograd frees them with the graph's other saved tensors.
std::vector<at::Tensor> take_tape(SegmentCall& call) {
  std::vector<at::Tensor> out;
  for (TapedDropout& t : call.tape) {
    out.push_back(std::move(t.mask.bits));
    out.push_back(std::move(t.after));
  }
  return out;
}

// Puts take_tape()'s tensors back, from saved[from...].
void restore_tape(SegmentCall& call, const std::vector<at::Tensor>& saved, std::size_t from) {
  for (std::size_t i = 0; i < call.tape.size(); ++i) {
    call.tape[i].mask.bits = saved.at(from + 2 * i);
    call.tape[i].after = saved.at(from + 2 * i + 1);
  }
}

// The call a node saved in forward, once backward may run it (backward() without inputs).
c10::intrusive_ptr<SegmentCall> saved_call(AutogradContext* ctx) {
  auto call = c10::static_intrusive_pointer_cast<SegmentCall>(ctx->saved_data["call"].toCapsule());
  if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
    fail(call->name, "backward reached this segment through torch::autograd::grad() or backward(inputs=...), "
                     "which reentrant checkpointing cannot serve (the recompute's gradients would be lost); "
                     "call backward() without inputs and read .grad()");
  }
  if (at::GradMode::is_enabled()) {
    fail(call->name, "backward runs with create_graph=true (double backward), which reentrant checkpointing "
                     "cannot serve (the gradients through the recompute would have no graph); run this "
                     "forward without checkpointing or selective recompute");
  }
  return call;
}

// Runs the call's function again on `inputs` (detached_like_recompute), with grad mode on, under
// the forward's RNG and autocast state.
std::vector<at::Tensor> recompute(SegmentCall& call, const std::vector<at::Tensor>& inputs) {
  std::optional<RngFork> fork;
  if (call.options.preserve_rng_state) {
    fork.emplace(call.cuda_devices);
    call.rng.restore();
  }
  std::optional<AutocastGuard> autocast;
  if (call.options.restore_autocast) autocast.emplace(call.autocast);
  at::AutoGradMode grad_mode(true);
  call.replayed = 0;
  std::vector<at::Tensor> outputs;
  {
    ActiveScope active(call.name, SegmentPhase::kRecompute, call.options.preserve_rng_state ? &call : nullptr);
    outputs = call.fn(inputs);
  }
  if (call.replayed != call.tape.size()) {
    fail(call.name, "the recompute ran " + std::to_string(call.replayed) + " of the forward's " +
                        std::to_string(call.tape.size()) +
                        " dropouts; the segment function must be deterministic in its structure");
  }
  take_tape(call);  // the saved variables keep them (for a retain_graph backward), not the call
  return outputs;
}

// Observers see (and injectors replace) the recompute's outputs with grad mode on, so a
// replacement stays part of the graph that backward runs through.
void notify_recompute(const SegmentCall& call, const std::vector<at::Tensor>& inputs,
                      std::vector<at::Tensor>& outputs) {
  std::vector<bool> required;
  for (const at::Tensor& o : outputs) required.push_back(o.requires_grad());
  at::AutoGradMode grad_mode(true);
  notify(call, SegmentPhase::kRecompute, inputs, outputs, false);
  for (std::size_t i = 0; i < outputs.size() && i < required.size(); ++i) {
    if (required[i] && !(outputs[i].defined() && outputs[i].requires_grad())) {
      fail(call.name, "an observer replaced recompute output " + std::to_string(i) +
                          " with a tensor outside the autograd graph; the segment's inputs and parameters would get "
                          "no gradient. Build the replacement from the output with grad mode on");
    }
  }
}

// The forward's outputs computed the way the recompute will compute them (ForwardMode).
std::vector<at::Tensor> run_forward(SegmentCall& call, const std::vector<at::Tensor>& inputs, bool will_recompute) {
  ActiveScope active(call.name, SegmentPhase::kForward,
                     will_recompute && call.options.preserve_rng_state ? &call : nullptr);
  if (will_recompute && call.options.forward_mode == ForwardMode::kLikeRecompute) {
    at::AutoGradMode grad_mode(true);
    std::vector<at::Tensor> outputs = call.fn(detached_like_recompute(call, inputs));
    for (at::Tensor& out : outputs) {
      if (out.defined()) out = out.detach();  // drops the segment's graph
    }
    return outputs;
  }
  return call.fn(inputs);
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentCall> call, bool will_recompute,
                               at::TensorList all_inputs) {
    std::vector<at::Tensor> inputs(all_inputs.begin(), all_inputs.begin() + call->num_inputs);
    std::vector<at::Tensor> outputs = run_forward(*call, inputs, will_recompute);
    check_outputs(*call, outputs, "forward");
    notify(*call, SegmentPhase::kForward, inputs, outputs, will_recompute);
    check_outputs(*call, outputs, "forward (after observers)");
    std::vector<at::Tensor> saved = inputs;
    for (at::Tensor& t : take_tape(*call)) saved.push_back(std::move(t));
    ctx->save_for_backward(saved);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto call = saved_call(ctx);
    const variable_list saved = ctx->get_saved_variables();
    restore_tape(*call, saved, call->num_inputs);
    const std::vector<at::Tensor> inputs =
        detached_like_recompute(*call, std::vector<at::Tensor>(saved.begin(), saved.begin() + call->num_inputs));
    std::vector<at::Tensor> outputs = recompute(*call, inputs);
    check_outputs(*call, outputs, "recompute");
    if (outputs.size() != grad_outputs.size()) {
      fail(call->name, "the recompute returned " + std::to_string(outputs.size()) +
                           " outputs but the forward returned " + std::to_string(grad_outputs.size()) +
                           "; the segment function must be deterministic in its structure");
    }
    notify_recompute(*call, inputs, outputs);

    variable_list roots, root_grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) {
      ActiveScope active(call->name, SegmentPhase::kBackward);
      torch::autograd::backward(roots, root_grads);
    }

    std::vector<at::Tensor> input_grads;
    input_grads.reserve(inputs.size());
    for (const at::Tensor& x : inputs) input_grads.push_back(x.requires_grad() ? x.grad() : at::Tensor());
    notify(*call, SegmentPhase::kBackward, grad_outputs, input_grads, false);

    // One slot per forward argument: the call, the flag, each user input, then the anchor.
    variable_list result;
    result.reserve(3 + input_grads.size());
    result.emplace_back();
    result.emplace_back();
    for (at::Tensor& g : input_grads) result.push_back(std::move(g));
    if (call->anchored) result.emplace_back();
    return result;
  }
};

}  // namespace

bool current_segment(ActiveSegment* out) {
  if (t_active.empty()) return false;
  out->segment = *t_active.back().name;
  out->phase = t_active.back().phase;
  return true;
}

bool observed_segment(ActiveSegment* out) {
  if (t_observed.empty()) return false;
  out->segment = *t_observed.back().name;
  out->phase = t_observed.back().phase;
  return true;
}

namespace {
// A call of `fn` on `inputs` as the segment `name`: its invocation number, the inputs' device
// and requires_grad flags, and (with grad mode on) the RNG state to recompute under.
c10::intrusive_ptr<SegmentCall> new_call(const std::string& name, SegmentFn fn, const std::vector<at::Tensor>& inputs,
                                         const CheckpointOptions& options, bool capture_rng = true) {
  auto call = c10::make_intrusive<SegmentCall>();
  call->name = name;
  call->invocation = g_next_invocation.fetch_add(1, std::memory_order_relaxed);
  call->fn = std::move(fn);
  call->options = options;
  call->num_inputs = inputs.size();
  std::optional<c10::Device> device;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    if (!x.defined()) fail(name, "input " + std::to_string(i) + " is undefined");
    if (!device) {
      device = x.device();
    } else if (x.device() != *device) {
      fail(name, "input " + std::to_string(i) + " is on " + x.device().str() + " but input 0 is on " + device->str() +
                     "; a segment must keep its inputs on one device");
    }
    if (x.is_cuda() &&
        std::find(call->cuda_devices.begin(), call->cuda_devices.end(), x.device()) == call->cuda_devices.end()) {
      call->cuda_devices.push_back(x.device());
    }
    call->requires_grad.push_back(x.requires_grad());
  }
  call->device = device.value_or(c10::Device(c10::kCPU));
  if (capture_rng && options.preserve_rng_state && at::GradMode::is_enabled()) {
    call->rng = RngState::capture(call->cuda_devices);
  }
  call->autocast = AutocastState::capture();
  return call;
}
}  // namespace

std::vector<at::Tensor> checkpoint(const std::string& name, SegmentFn fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  if (!fn) fail(name, "the segment function is empty");
  c10::intrusive_ptr<SegmentCall> call = new_call(name, std::move(fn), inputs, options);
  const bool grad_enabled = at::GradMode::is_enabled();
  const bool any_requires_grad = std::find(call->requires_grad.begin(), call->requires_grad.end(), true) !=
                                 call->requires_grad.end();
  std::vector<at::Tensor> all_inputs = inputs;
  if (grad_enabled && !any_requires_grad) {
    // The anchor makes the outputs part of the graph even when no input requires grad, so the
    // segment's parameters still get their gradients (PyTorch's reentrant checkpoint drops them).
    all_inputs.push_back(at::empty({0}, at::TensorOptions().device(call->device)).requires_grad_(true));
    call->anchored = true;
  }
  return CheckpointFunction::apply(call, grad_enabled, at::TensorList(all_inputs));
}

at::Tensor checkpoint(const std::string& name, TensorFn fn, const at::Tensor& input, const CheckpointOptions& options) {
  if (!fn) fail(name, "the segment function is empty");
  SegmentFn wrapped = [fn = std::move(fn)](const std::vector<at::Tensor>& xs) {
    return std::vector<at::Tensor>{fn(xs[0])};
  };
  return checkpoint(name, std::move(wrapped), std::vector<at::Tensor>{input}, options)[0];
}

namespace {
// [begin, end) of each group.
std::vector<std::pair<std::size_t, std::size_t>> groups(std::size_t stages, int segments) {
  if (segments < 1 || static_cast<std::size_t>(segments) > stages) {
    throw Error("retrace::checkpoint_sequential: segments must be between 1 and the number of "
                "stages (" +
                std::to_string(stages) + "), got " + std::to_string(segments));
  }
  std::vector<std::pair<std::size_t, std::size_t>> out;
  const std::size_t base = stages / segments, extra = stages % segments;
  std::size_t begin = 0;
  for (std::size_t g = 0; g < static_cast<std::size_t>(segments); ++g) {
    const std::size_t size = base + (g < extra ? 1 : 0);
    out.emplace_back(begin, begin + size);
    begin += size;
  }
  return out;
}
}  // namespace

std::vector<std::string> segment_names(const std::vector<Stage>& stages, int segments) {
  std::vector<std::string> names;
  for (auto [b, e] : groups(stages.size(), segments)) {
    names.push_back(e - b == 1 ? stages[b].name : stages[b].name + ".." + stages[e - 1].name);
  }
  return names;
}

at::Tensor checkpoint_sequential(const std::vector<Stage>& stages, int segments, const at::Tensor& input,
                                 const CheckpointOptions& options) {
  const auto names = segment_names(stages, segments);
  const auto ranges = groups(stages.size(), segments);
  at::Tensor x = input;
  for (std::size_t g = 0; g < ranges.size(); ++g) {
    // The recompute runs after this function returns: the group owns copies of its stages.
    std::vector<TensorFn> fns;
    for (std::size_t i = ranges[g].first; i < ranges[g].second; ++i) fns.push_back(stages[i].fn);
    x = checkpoint(
        names[g],
        [fns = std::move(fns)](const at::Tensor& in) {
          at::Tensor y = in;
          for (const TensorFn& f : fns) y = f(y);
          return y;
        },
        x, options);
  }
  return x;
}

const char* to_string(RegionKind kind) {
  switch (kind) {
    case RegionKind::kAttentionCore: return "attention_core";
    case RegionKind::kNorm: return "norm";
    case RegionKind::kActivation: return "activation";
    case RegionKind::kDropout: return "dropout";
  }
  return "?";
}

bool RecomputePolicy::recomputes(RegionKind kind) const {
  return std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
}

RecomputePolicy RecomputePolicy::selective() {
  return RecomputePolicy{{RegionKind::kAttentionCore, RegionKind::kNorm, RegionKind::kActivation, RegionKind::kDropout},
                         {}};
}

RecomputePolicy RecomputePolicy::attention_core() { return RecomputePolicy{{RegionKind::kAttentionCore}, {}}; }

namespace {
thread_local std::vector<RecomputePolicy> t_policies;

// The policy a region of `kind` recomputes under on this thread, or null: it runs plainly.
const RecomputePolicy* recompute_policy(RegionKind kind) {
  if (t_policies.empty() || !t_policies.back().recomputes(kind) || !t_active.empty() || !at::GradMode::is_enabled()) {
    return nullptr;
  }
  return &t_policies.back();
}

// recompute_linear_input's region output: what at::linear(a, W, b)'s addmm path takes whole.
void check_linear_input(const SegmentCall& call, const std::vector<at::Tensor>& outputs, const char* phase) {
  check_outputs(call, outputs, phase);
  if (outputs.size() != 1 || (outputs[0].dim() != 2 && outputs[0].dim() != 3) || !outputs[0].is_contiguous()) {
    fail(call.name, std::string("a region feeding a linear layer must return one contiguous 2-D or 3-D tensor; at ") +
                        phase + " it returned " +
                        (outputs.size() == 1 ? describe(outputs[0]) + (outputs[0].is_contiguous() ? "" : " (strided)")
                                             : std::to_string(outputs.size()) + " tensors"));
  }
}

// linear(fn(input), weight, bias) keeping input. Backward recomputes a = fn(input) and applies
// the backward of at::linear's path for a contiguous 2-D or 3-D input with a bias -- addmm(bias,
// a.view(M, K), weight.t()) -- as PyTorch's derivative formulas for addmm, t and view compute it
// (mm_mat1_backward, mm_mat2_backward in torch/csrc/autograd/FunctionsManual.cpp), so the
// gradients are the plain model's bits. The matmul's forward is not run again.
struct LinearInputFunction : public torch::autograd::Function<LinearInputFunction> {
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentCall> call, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias) {
    const std::vector<at::Tensor> inputs{input};
    std::vector<at::Tensor> outputs = run_forward(*call, inputs, true);
    check_linear_input(*call, outputs, "forward");
    notify(*call, SegmentPhase::kForward, inputs, outputs, true);
    check_linear_input(*call, outputs, "forward (after observers)");
    std::vector<at::Tensor> saved{input, weight};
    for (at::Tensor& t : take_tape(*call)) saved.push_back(std::move(t));
    ctx->save_for_backward(saved);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    ctx->set_materialize_grads(false);
    // at::linear's path for a contiguous 3-D input with a bias: addmm on the 2-D view, then a view
    // back, which recompute_linear_input takes outside this function (so the output is a plain
    // view, modifiable in place, as at::linear's is).
    const at::Tensor& a = outputs[0];
    call->region_sizes = a.sizes().vec();
    return at::linear(a.dim() == 3 ? a.view({a.size(0) * a.size(1), a.size(2)}) : a, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto call = saved_call(ctx);
    variable_list result(4);                // the call, input, weight, bias
    const at::Tensor& g = grad_outputs[0];  // 2-D, as addmm's output
    if (!g.defined()) return result;        // no gradient reached the layer: as plain, none leaves it
    const variable_list saved = ctx->get_saved_variables();
    restore_tape(*call, saved, 2);
    const std::vector<at::Tensor> inputs = detached_like_recompute(*call, {saved[0]});
    const at::Tensor& weight = saved[1];
    std::vector<at::Tensor> outputs = recompute(*call, inputs);
    check_linear_input(*call, outputs, "recompute");
    notify_recompute(*call, inputs, outputs);
    check_linear_input(*call, outputs, "recompute (after observers)");

    const at::Tensor a = outputs[0].detach();
    const bool flat = a.dim() == 3;
    const at::Tensor mat1 = flat ? a.view({a.size(0) * a.size(1), a.size(2)}) : a;
    const at::Tensor mat2 = weight.t();
    if (ctx->needs_input_grad(2)) result[3] = g;  // addmm's self: the engine sums it to the bias's shape
    if (ctx->needs_input_grad(1)) {
      // mm_mat2_backward, then the transpose's backward.
      const at::Tensor grad_mat2 = mat2.stride(0) == 1 && mat2.stride(1) == mat2.size(0) ? g.t().mm(mat1).t()
                                                                                         : mat1.t().mm(g);
      result[2] = grad_mat2.t();
    }
    at::Tensor grad_a;
    if (outputs[0].requires_grad()) {
      // mm_mat1_backward, then the view's backward; then through the recomputed region.
      const at::Tensor grad_mat1 = mat1.stride(0) == 1 && mat1.stride(1) == mat1.size(0) ? mat2.mm(g.t()).t()
                                                                                         : g.mm(mat2.t());
      grad_a = flat ? grad_mat1.reshape(a.sizes()) : grad_mat1;
      ActiveScope active(call->name, SegmentPhase::kBackward);
      torch::autograd::backward({outputs[0]}, {grad_a});
    }
    std::vector<at::Tensor> output_grads{grad_a};
    std::vector<at::Tensor> input_grads{inputs[0].requires_grad() ? inputs[0].grad() : at::Tensor()};
    notify(*call, SegmentPhase::kBackward, output_grads, input_grads, false);
    result[1] = input_grads[0];
    return result;
  }
};

// The mask a dropout region keeps between forward and backward: its bits, or the tensor itself
// (a saved variable) when an observer replaced it (its values need not be 0 and 1/(1-p)).
struct KeptMask : torch::CustomClassHolder {
  std::optional<PackedMask> bits;  // its layout; the bits tensor itself is a saved variable
  double p = 0;
};

// dropout(input) keeping its mask as bits: the region is the mask (no inputs, one output), drawn
// in forward and rebuilt from its bits in backward -- or, without RNG preservation, drawn again
// from the generator as it then stands (the negative control).
struct DropoutFunction : public torch::autograd::Function<DropoutFunction> {
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentCall> call, const at::Tensor& input,
                            double p) {
    const std::vector<at::Tensor> none;
    std::vector<at::Tensor> mask = run_forward(*call, none, true);
    check_mask(*call, mask, input.sizes(), "forward");
    const at::Tensor drawn = mask[0];
    notify(*call, SegmentPhase::kForward, none, mask, true);
    check_mask(*call, mask, input.sizes(), "forward (after observers)");
    if (call->options.preserve_rng_state) {
      // The tensor kept (bits, or an observer's replacement whole) is a saved variable, freed by
      // autograd with the others after backward.
      auto kept = c10::make_intrusive<KeptMask>();
      kept->p = p;
      if (mask[0].is_same(drawn)) {
        kept->bits = PackedMask::pack(drawn);
        ctx->save_for_backward({kept->bits->bits});
        kept->bits->bits = at::Tensor();
      } else {
        ctx->save_for_backward({mask[0]});
      }
      ctx->saved_data["mask"] = c10::IValue::make_capsule(kept);
    }
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    ctx->set_materialize_grads(false);
    return input * mask[0];  // at::dropout's CPU path: input * noise
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto call = c10::static_intrusive_pointer_cast<SegmentCall>(ctx->saved_data["call"].toCapsule());
    if (!grad_outputs[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const std::vector<at::Tensor> none;
    std::vector<at::Tensor> mask;
    if (call->options.preserve_rng_state) {
      auto kept = c10::static_intrusive_pointer_cast<KeptMask>(ctx->saved_data["mask"].toCapsule());
      const at::Tensor saved = ctx->get_saved_variables()[0];
      ActiveScope active(call->name, SegmentPhase::kRecompute);
      if (kept->bits) {
        PackedMask bits = *kept->bits;
        bits.bits = saved;
        mask.push_back(bits.unpack(kept->p));
      } else {
        mask.push_back(saved);
      }
    } else {
      mask = recompute(*call, none);
    }
    const at::Tensor& grad = grad_outputs[0];
    check_mask(*call, mask, grad.sizes(), "recompute");
    notify_recompute(*call, none, mask);
    check_mask(*call, mask, grad.sizes(), "recompute (after observers)");
    std::vector<at::Tensor> output_grads{at::Tensor()}, input_grads;
    notify(*call, SegmentPhase::kBackward, output_grads, input_grads, false);
    return {at::Tensor(), grad * mask[0], at::Tensor()};  // MulBackward0: grad * other
  }

  static void check_mask(const SegmentCall& call, const std::vector<at::Tensor>& mask, c10::IntArrayRef sizes,
                         const char* phase) {
    check_outputs(call, mask, phase);
    if (mask.size() != 1 || mask[0].sizes() != sizes) {
      fail(call.name, std::string("a dropout region's one output is its mask, of its input's size; at ") + phase +
                          " an observer left " +
                          (mask.size() == 1 ? describe(mask[0]) : std::to_string(mask.size()) + " tensors"));
    }
  }
};
}  // namespace

RecomputePolicyScope::RecomputePolicyScope(RecomputePolicy policy) { t_policies.push_back(std::move(policy)); }

RecomputePolicyScope::~RecomputePolicyScope() { t_policies.pop_back(); }

std::vector<at::Tensor> recompute_region(const std::string& name, RegionKind kind, SegmentFn fn,
                                         const std::vector<at::Tensor>& inputs) {
  if (!fn) fail(name, "the region function is empty");
  const RecomputePolicy* policy = recompute_policy(kind);
  if (policy == nullptr) return fn(inputs);
  return checkpoint(name, std::move(fn), inputs, policy->options);
}

at::Tensor recompute_linear_input(const std::string& name, RegionKind kind, TensorFn fn, const at::Tensor& input,
                                  const at::Tensor& weight, const at::Tensor& bias) {
  if (!fn) fail(name, "the region function is empty");
  if (kind != RegionKind::kNorm && kind != RegionKind::kActivation) {
    fail(name, std::string("recompute_linear_input takes a norm or activation region, not ") + to_string(kind));
  }
  const RecomputePolicy* policy = recompute_policy(kind);
  if (policy == nullptr || !bias.defined() || at::autocast::is_autocast_enabled(input.device().type()) ||
      !(input.requires_grad() || weight.requires_grad() || bias.requires_grad())) {
    return at::linear(fn(input), weight, bias);
  }
  SegmentFn region = [fn = std::move(fn)](const std::vector<at::Tensor>& xs) {
    return std::vector<at::Tensor>{fn(xs[0])};
  };
  c10::intrusive_ptr<SegmentCall> call = new_call(name, std::move(region), {input}, policy->options);
  const at::Tensor out = LinearInputFunction::apply(call, input, weight, bias);
  const std::vector<std::int64_t>& a = call->region_sizes;
  return a.size() == 3 ? out.view({a[0], a[1], out.size(1)}) : out;
}

at::Tensor recompute_dropout(const std::string& name, const at::Tensor& input, double p, bool train) {
  if (!train || !(p > 0 && p < 1) || !input.defined() || !input.device().is_cpu() || !input.is_floating_point() ||
      input.numel() == 0) {
    return at::dropout(input, p, train);
  }
  if (!t_active.empty()) {
    // Inside a segment preserving its random numbers: the forward keeps the mask's bits, the
    // recompute replays them instead of drawing again.
    const ActiveFrame& frame = t_active.back();
    if (frame.tape != nullptr && frame.phase == SegmentPhase::kForward) {
      at::Tensor noise = draw_noise(at::empty_like(input), p);
      frame.tape->tape.push_back({PackedMask::pack(noise), cpu_generator_state(), p});
      return input * noise;
    }
    if (frame.tape != nullptr && frame.phase == SegmentPhase::kRecompute) {
      SegmentCall& call = *frame.tape;
      if (call.replayed >= call.tape.size()) {
        fail(call.name, "the recompute ran more dropouts than the forward's " + std::to_string(call.tape.size()) +
                            "; the segment function must be deterministic in its structure");
      }
      const TapedDropout& taped = call.tape[call.replayed];
      if (taped.mask.sizes != input.sizes().vec() || taped.mask.options.dtype() != input.dtype() || taped.p != p) {
        fail(call.name, "dropout " + std::to_string(call.replayed) + " of the recompute is p=" + std::to_string(p) +
                            " on " + describe(input) + " but the forward's was p=" + std::to_string(taped.p) + " on " +
                            describe(c10::typeMetaToScalarType(taped.mask.options.dtype()), taped.mask.sizes) +
                            "; the segment function must be deterministic in its structure");
      }
      ++call.replayed;
      set_cpu_generator_state(taped.after);
      return input * taped.mask.unpack(p);
    }
    return at::dropout(input, p, train);
  }
  const RecomputePolicy* policy = recompute_policy(RegionKind::kDropout);
  if (policy == nullptr || !input.requires_grad()) return at::dropout(input, p, train);
  // The mask is laid out as at::dropout lays out its noise (empty_like).
  const at::Tensor like = at::empty_like(input);
  SegmentFn draw = [sizes = like.sizes().vec(), strides = like.strides().vec(), options = like.options(),
                    p](const std::vector<at::Tensor>&) {
    return std::vector<at::Tensor>{draw_noise(at::empty_strided(sizes, strides, options), p)};
  };
  return DropoutFunction::apply(new_call(name, std::move(draw), {}, policy->options, /*capture_rng=*/false), input, p);
}

}  // namespace retrace
