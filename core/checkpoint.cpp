#include <retrace/checkpoint.h>

#include <retrace/autocast.h>
#include <retrace/observer.h>
#include <retrace/rng.h>
#include <retrace/verify.h>

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <atomic>
#include <optional>

namespace retrace {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<std::uint64_t> g_next_invocation{1};

struct ActiveFrame {
  const std::string* name;
  SegmentPhase phase;
};
thread_local std::vector<ActiveFrame> t_active;

// Marks the calling thread as running a segment's phase for the scope.
class ActiveScope {
 public:
  ActiveScope(const std::string& name, SegmentPhase phase) { t_active.push_back({&name, phase}); }
  ~ActiveScope() { t_active.pop_back(); }
};

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

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentCall> call, bool will_recompute,
                               at::TensorList all_inputs) {
    std::vector<at::Tensor> inputs(all_inputs.begin(), all_inputs.begin() + call->num_inputs);
    std::vector<at::Tensor> outputs;
    ActiveScope active(call->name, SegmentPhase::kForward);
    if (will_recompute && call->options.forward_mode == ForwardMode::kLikeRecompute) {
      at::AutoGradMode grad_mode(true);
      outputs = call->fn(detached_like_recompute(*call, inputs));
      for (at::Tensor& out : outputs) {
        if (out.defined()) out = out.detach();  // drops the segment's graph
      }
    } else {
      outputs = call->fn(inputs);
    }
    check_outputs(*call, outputs, "forward");
    notify(*call, SegmentPhase::kForward, inputs, outputs, will_recompute);
    check_outputs(*call, outputs, "forward (after observers)");
    ctx->save_for_backward(inputs);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto call = c10::static_intrusive_pointer_cast<SegmentCall>(ctx->saved_data["call"].toCapsule());
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      fail(call->name, "backward reached this segment through torch::autograd::grad() or backward(inputs=...), "
                       "which reentrant checkpointing cannot serve (the recompute's gradients would be lost); "
                       "call backward() without inputs and read .grad()");
    }
    const std::vector<at::Tensor> inputs = detached_like_recompute(*call, ctx->get_saved_variables());

    std::vector<at::Tensor> outputs;
    {
      std::optional<RngFork> fork;
      if (call->options.preserve_rng_state) {
        fork.emplace(call->cuda_devices);
        call->rng.restore();
      }
      std::optional<AutocastGuard> autocast;
      if (call->options.restore_autocast) autocast.emplace(call->autocast);
      at::AutoGradMode grad_mode(true);
      ActiveScope active(call->name, SegmentPhase::kRecompute);
      outputs = call->fn(inputs);
    }
    check_outputs(*call, outputs, "recompute");
    if (outputs.size() != grad_outputs.size()) {
      fail(call->name, "the recompute returned " + std::to_string(outputs.size()) +
                           " outputs but the forward returned " + std::to_string(grad_outputs.size()) +
                           "; the segment function must be deterministic in its structure");
    }
    {
      // Observers see (and injectors replace) the recompute's outputs with grad mode on, so a
      // replacement stays part of the graph that backward runs through.
      const std::vector<bool> required = [&] {
        std::vector<bool> r;
        for (const at::Tensor& o : outputs) r.push_back(o.requires_grad());
        return r;
      }();
      at::AutoGradMode grad_mode(true);
      notify(*call, SegmentPhase::kRecompute, inputs, outputs, false);
      for (std::size_t i = 0; i < outputs.size() && i < required.size(); ++i) {
        if (required[i] && !(outputs[i].defined() && outputs[i].requires_grad())) {
          fail(call->name,
               "an observer replaced recompute output " + std::to_string(i) +
                   " with a tensor outside the autograd graph; the segment's inputs and parameters would get "
                   "no gradient. Build the replacement from the output with grad mode on");
        }
      }
    }

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

std::vector<at::Tensor> checkpoint(const std::string& name, SegmentFn fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  if (!fn) fail(name, "the segment function is empty");
  auto call = c10::make_intrusive<SegmentCall>();
  call->name = name;
  call->invocation = g_next_invocation.fetch_add(1, std::memory_order_relaxed);
  call->fn = std::move(fn);
  call->options = options;
  call->num_inputs = inputs.size();

  bool any_requires_grad = false;
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
    any_requires_grad |= x.requires_grad();
  }
  call->device = device.value_or(c10::Device(c10::kCPU));

  const bool grad_enabled = at::GradMode::is_enabled();
  if (options.preserve_rng_state && grad_enabled) call->rng = RngState::capture(call->cuda_devices);
  call->autocast = AutocastState::capture();

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
  }
  return "?";
}

bool RecomputePolicy::recomputes(RegionKind kind) const {
  return std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
}

RecomputePolicy RecomputePolicy::selective() { return RecomputePolicy{{RegionKind::kAttentionCore}, {}}; }

namespace {
thread_local std::vector<RecomputePolicy> t_policies;
}  // namespace

RecomputePolicyScope::RecomputePolicyScope(RecomputePolicy policy) { t_policies.push_back(std::move(policy)); }

RecomputePolicyScope::~RecomputePolicyScope() { t_policies.pop_back(); }

std::vector<at::Tensor> recompute_region(const std::string& name, RegionKind kind, SegmentFn fn,
                                         const std::vector<at::Tensor>& inputs) {
  if (!fn) fail(name, "the region function is empty");
  if (t_policies.empty() || !t_policies.back().recomputes(kind) || !t_active.empty() || !at::GradMode::is_enabled()) {
    return fn(inputs);
  }
  return checkpoint(name, std::move(fn), inputs, t_policies.back().options);
}

}  // namespace retrace
