#include "provenance.h"

#include <retrace/observer.h>
#include <retrace/verify.h>

#include <ATen/record_function.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>

#include <algorithm>
#include <atomic>
#include <string_view>
#include <cmath>
#include <limits>
#include <mutex>

namespace retrace {

TensorStats tensor_stats(const std::string& name, const at::Tensor& t) {
  TensorStats s;
  s.name = name;
  s.meta = describe(t);
  if (!t.defined() || t.numel() == 0 || !t.has_storage()) return s;
  const at::Tensor d = t.detach().scalar_type() == at::kBool ? t.detach().to(at::kInt) : t.detach();
  s.nonfinite = count_nonfinite(d);
  if (d.is_floating_point() || d.is_complex()) {
    const at::Tensor f = d.is_complex() ? d.abs() : d;
    const at::Tensor finite = f.masked_select(at::isfinite(f));
    if (finite.numel() > 0) {
      s.min = finite.min().item<double>();
      s.max = finite.max().item<double>();
      s.abs_max = finite.abs().max().item<double>();
    } else {  // no finite element: no min or max to show, not a 0 that looks like one
      s.min = s.max = s.abs_max = std::numeric_limits<double>::quiet_NaN();
    }
  } else {
    s.min = d.min().item<double>();
    s.max = d.max().item<double>();
    s.abs_max = d.abs().max().item<double>();
  }
  return s;
}

namespace {

struct Probe {
  std::mutex mutex;
  std::optional<NonFiniteOrigin> found;
  std::atomic<bool> backward_ran{false};  // an autograd backward function has run in this step
  std::atomic<bool> after_backward{false};
};
Probe* g_probe = nullptr;
thread_local int t_backward_depth = 0;
thread_local bool t_inside = false;
struct ProbeContext;
// The ops this thread is inside (outermost first): an op that ends with a non-finite output but
// was handed a non-finite input already got it from an enclosing op's own kernel (mse_loss
// squares into a tensor, then calls sum and div_ on it).
thread_local std::vector<ProbeContext*> t_open;

struct ProbeContext : at::ObserverContext {
  std::string name;
  std::vector<at::Tensor> inputs;
  bool infinite_scalar = false;  // e.g. masked_fill(mask, -inf): infinities by design
};

bool has_nonfinite(const at::Tensor& t) {
  if (!t.defined() || !(t.is_floating_point() || t.is_complex()) || t.numel() == 0) return false;
  return !at::isfinite(t.detach()).all().item<bool>();
}

bool has_nan(const at::Tensor& t) {
  if (!t.defined() || !(t.is_floating_point() || t.is_complex()) || t.numel() == 0) return false;
  return at::isnan(t.detach()).any().item<bool>();
}

// In-place ops (trailing '_': copy_, add_, fill_, ...) write into their first input.
bool is_in_place(std::string_view name) { return !name.empty() && name.back() == '_'; }

// An out= overload ("out", "IntList_out", "values_out"): it computes into a tensor it was handed.
bool is_out_variant(const at::RecordFunction& fn) {
  const auto op = fn.operator_name();
  if (!op) return false;
  const std::string& o = op->overload_name;
  return o == "out" || (o.size() > 4 && o.compare(o.size() - 4, 4, "_out") == 0);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    ++t_backward_depth;
    if (g_probe != nullptr) g_probe->backward_ran = true;
  }
  if (t_inside || g_probe == nullptr) return nullptr;
  auto ctx = std::make_unique<ProbeContext>();
  ctx->name = fn.name();
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) ctx->inputs.push_back(v.toTensor());
    else if (v.isDouble() && !std::isfinite(v.toDouble())) ctx->infinite_scalar = true;
    else if (v.isScalar() && v.toScalar().isFloatingPoint() && !std::isfinite(v.toScalar().toDouble()))
      ctx->infinite_scalar = true;
  }
  // An in-place op overwrites its first input (and any input sharing its storage): keep a copy of
  // them as they are now, so that a report shows what the op was handed, not what it wrote.
  if (is_in_place(fn.name()) && !fn.inputs().empty() && fn.inputs()[0].isTensor() && ctx->inputs[0].defined() &&
      ctx->inputs[0].has_storage()) {
    t_inside = true;
    struct Reset {
      ~Reset() { t_inside = false; }
    } reset;
    at::DisableRecordFunctionGuard no_recursion;
    const c10::Storage destination = ctx->inputs[0].storage();
    for (at::Tensor& in : ctx->inputs) {
      if (in.defined() && in.has_storage() && in.storage().is_alias_of(destination)) in = in.detach().clone();
    }
  }
  t_open.push_back(ctx.get());
  return ctx;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  const bool backward_scope = fn.scope() == at::RecordScope::BACKWARD_FUNCTION;
  struct Leave {
    bool backward;
    ~Leave() {
      if (backward) --t_backward_depth;
    }
  } leave{backward_scope};
  if (raw != nullptr && !t_open.empty() && t_open.back() == raw) t_open.pop_back();
  if (t_inside || g_probe == nullptr) return;
  t_inside = true;
  struct Reset {
    ~Reset() { t_inside = false; }
  } reset;
  at::DisableRecordFunctionGuard no_recursion;
  {
    std::lock_guard<std::mutex> lock(g_probe->mutex);
    if (g_probe->found) return;
  }
  // Allocation and view ops expose memory that some later kernel fills: their outputs hold
  // whatever bytes were there. The op that fills them is the one to check.
  const std::string_view name = fn.name();
  // Allocations hand back uninitialised memory, which may hold a NaN left by an earlier tensor.
  if (name.rfind("aten::empty", 0) == 0 || name.rfind("aten::new_empty", 0) == 0 || name == "aten::resize_" ||
      name == "aten::set_") {
    return;
  }
  std::vector<at::Tensor> outputs;
  for (const c10::IValue& v : fn.outputs()) {
    if (v.isTensor()) outputs.push_back(v.toTensor());
    else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) outputs.push_back(t);
    }
  }
  bool bad = false;
  // A view op's output aliases its input: no new values were computed (and a view of a fresh
  // allocation shows uninitialized bytes). In-place ops (trailing '_') do compute into their input,
  // and so do out= variants (overload "out", "IntList_out", ...: sum into a given tensor, as
  // mean and mse_loss do inside), whose output is their `out` argument.
  const bool in_place = is_in_place(name) || is_out_variant(fn);
  auto aliases_input = [&](const at::Tensor& t) {
    if (in_place || !raw || !t.has_storage()) return false;
    for (const at::Tensor& in : static_cast<ProbeContext*>(raw)->inputs) {
      if (in.defined() && in.has_storage() && t.storage().is_alias_of(in.storage())) return true;
    }
    return false;
  };
  // NaN always counts; an infinity counts unless the op was handed one (masking with -inf).
  const bool inf_by_design = raw && static_cast<ProbeContext*>(raw)->infinite_scalar;
  for (const at::Tensor& t : outputs) {
    if (aliases_input(t)) continue;
    bad = bad || (inf_by_design ? has_nan(t) : has_nonfinite(t));
  }
  if (!bad) return;

  NonFiniteOrigin origin;
  origin.op = fn.name();
  // Handed a non-finite input it did not make: the value came from the kernel of an op still
  // open around this one -- the innermost one whose own inputs are all finite made it.
  const auto* self = static_cast<ProbeContext*>(raw);
  const bool handed_nonfinite =
      self && !self->infinite_scalar &&
      std::any_of(self->inputs.begin(), self->inputs.end(), [](const at::Tensor& t) { return has_nonfinite(t); });
  const ProbeContext* maker = nullptr;
  if (handed_nonfinite) {
    for (auto it = t_open.rbegin(); it != t_open.rend() && !maker; ++it) {
      const bool finite_inputs = std::none_of((*it)->inputs.begin(), (*it)->inputs.end(),
                                              [](const at::Tensor& t) { return has_nonfinite(t); });
      if (finite_inputs && !(*it)->infinite_scalar) maker = *it;
    }
  }
  if (maker) {
    origin.op = maker->name;
    origin.inner_op = fn.name();
  }
  ActiveSegment active;
  if (current_segment(&active)) {
    origin.segment = active.segment;
    origin.phase = to_string(active.phase);
  }
  // Outside segments: before backward, forward; after autograd's backward and before the
  // program's after_backward call, post-backward (gradient faults and hooks) -- unless the op
  // builds an autograd graph, as a next micro-batch's forward does; after that call, optimizer.
  const auto builds_graph = [&] {
    for (const at::Tensor& t : outputs) {
      if (t.defined() && t.requires_grad()) return true;
    }
    return false;
  };
  if (backward_scope || t_backward_depth > 0) origin.phase = "backward";
  else if (origin.phase.empty() && g_probe->after_backward) origin.phase = "optimizer";
  else if (origin.phase.empty()) origin.phase = g_probe->backward_ran && !builds_graph() ? "post-backward" : "forward";
  if (const ProbeContext* ctx = maker ? maker : static_cast<ProbeContext*>(raw)) {
    for (std::size_t i = 0; i < ctx->inputs.size(); ++i) {
      origin.inputs.push_back(tensor_stats("input " + std::to_string(i), ctx->inputs[i]));
    }
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    origin.outputs.push_back(tensor_stats("output " + std::to_string(i), outputs[i]));
  }
  std::lock_guard<std::mutex> lock(g_probe->mutex);
  if (!g_probe->found) g_probe->found = std::move(origin);
}

class AfterBackwardFlag : public StepMonitor {
 public:
  explicit AfterBackwardFlag(Probe& p) : probe_(p) {}
  void after_backward(const at::Tensor&, const std::vector<NamedTensor>&) override { probe_.after_backward = true; }

 private:
  Probe& probe_;
};

}  // namespace

std::optional<NonFiniteOrigin> find_first_nonfinite(Program& program, std::int64_t step,
                                                    const std::vector<NamedTensor>& batch) {
  Probe probe;
  g_probe = &probe;
  const at::CallbackHandle handle =
      at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end).needsInputs(true).needsOutputs(true));
  AfterBackwardFlag flag(probe);
  try {
    // Inputs that are already non-finite are reported as such by the first op that reads them.
    program.step(step, batch, &flag);
  } catch (const std::exception&) {
    // The step raised (as it did when replayed): what went non-finite before that still counts.
  } catch (...) {
    at::removeCallback(handle);
    g_probe = nullptr;
    throw;
  }
  at::removeCallback(handle);
  g_probe = nullptr;
  return probe.found;
}

}  // namespace retrace
