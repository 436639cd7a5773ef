#include "provenance.h"

#include <retrace/observer.h>
#include <retrace/verify.h>

#include <ATen/record_function.h>
#include <ATen/ExpandUtils.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>

#include <algorithm>
#include <atomic>
#include <string_view>
#include <cmath>
#include <limits>
#include <mutex>
#include <unordered_map>

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
  // Infinities by design (guarded by mutex): each op given an infinity as an argument that made
  // one, as it would be reported; the storages holding those infinities, or ones that later ops
  // carried on from them (a scale after masking, a norm of an infinite gradient), with the index
  // of their op. The weak reference keeps a freed storage's address from being reused.
  std::vector<NonFiniteOrigin> given;
  struct Carrier {
    c10::weak_intrusive_ptr<c10::StorageImpl> keep;
    std::size_t given;
    c10::ScalarType dtype;  // of the tensor that carried it (to read the storage at the end)
  };
  std::unordered_map<const c10::StorageImpl*, Carrier> carriers;
  std::optional<std::size_t> last_carried;  // the infinity the last carrying op carried on
  std::string last_carrier;                 // that op
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
  // A cast of a wrapped number (a C++ or Python scalar, as `h * 1e5` wraps it): type promotion
  // casts it to the common dtype for a kernel that reads the scalar itself, in its computation
  // type. A constant past Half's range casts to an infinity no value of the run ever holds.
  bool scalar_cast = false;
  // Inputs (tensor-list elements too) in a storage that holds an infinity by design, as they were
  // before the op, with the index of the op that made it (Probe::given).
  struct Handed {
    at::Tensor tensor;
    std::size_t given;
  };
  std::vector<Handed> handed_given;
};

bool has_nonfinite(const at::Tensor& t) {
  if (!t.defined() || !(t.is_floating_point() || t.is_complex()) || t.numel() == 0) return false;
  return !at::isfinite(t.detach()).all().item<bool>();
}

bool has_nan(const at::Tensor& t) {
  if (!t.defined() || !(t.is_floating_point() || t.is_complex()) || t.numel() == 0) return false;
  return at::isnan(t.detach()).any().item<bool>();
}

bool has_inf(const at::Tensor& t) {
  if (!t.defined() || !(t.is_floating_point() || t.is_complex()) || t.numel() == 0) return false;
  return at::isinf(t.detach()).any().item<bool>();
}

// The probe's own ops (scans, copies) inside a callback: not observed, not probed again.
struct Inside {
  Inside() { t_inside = true; }
  ~Inside() { t_inside = false; }
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
  at::DisableRecordFunctionGuard no_recursion;
};

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
  const std::string_view name = fn.name();
  const bool cast = name == "aten::to" || name == "aten::_to_copy" || name == "aten::copy_";
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      ctx->inputs.push_back(v.toTensor());
      if (cast && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number())
        ctx->scalar_cast = true;
    } else if (v.isDouble() && !std::isfinite(v.toDouble())) ctx->infinite_scalar = true;
    else if (v.isScalar() && v.toScalar().isFloatingPoint() && !std::isfinite(v.toScalar().toDouble()))
      ctx->infinite_scalar = true;
  }
  {
    std::lock_guard<std::mutex> lock(g_probe->mutex);
    if (!g_probe->carriers.empty()) {
      auto note = [&](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage()) return;
        const auto it = g_probe->carriers.find(t.storage().unsafeGetStorageImpl());
        if (it != g_probe->carriers.end()) ctx->handed_given.push_back({t, it->second.given});
      };
      for (const c10::IValue& v : fn.inputs()) {
        if (v.isTensor()) note(v.toTensor());
        else if (v.isTensorList()) {
          for (const at::Tensor& t : v.toTensorVector()) note(t);
        }
      }
    }
  }
  // An in-place op overwrites its first input (and any input sharing its storage): keep a copy of
  // them as they are now, so that a report shows what the op was handed, not what it wrote.
  // An in-place op on a list (_foreach_mul_) overwrites its elements too: keep those holding an
  // infinity by design as they are now.
  if (is_in_place(fn.name())) {
    const Inside inside;
    if (!fn.inputs().empty() && fn.inputs()[0].isTensor() && ctx->inputs[0].defined() && ctx->inputs[0].has_storage()) {
      const c10::Storage destination = ctx->inputs[0].storage();
      for (at::Tensor& in : ctx->inputs) {
        if (in.defined() && in.has_storage() && in.storage().is_alias_of(destination)) in = in.detach().clone();
      }
    }
    for (ProbeContext::Handed& h : ctx->handed_given) h.tensor = h.tensor.detach().clone();
  }
  t_open.push_back(ctx.get());
  return ctx;
}

// The report of an op (or of `maker`, an op open around it whose kernel made what it returned):
// its segment and phase and, with `stats`, the stats of its inputs and outputs.
NonFiniteOrigin describe_op(const at::RecordFunction& fn, const ProbeContext* self, const ProbeContext* maker,
                            const std::vector<at::Tensor>& outputs, bool stats) {
  NonFiniteOrigin origin;
  origin.op = fn.name();
  if (maker) {
    origin.op = maker->name;
    origin.inner_op = fn.name();
  }
  ActiveSegment active;
  if (current_segment(&active)) {
    origin.segment = active.segment;
    origin.phase = to_string(active.phase);
  } else if (observed_segment(&active)) {  // an injector on the segment's output, not its own code
    origin.segment = active.segment;
    origin.phase = to_string(active.phase);
    origin.by_observer = true;
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
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION || t_backward_depth > 0) origin.phase = "backward";
  else if (origin.phase.empty() && g_probe->after_backward) origin.phase = "optimizer";
  else if (origin.phase.empty()) origin.phase = g_probe->backward_ran && !builds_graph() ? "post-backward" : "forward";
  if (!stats) return origin;
  if (const ProbeContext* ctx = maker ? maker : self) {
    for (std::size_t i = 0; i < ctx->inputs.size(); ++i) {
      origin.inputs.push_back(tensor_stats("input " + std::to_string(i), ctx->inputs[i]));
    }
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    origin.outputs.push_back(tensor_stats("output " + std::to_string(i), outputs[i]));
  }
  return origin;
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
  const Inside inside;
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
  const auto* self = static_cast<ProbeContext*>(raw);
  if (self && self->scalar_cast) return;  // a constant's cast for type promotion: no value of the run
  std::vector<at::Tensor> outputs;
  for (const c10::IValue& v : fn.outputs()) {
    if (v.isTensor()) outputs.push_back(v.toTensor());
    else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) outputs.push_back(t);
    }
  }
  // A view op's output aliases its input: no new values were computed (and a view of a fresh
  // allocation shows uninitialized bytes). In-place ops (trailing '_') do compute into their input,
  // and so do out= variants (overload "out", "IntList_out", ...: sum into a given tensor, as
  // mean and mse_loss do inside), whose output is their `out` argument.
  const bool in_place = is_in_place(name) || is_out_variant(fn);
  auto aliases_input = [&](const at::Tensor& t) {
    if (in_place || !self || !t.has_storage()) return false;
    for (const at::Tensor& in : self->inputs) {
      if (in.defined() && in.has_storage() && t.storage().is_alias_of(in.storage())) return true;
    }
    return false;
  };
  std::vector<at::Tensor> made;       // the outputs this op computed
  std::vector<at::Tensor> made_infs;  // ... those of them holding an infinity
  bool made_nan = false;
  for (const at::Tensor& t : outputs) {
    if (aliases_input(t)) continue;
    made.push_back(t);
    if (has_nonfinite(t)) {
      const bool nan = has_nan(t);
      made_nan = made_nan || nan;
      if (!nan || has_inf(t)) made_infs.push_back(t);
    }
  }
  const bool made_inf = !made_infs.empty();
  if (!made_nan && !made_inf) {
    // An op that overwrote a storage holding an infinity by design with finite values ends it.
    if (in_place) {
      std::lock_guard<std::mutex> lock(g_probe->mutex);
      for (const at::Tensor& t : made) {
        if (t.defined() && t.has_storage()) g_probe->carriers.erase(t.storage().unsafeGetStorageImpl());
      }
    }
    return;
  }
  // An infinity by design -- an op given one as an argument (masked_fill(mask, -inf)) makes it,
  // later ops may carry it on (a scale after the masking) -- is no fault while it stays an infinity:
  // a softmax absorbs it. It is named when it turns into a NaN, or when it is what the step ends
  // with (see find_first_nonfinite).
  const bool given_infinity = self && self->infinite_scalar;
  std::optional<std::size_t> handed_given;  // the earliest infinity by design this op was handed
  std::vector<at::Tensor> handed;
  if (self) {
    for (const ProbeContext::Handed& h : self->handed_given) {
      if (!has_inf(h.tensor)) continue;  // overwritten since with finite values
      handed.push_back(h.tensor);
      handed_given = handed_given ? std::min(*handed_given, h.given) : h.given;
    }
  }
  auto carry = [&](std::size_t given, bool replace) {
    for (const at::Tensor& t : made_infs) {
      if (!t.has_storage()) continue;
      const c10::Storage& storage = t.storage();
      const auto it = g_probe->carriers.find(storage.unsafeGetStorageImpl());
      if (it == g_probe->carriers.end()) {
        g_probe->carriers.emplace(storage.unsafeGetStorageImpl(),
                                  Probe::Carrier{storage.getWeakStorageImpl(), given, t.scalar_type()});
      } else if (replace) {
        it->second.given = given;
        it->second.dtype = t.scalar_type();
      }
    }
  };
  if (given_infinity && !made_nan) {
    NonFiniteOrigin origin = describe_op(fn, self, nullptr, outputs, /*stats=*/true);
    origin.given_infinity = true;
    std::lock_guard<std::mutex> lock(g_probe->mutex);
    g_probe->given.push_back(std::move(origin));
    // masked_fill runs masked_fill_ on a clone inside it: the outer op, ending last, is named.
    carry(g_probe->given.size() - 1, /*replace=*/true);
    return;
  }
  if (handed_given && !made_nan) {
    // Carried on -- unless it made infinities of its own: where no input it was handed (broadcast
    // to the output's shape) held one, and more of them than those inputs held (a sort or a flip
    // moves them, an overflow beside a mask adds some). Such infinities are its own, named if they
    // are not absorbed, as an infinity by design is.
    bool made_own = false;
    for (const at::Tensor& t : made_infs) {
      at::Tensor covered;
      std::int64_t held = 0;
      for (const at::Tensor& h : handed) {
        if (!at::is_expandable_to(h.sizes(), t.sizes())) continue;
        const at::Tensor inf = at::isinf(h).expand(t.sizes());
        held += inf.sum().item<std::int64_t>();
        covered = covered.defined() ? covered.logical_or(inf) : inf;
      }
      if (!covered.defined()) continue;  // a reduction, a reshape: carried
      const at::Tensor own = at::isinf(t);
      made_own = made_own ||
                 (own.logical_and(covered.logical_not()).any().item<bool>() && own.sum().item<std::int64_t>() > held);
    }
    std::lock_guard<std::mutex> lock(g_probe->mutex);
    if (!made_own) {
      carry(*handed_given, /*replace=*/false);
      g_probe->last_carried = *handed_given;
      g_probe->last_carrier = fn.name();
      return;
    }
    g_probe->given.push_back(describe_op(fn, self, nullptr, outputs, /*stats=*/true));
    carry(g_probe->given.size() - 1, /*replace=*/true);
    g_probe->last_carried = g_probe->given.size() - 1;
    g_probe->last_carrier.clear();
    return;
  }
  if (handed_given && made_nan) {
    // The infinity by design turned into a NaN here: its op is the first non-finite one.
    std::lock_guard<std::mutex> lock(g_probe->mutex);
    if (g_probe->found) return;
    NonFiniteOrigin origin = g_probe->given[*handed_given];
    const NonFiniteOrigin here = describe_op(fn, self, nullptr, outputs, /*stats=*/false);
    origin.nan_op = here.op;
    origin.nan_segment = here.segment;
    origin.nan_phase = here.phase;
    g_probe->found = std::move(origin);
    return;
  }

  // Handed a non-finite input it did not make: the value came from the kernel of an op still
  // open around this one -- the innermost one whose own inputs are all finite made it.
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
  NonFiniteOrigin origin = describe_op(fn, self, maker, outputs, /*stats=*/true);
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
                                                    const std::vector<NamedTensor>& batch, bool known_nonfinite) {
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
  if (probe.found || !probe.last_carried) return probe.found;
  // No op made a NaN or an infinity of its own: an infinity by design that no op absorbed. One
  // that the step left behind (in the gradients, the parameters) is named first, the earliest
  // such; else, when the step is known to be non-finite (its loss, its gradient norm), the one
  // carried last. A step that raised with nothing left holding one gets no op: its raise was not
  // about an infinity.
  std::optional<std::size_t> left;
  for (const auto& [impl, carrier] : probe.carriers) {
    const c10::intrusive_ptr<c10::StorageImpl> alive = carrier.keep.lock();
    if (!alive || (left && *left <= carrier.given)) continue;
    const std::size_t item = c10::elementSize(carrier.dtype);
    const auto numel = static_cast<std::int64_t>(alive->nbytes() / item);
    if (numel == 0) continue;
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(carrier.dtype).device(alive->device()));
    t.set_(c10::Storage(alive), 0, {numel}, {1});
    if (has_inf(t)) left = carrier.given;
  }
  if (left) {
    probe.found = probe.given[*left];
  } else if (known_nonfinite) {
    probe.found = probe.given[*probe.last_carried];
    probe.found->carried_to = probe.last_carrier;
  }
  return probe.found;
}

}  // namespace retrace
