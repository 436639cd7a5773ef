#include <retrace/defenses.h>
#include <retrace/diff.h>

#include <retrace/error.h>
#include <retrace/number.h>

#include <ATen/EmptyTensor.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace retrace {

// --- Clipping --------------------------------------------------------------------------------

double GradClipper::threshold() const {
  double threshold = options_.max_norm;
  if (!recent_.empty()) {
    std::vector<double> sorted(recent_.begin(), recent_.end());
    std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2), sorted.end());
    threshold = std::max(options_.max_norm, options_.multiplier * sorted[sorted.size() / 2]);
  }
  return threshold;
}

ClipResult GradClipper::clip(const std::vector<NamedTensor>& grads, const std::vector<at::Tensor>& norms, double total,
                             std::int64_t step, bool overflow_is_handled) {
  ClipResult r;
  r.clipped_norm = total;
  if (options_.mode == ClipMode::kOff) return r;
  // Every element finite, only their fp32 norm overflowing (gradients of 1e19 and more): clipped
  // as PyTorch's clip_grad_norm_ clips them, by max_norm / inf, to zero. Inf or NaN elements are
  // left as they are (or raise under error_if_nonfinite).
  auto elements_finite = [&] {
    at::DisableRecordFunctionGuard unseen;  // a check of the defense's, not an op of the step's (provenance)
    for (const NamedTensor& g : grads) {
      if (!all_finite(g.tensor)) return false;
    }
    return true;
  };
  const bool overflow_only = std::isinf(total) && total > 0 && !options_.error_if_nonfinite && elements_finite();
  if (!std::isfinite(total) && !overflow_only) {
    r.coef = std::numeric_limits<double>::quiet_NaN();
    if (options_.error_if_nonfinite && !overflow_is_handled) {
      throw DefenseRefusal("step " + std::to_string(step) + ": the total gradient norm is non-finite (" +
                           number_text(total) + "); clipping refuses it (error_if_nonfinite)");
    }
    return r;
  }
  torch::NoGradGuard no_grad;
  switch (options_.mode) {
    case ClipMode::kOff: return r;
    case ClipMode::kGlobal: {
      // PyTorch's clip_grad_norm_: every gradient times min(1, max_norm / (norm + 1e-6)),
      // computed as a float32 tensor from the norms' float32 total.
      std::vector<at::Tensor> gs;
      for (const NamedTensor& g : grads) gs.push_back(g.tensor.detach());
      if (!gs.empty()) {
        const at::Tensor t = gs.size() == 1 ? norms[0] : at::stack(norms).norm();
        const at::Tensor coef = at::clamp_max(options_.max_norm / (t + 1e-6), 1.0);
        for (at::Tensor& g : gs) g.mul_(coef.to(g.device()));
      }
      r.coef = std::min(1.0, options_.max_norm / (total + 1e-6));
      break;
    }
    case ClipMode::kPerTensor:
      for (std::size_t i = 0; i < grads.size(); ++i) {  // TensorFlow's clip_by_norm, per gradient
        const double n = norms[i].item<double>();
        if (n > options_.max_norm) grads[i].tensor.mul_(options_.max_norm / (n + 1e-6));
      }
      break;
    case ClipMode::kAdaptive: {
      const double threshold = this->threshold();
      if (total > threshold) {
        r.coef = threshold / (total + 1e-6);
        for (const NamedTensor& g : grads) g.tensor.mul_(r.coef);
      }
      break;
    }
  }
  std::vector<at::Tensor> clipped;
  for (const NamedTensor& g : grads) clipped.push_back(g.tensor.detach().to(at::kFloat).norm());
  r.clipped_norm = clipped.empty() ? 0.0 : at::stack(clipped).norm().item<double>();
  return r;
}

void GradClipper::on_applied(double total) {
  if (options_.mode != ClipMode::kAdaptive || !std::isfinite(total)) return;
  recent_.push_back(total);
  while (static_cast<std::int64_t>(recent_.size()) > options_.window) recent_.pop_front();
}

std::vector<NamedTensor> GradClipper::state() const {
  if (options_.mode != ClipMode::kAdaptive) return {};
  return {{"clip.recent_norms", at::tensor(std::vector<double>(recent_.begin(), recent_.end()), at::kDouble),
           TensorKind::kDefenseState}};
}

void GradClipper::load_state(const std::vector<NamedTensor>& state) {
  recent_.clear();
  for (const NamedTensor& n : state) {
    if (n.name != "clip.recent_norms") continue;
    const at::Tensor r = n.tensor.to(at::kDouble).contiguous();
    for (std::int64_t i = 0; i < r.numel(); ++i) recent_.push_back(r[i].item<double>());
  }
}

// --- LR schedule -----------------------------------------------------------------------------

double LrSchedule::lr(double base) const {
  const double scaled = base * scale_;
  double lr = scaled * factor_;
  if (plateau_.enabled) lr = std::max(lr, std::min(plateau_.min_lr, scaled));  // the floor of the cuts
  if (warmup_ > 0 && applied_ < warmup_) lr *= static_cast<double>(applied_ + 1) / static_cast<double>(warmup_);
  return lr;
}

void LrSchedule::on_applied(double loss, double base) {
  ++applied_;
  if (!plateau_.enabled) return;
  if (std::isfinite(loss) && loss < best_ * (1.0 - plateau_.threshold)) {
    best_ = loss;
    bad_ = 0;
  } else if (++bad_ > plateau_.patience) {
    // PyTorch's ReduceLROnPlateau: new = max(old x factor, min_lr), made only when it moves the
    // LR by more than eps.
    const double scaled = base * scale_;
    const double old_lr = std::max(scaled * factor_, std::min(plateau_.min_lr, scaled));
    const double new_lr = std::max(scaled * factor_ * plateau_.factor, std::min(plateau_.min_lr, scaled));
    if (old_lr - new_lr > plateau_.eps) factor_ *= plateau_.factor;
    bad_ = 0;
  }
}

void LrSchedule::restart() {
  applied_ = 0;
  factor_ = 1.0;
  best_ = std::numeric_limits<double>::infinity();
  bad_ = 0;
}

std::vector<NamedTensor> LrSchedule::state() const {
  std::vector<NamedTensor> out;
  out.push_back({"schedule.applied_steps", at::scalar_tensor(applied_, at::kLong), TensorKind::kDefenseState});
  if (plateau_.enabled) {
    // [factor, best loss (0 before the first), flat steps, has a best]: finite, so a state check
    // for non-finite values never trips on it.
    const bool has_best = std::isfinite(best_);
    out.push_back(
        {"schedule.plateau",
         at::tensor({factor_, has_best ? best_ : 0.0, static_cast<double>(bad_), has_best ? 1.0 : 0.0}, at::kDouble),
         TensorKind::kDefenseState});
  }
  return out;
}

void LrSchedule::load_state(const std::vector<NamedTensor>& state) {
  restart();
  for (const NamedTensor& n : state) {
    if (n.name == "schedule.applied_steps") applied_ = n.tensor.item<std::int64_t>();
    if (n.name == "schedule.plateau" && n.tensor.numel() == 4) {
      const at::Tensor p = n.tensor.to(at::kDouble).contiguous();
      factor_ = p[0].item<double>();
      best_ = p[3].item<double>() != 0 ? p[1].item<double>() : std::numeric_limits<double>::infinity();
      bad_ = static_cast<std::int64_t>(p[2].item<double>());
    }
  }
}

// --- Batch validation ------------------------------------------------------------------------

std::string invalid_batch_reason(const std::vector<NamedTensor>& batch, std::int64_t vocab) {
  for (const NamedTensor& n : batch) {
    if (n.kind != TensorKind::kInput || n.tensor.numel() == 0) continue;
    const at::Tensor& t = n.tensor;
    if (t.is_floating_point()) {
      if (!at::isfinite(t).all().item<bool>()) return "non-finite features in '" + n.name + "'";
    } else if (vocab > 0 && (t.min().item<std::int64_t>() < 0 || t.max().item<std::int64_t>() >= vocab)) {
      return "token ids outside the vocabulary in '" + n.name + "'";
    }
  }
  return "";
}

// --- Program state helpers -------------------------------------------------------------------

std::vector<NamedTensor> named_parameters(const torch::nn::Module& module, const std::string& prefix) {
  std::vector<NamedTensor> out;
  for (const auto& p : module.named_parameters()) out.push_back({prefix + p.key(), p.value(), TensorKind::kParameter});
  return out;
}

std::vector<NamedTensor> named_buffers(const torch::nn::Module& module, const std::string& prefix) {
  std::vector<NamedTensor> out;
  for (const auto& b : module.named_buffers()) out.push_back({prefix + b.key(), b.value(), TensorKind::kBuffer});
  return out;
}

namespace {

// The name of a parameter without named_parameters()' default "param." prefix.
std::string bare(const std::string& param) {
  const std::string p = "param.";
  return param.rfind(p, 0) == 0 ? param.substr(p.size()) : param;
}

// "optim.NAME." for parameter "param.NAME" or "NAME".
std::string optim_prefix(const std::string& param) { return "optim." + bare(param) + "."; }

// "grad.NAME" for parameter "param.NAME" or "NAME": what the monitor (the recorder) sees.
std::string gradient_name(const std::string& param) { return "grad." + bare(param); }

template <typename State>
void save_adam(const State& st, const std::string& prefix, std::vector<NamedTensor>& out) {
  const TensorKind k = TensorKind::kOptimizerState;
  // A 0-dim int64 tensor made without dispatch (at::scalar_tensor dispatches twice): the recorder
  // calls state() twice a step, and a model has a step count per parameter.
  at::Tensor step = at::detail::empty_cpu({}, at::kLong, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  *step.data_ptr<std::int64_t>() = st.step();
  out.push_back({prefix + "step", std::move(step), k});
  out.push_back({prefix + "exp_avg", st.exp_avg(), k});
  out.push_back({prefix + "exp_avg_sq", st.exp_avg_sq(), k});
  if (st.max_exp_avg_sq().defined() && st.max_exp_avg_sq().numel() > 0)
    out.push_back({prefix + "max_exp_avg_sq", st.max_exp_avg_sq(), k});
}

const at::Tensor& need(const std::map<std::string, at::Tensor>& by_name, const std::string& name) {
  auto it = by_name.find(name);
  if (it == by_name.end())
    throw Error("the recorded state lacks '" + name + "'; was it recorded by another program or configuration?");
  return it->second;
}

// `by_name`'s tensors are the optimizer's to keep (load_optimizer_state_from cloned what it must).
template <typename State>
std::unique_ptr<State> load_adam(const std::map<std::string, at::Tensor>& by_name, const std::string& prefix) {
  auto st = std::make_unique<State>();
  const at::Tensor& step = need(by_name, prefix + "step");
  if (step.numel() != 1 || step.is_floating_point())
    throw Error("the recorded '" + prefix + "step' is not an integer scalar");
  st->step(step.item<std::int64_t>());
  st->exp_avg(need(by_name, prefix + "exp_avg"));
  st->exp_avg_sq(need(by_name, prefix + "exp_avg_sq"));
  if (auto it = by_name.find(prefix + "max_exp_avg_sq"); it != by_name.end()) st->max_exp_avg_sq(it->second);
  return st;
}

enum class OptimizerKind { kAdamW, kAdam, kSgd };

OptimizerKind kind_of(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return OptimizerKind::kSgd;
  throw Error("retrace::optimizer_state: only Adam, AdamW and SGD are supported; save and load another "
              "optimizer's state in the program's own state() and load_state()");
}

}  // namespace

std::vector<NamedTensor> optimizer_state(torch::optim::Optimizer& optimizer,
                                         const std::vector<NamedTensor>& parameters) {
  std::vector<NamedTensor> out;
  auto& states = optimizer.state();
  out.reserve(parameters.size() * 3);  // Adam's step and moments (SGD: a momentum buffer)
  for (const NamedTensor& p : parameters) {
    auto it = states.find(p.tensor.unsafeGetTensorImpl());
    if (it == states.end()) continue;
    const std::string prefix = optim_prefix(p.name);
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      save_adam(*s, prefix, out);
    } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      save_adam(*s, prefix, out);
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      if (s->momentum_buffer().defined())
        out.push_back({prefix + "momentum_buffer", s->momentum_buffer(), TensorKind::kOptimizerState});
    }
  }
  return out;
}

namespace {
// `adopt`: `state`'s tensors are given up (moved out of it), and the optimizer keeps each one that
// nothing else can see: its only handle, the only tensor on its storage, contiguous and the whole
// of it. Anything else -- every tensor when not `adopt`, a view into a larger tensor, a handle to
// a tensor someone still holds (another optimizer's live moment in a temporary vector) -- is
// cloned: the optimizer updates its moments in place. A tensor moved to the parameter's device
// is a new one, the optimizer's own.
void load_optimizer_state_from(torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& parameters,
                               std::vector<NamedTensor>& state, bool adopt) {
  const OptimizerKind kind = kind_of(optimizer);
  auto& states = optimizer.state();
  states.clear();
  for (const NamedTensor& p : parameters) {
    const std::string prefix = optim_prefix(p.name);
    std::map<std::string, at::Tensor> local;
    for (NamedTensor& n : state) {
      // One of this parameter's entries: the prefix and a field name without a dot, so that a
      // parameter named "fc" does not take "fc.weight"'s entries.
      if (n.name.rfind(prefix, 0) != 0 || n.name.find('.', prefix.size()) != std::string::npos) continue;
      at::Tensor t = adopt ? std::move(n.tensor) : n.tensor;
      if (!t.defined()) continue;
      if (t.device() != p.tensor.device()) {
        t = t.to(p.tensor.device());
      } else if (!adopt || t.use_count() != 1 || t.storage().use_count() != 1 || !t.is_contiguous() ||
                 t.storage_offset() != 0 || t.storage().nbytes() != t.nbytes()) {
        t = t.clone();
      }
      local[n.name] = std::move(t);
    }
    if (local.empty()) continue;
    void* key = p.tensor.unsafeGetTensorImpl();
    switch (kind) {
      case OptimizerKind::kAdamW: states[key] = load_adam<torch::optim::AdamWParamState>(local, prefix); break;
      case OptimizerKind::kAdam: states[key] = load_adam<torch::optim::AdamParamState>(local, prefix); break;
      case OptimizerKind::kSgd: {
        auto st = std::make_unique<torch::optim::SGDParamState>();
        st->momentum_buffer(need(local, prefix + "momentum_buffer"));
        states[key] = std::move(st);
        break;
      }
    }
  }
}
}  // namespace

void load_optimizer_state(torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& parameters,
                          const std::vector<NamedTensor>& state) {
  std::vector<NamedTensor> handles = state;  // handles only: every tensor is cloned
  load_optimizer_state_from(optimizer, parameters, handles, false);
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& parameters,
                          std::vector<NamedTensor>&& state) {
  load_optimizer_state_from(optimizer, parameters, state, true);
}

void copy_state_into(const std::vector<NamedTensor>& targets, const std::vector<NamedTensor>& state) {
  std::map<std::string, const at::Tensor*> by_name;
  for (const NamedTensor& n : state) by_name[n.name] = &n.tensor;
  torch::NoGradGuard no_grad;
  for (const NamedTensor& t : targets) {
    auto it = by_name.find(t.name);
    if (it == by_name.end())
      throw Error("the recorded state lacks '" + t.name + "'; was it recorded by another program or configuration?");
    const at::Tensor& from = *it->second;
    if (from.sizes() != t.tensor.sizes() || from.scalar_type() != t.tensor.scalar_type()) {
      throw Error("the recorded state's '" + t.name + "' is " + std::string(c10::toString(from.scalar_type())) +
                  " of another shape than the program's; was it recorded by another program or configuration?");
    }
    at::Tensor target = t.tensor;
    target.copy_(from);
    if (t.kind == TensorKind::kParameter) target.mutable_grad() = at::Tensor();  // a step starts without gradients
  }
}

// --- Defenses --------------------------------------------------------------------------------

Defenses::Defenses(DefenseOptions options, std::vector<InjectionSpec> injections) {
  configure(std::move(options), std::move(injections));
}

Defenses::~Defenses() = default;

void Defenses::attach(Program& program, torch::optim::Optimizer& optimizer, std::vector<NamedTensor> parameters,
                      TrainingTraits traits) {
  program_ = &program;
  optimizer_ = &optimizer;
  for (NamedTensor& p : parameters) p.kind = TensorKind::kParameter;
  parameters_ = std::move(parameters);
  gradient_names_.clear();
  for (const NamedTensor& p : parameters_) gradient_names_.push_back(gradient_name(p.name));
  traits_ = traits;
  configure(options_, injector_ ? injector_->specs() : std::vector<InjectionSpec>{});
}

void Defenses::configure(DefenseOptions options, std::vector<InjectionSpec> injections) {
  if (in_step_) throw Error("retrace::Defenses::configure inside a step");
  for (const InjectionSpec& in : injections) {
    if (program_ && in.type == InjectionType::kCorruptBatch && in.mode == "token_out_of_range" && traits_.vocab <= 0) {
      throw Error("injection corrupt_batch: mode token_out_of_range needs the program's vocabulary "
                  "(TrainingTraits::vocab); this program declares none (use nan_features for feature inputs)");
    }
  }
  options_ = std::move(options);
  if (options.skip_nonfinite_ranks && program_ && !traits_.gradient_sync) {
    throw Error("defense skip_nonfinite_ranks needs a data-parallel program (TrainingTraits::gradient_sync); this "
                "program trains in one process: use skip_nonfinite");
  }
  injector_ = std::make_unique<Injector>(std::move(injections));
  if (traits_.gradient_sync) injector_->set_rank(traits_.gradient_sync->ranks().rank);
  if (traits_.autocast != at::kFloat) injector_->set_activation_dtype(traits_.autocast);
  scaler_.reset();
  if (options_.loss_scaling.enabled) scaler_ = std::make_unique<LossScaler>(options_.loss_scaling, traits_.device);
  clipper_ = GradClipper(options_.clip);
  schedule_ = LrSchedule(options_.warmup_steps, options_.lr_scale, options_.plateau);
  verifier_.reset();
  if (options_.verify_recompute) {
    VerifyOptions v;
    v.policy = VerifyPolicy::kRecord;
    verifier_ = std::make_unique<RecomputeVerifier>(v);
  }
  snapshots_.clear();
  failures_in_a_row_ = first_failure_ = rollbacks_ = caught_mismatches_ = 0;
}

Program& Defenses::program() const {
  if (!program_) throw Error("retrace::Defenses: attach() the program, optimizer and parameters before the first step");
  return *program_;
}

DefendedStep Defenses::begin(std::int64_t step, StepMonitor* monitor) {
  program();  // attached
  if (in_step_)
    throw Error("retrace::Defenses::begin: step " + std::to_string(step) + " begun before the last one finished");
  return DefendedStep(*this, step, monitor);
}

std::vector<NamedTensor> Defenses::state() const {
  std::vector<NamedTensor> out;
  if (scaler_) out = scaler_->state();
  for (NamedTensor& n : schedule_.state()) out.push_back(std::move(n));
  for (NamedTensor& n : clipper_.state()) out.push_back(std::move(n));
  return out;
}

void Defenses::load_state(const std::vector<NamedTensor>& state) {
  if (scaler_) scaler_->load_state(state);
  schedule_.load_state(state);
  clipper_.load_state(state);
}

void Defenses::check_in(const std::vector<NamedTensor>& program_state) const {
  for (const NamedTensor& n : state()) {
    const bool found =
        std::any_of(program_state.begin(), program_state.end(), [&](const NamedTensor& s) { return s.name == n.name; });
    if (!found) {
      throw Error("the program's state() lacks the defenses' '" + n.name +
                  "': append defenses.state() to state() and call defenses.load_state() in load_state(), or replay "
                  "cannot restore what the defenses carry from step to step");
    }
  }
}

bool Defenses::parameters_finite() const { return retrace::parameters_finite(parameters_); }

bool parameters_finite(Program& program) {
  const Defenses* d = program.defenses();
  return d ? d->parameters_finite() : parameters_finite(program.state());
}

double Defenses::next_lr() const {
  if (!optimizer_ || optimizer_->param_groups().empty()) return 0.0;
  return schedule_.lr(optimizer_->param_groups()[0].options().get_lr());
}

double Defenses::loss_scale() const { return scaler_ ? scaler_->current_scale() : 1.0; }

// --- One step --------------------------------------------------------------------------------

DefendedStep::DefendedStep(Defenses& d, std::int64_t step, StepMonitor* monitor)
    : d_(&d), step_(step), monitor_(monitor) {
  d.in_step_ = true;
  d.injector_->begin_step(step);
  // The LR: the program's own, through the schedule, times an injected spike.
  const double spike = d.injector_->lr_factor();
  for (auto& group : d.optimizer_->param_groups()) {
    const double own = group.options().get_lr();
    own_lrs_.push_back(own);
    group.options().set_lr(d.schedule_.lr(own) * spike);
    set_lrs_.push_back(group.options().get_lr());
  }
  out_.lr = d.optimizer_->param_groups().empty() ? 0.0 : d.optimizer_->param_groups()[0].options().get_lr();
  out_.loss_scale = d.loss_scale();
  for (const NamedTensor& n : d.program_->state()) {
    if (n.kind != TensorKind::kBuffer || !n.tensor.defined()) continue;
    buffers_.push_back(n.tensor);
    buffer_versions_.push_back(n.tensor._version());
  }
}

DefendedStep::~DefendedStep() {
  detach_observers();
  if (!finished_) {
    restore_lr();
    if (d_->scaler_) d_->scaler_->discard_unscale();
    d_->in_step_ = false;
  }
}

void DefendedStep::restore_lr() {
  auto& groups = d_->optimizer_->param_groups();
  for (std::size_t i = 0; i < groups.size() && i < own_lrs_.size(); ++i) groups[i].options().set_lr(own_lrs_[i]);
}

void DefendedStep::detach_observers() {
  extra_scope_.reset();
  verify_scope_.reset();
  inject_scope_.reset();
}

namespace {
std::string bad_ranks_reason(const std::vector<int>& ranks) {
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
  return std::string("non-finite gradients on rank") + (ranks.size() > 1 ? "s " : " ") + list +
         " before the all-reduce: every rank skips";
}
}  // namespace

std::vector<int> DefendedStep::sync_gradients(const std::vector<NamedTensor>& grads) {
  Defenses& d = *d_;
  GradientSync* sync = d.traits_.gradient_sync;
  if (!sync) return {};
  std::vector<int> bad;
  if (d.options_.skip_nonfinite_ranks) {
    bool finite = true;
    for (const NamedTensor& g : grads) finite = finite && at::isfinite(g.tensor).all().item<bool>();
    bad = sync->ranks_with(!finite);
    if (!bad.empty()) {
      // Skipped on every rank, nothing to average; a loss scaler owns overflow, so every rank
      // hands it the same non-finite gradients.
      if (d.scaler_) {
        for (const NamedTensor& g : grads) g.tensor.fill_(std::numeric_limits<float>::quiet_NaN());
      }
      return bad;
    }
  }
  std::vector<at::Tensor> tensors;
  for (const NamedTensor& g : grads) tensors.push_back(g.tensor);
  sync->average(tensors);
  return bad;
}

void DefendedStep::skip(std::string why) {
  out_.skipped = true;
  out_.skip_reason = std::move(why);
}

std::vector<NamedTensor> DefendedStep::batch(const std::vector<NamedTensor>& batch_in) {
  Defenses& d = *d_;
  if (batch_done_)
    throw Error("retrace::DefendedStep::batch: step " + std::to_string(step_) + " took its batch already");
  batch_done_ = true;
  std::vector<NamedTensor> batch = batch_in;
  d.injector_->corrupt_batch(batch, d.traits_.vocab);
  if (d.options_.validate_batch) {
    std::string bad = invalid_batch_reason(batch, d.traits_.vocab);
    // Data parallel: a rank that skipped alone would join none of this step's collectives.
    if (GradientSync* sync = d.traits_.gradient_sync) {
      const std::vector<int> ranks = sync->ranks_with(!bad.empty());
      if (bad.empty() && !ranks.empty()) bad = "on rank " + std::to_string(ranks.front()) + "; every rank skips";
    }
    if (!bad.empty()) {
      skip("invalid batch: " + bad);
      d.failures_in_a_row_ = 0;  // nothing ran, nothing rolled back: a run of failures ends here
      done_ = true;
      return batch;
    }
  }
  // The rollback snapshot, before any injected corruption of the state -- but not while a run of
  // failures is being rolled back: the state is then a restored copy of an older snapshot.
  const bool snapshot = d.options_.rollback && d.failures_in_a_row_ == 0;
  if (snapshot || !d.injector_->empty()) {
    const std::vector<NamedTensor> state = d.program().state();  // the live tensors, gathered once
    if (snapshot) {
      d.snapshots_.push_back({step_, clone_all(state)});
      while (static_cast<std::int64_t>(d.snapshots_.size()) > d.options_.rollback_depth) d.snapshots_.pop_front();
    }
    if (!d.injector_->empty()) d.injector_->flip_state(state);
  }
  return batch;
}

DefendedStep::ForwardScope::ForwardScope(const AutocastState& state) {
  if (state.any_enabled()) guard_ = std::make_unique<AutocastGuard>(state);
}
DefendedStep::ForwardScope::~ForwardScope() = default;

DefendedStep::ForwardScope DefendedStep::forward() {
  Defenses& d = *d_;
  // The batch's injections, the rollback snapshot and the state bit flips happen in batch(): a
  // step without it would train unprotected and uninjected, silently.
  if (!batch_done_ || done_) {
    throw Error("retrace::DefendedStep::forward: step " + std::to_string(step_) +
                (done_ ? " was skipped (its batch is invalid); return finish()" : ": call batch() first"));
  }
  detach_observers();
  if (!d.injector_->empty())
    inject_scope_.emplace(*d.injector_, ObserverOrder::kFirst);  // the others see injected values
  if (d.verifier_) {
    mismatches_before_ = d.verifier_->mismatches().size();
    verify_scope_.emplace(*d.verifier_);
  }
  if (d.extra_observer_) extra_scope_.emplace(*d.extra_observer_);
  AutocastState ac;
  if (d.traits_.autocast != at::kFloat) ac.entries.push_back({d.traits_.device.type(), true, d.traits_.autocast});
  return ForwardScope(ac);
}

void DefendedStep::backward(const at::Tensor& loss) {
  Defenses& d = *d_;
  const at::Tensor part = loss.detach().to(at::kFloat);
  // Gradient accumulation: one backward() per micro-batch, the step's loss their sum.
  const at::Tensor this_loss = loss.to(at::kFloat);
  loss_ = backward_done_ ? loss_ + part : part;
  const double w = d.traits_.loss_weight;
  at::Tensor objective = d.injector_->on_loss(w != 1.0 ? this_loss * w : this_loss);
  if (d.scaler_) objective = d.scaler_->scale(objective);
  // A buffer the forward wrote is written again by a checkpointed segment's recompute, which runs
  // the forward once more in training mode: BatchNorm would update its running statistics twice a
  // step (num_batches_tracked counting 2). Put back what backward wrote into those.
  struct Written {
    std::size_t index;
    std::uint32_t version;  // before backward
    at::Tensor value;
  };
  std::vector<Written> written;
  for (std::size_t i = 0; i < buffers_.size(); ++i) {
    const std::uint32_t v = buffers_[i]._version();
    if (v != buffer_versions_[i]) written.push_back({i, v, buffers_[i].detach().clone()});
  }
  objective.backward();
  {
    const torch::NoGradGuard no_grad;
    for (const Written& w : written) {
      if (buffers_[w.index]._version() != w.version) buffers_[w.index].copy_(w.value);
    }
  }
  detach_observers();
  backward_done_ = true;
}

StepOutcome DefendedStep::finish() {
  Defenses& d = *d_;
  detach_observers();
  if (!done_ && !backward_done_)
    throw Error("retrace::DefendedStep::finish: step " + std::to_string(step_) + " has no backward()");
  if (!done_) {
    // The LR begin() set is the one the optimizer must step with: a program that sets its own
    // after begin() overrides the schedule and an injected spike (which would count as fired), and
    // finish() puts its LR back to the one before the step.
    const auto& groups = d.optimizer_->param_groups();
    for (std::size_t i = 0; i < groups.size() && i < set_lrs_.size(); ++i) {
      const double now = groups[i].options().get_lr();
      if (now == set_lrs_[i] || (std::isnan(now) && std::isnan(set_lrs_[i]))) continue;
      throw Error("retrace::DefendedStep::finish: step " + std::to_string(step_) + ": the optimizer's LR (group " +
                  std::to_string(i) + ") is " + number_text(now) + ", but begin() set it to " +
                  number_text(set_lrs_[i]) +
                  ": the program changed it inside the step, over the defenses' schedule and any injected LR "
                  "spike; set the program's own LR before begin() (it is the base the schedule scales)");
    }
    std::vector<NamedTensor> grads;
    for (std::size_t i = 0; i < d.parameters_.size(); ++i) {
      const at::Tensor& g = d.parameters_[i].tensor.grad();
      if (g.defined()) grads.push_back({d.gradient_names_[i], g, TensorKind::kGradient});
    }
    d.injector_->on_grads(grads);
    const std::vector<int> bad_ranks = sync_gradients(grads);
    if (monitor_) monitor_->after_backward(loss_, grads);
    out_.loss = loss_.item<double>();

    // Unscale (the norm and clipping see true gradients), then the norm before clipping.
    bool finite_grads = true;
    if (d.scaler_) finite_grads = d.scaler_->unscale(*d.optimizer_);
    const bool finite_elements = finite_grads;  // what the scaler found, before the norm
    std::vector<at::Tensor> norms;
    for (const NamedTensor& g : grads) norms.push_back(g.tensor.detach().to(at::kFloat).norm());
    out_.grad_norm = norms.empty() ? 0.0 : at::stack(norms).norm().item<double>();
    finite_grads = finite_grads && std::isfinite(out_.grad_norm);

    std::size_t caught = 0;
    std::string caught_segment;
    if (d.verifier_) {
      const std::vector<RecomputeMismatch> all = d.verifier_->mismatches();
      caught = all.size() - mismatches_before_;
      if (caught > 0) caught_segment = all[mismatches_before_].segment;
      d.verifier_->reset();  // per step: its list would otherwise grow for the whole run
    }
    // Data parallel: the verifier runs on each rank; a mismatch on any one skips the step on all.
    if (d.verifier_ && d.traits_.gradient_sync) {
      const std::vector<int> ranks = d.traits_.gradient_sync->ranks_with(caught > 0);
      if (caught == 0 && !ranks.empty()) {
        caught = 1;
        caught_segment = "a segment of rank " + std::to_string(ranks.front());
        --d.caught_mismatches_;  // counted on the rank that caught it
      }
    }
    bool apply = true;
    // skip_nonfinite_ranks found a rank with non-finite gradients: every rank skips alike (with a
    // loss scaler the gradients were poisoned on every rank and take its overflow path instead).
    // This rank's own gradients decide nothing more: no rollback, no schedule step.
    const bool rank_skip = !bad_ranks.empty() && !d.scaler_;
    if (rank_skip) {
      apply = false;
      finite_grads = true;
      skip(bad_ranks_reason(bad_ranks));
    }
    if (caught > 0) {
      d.caught_mismatches_ += static_cast<std::int64_t>(caught);
      apply = false;
      skip("recompute not bitwise in " + caught_segment);
    }

    // Beside a loss scaler, which skips on the Inf and NaN elements it found (as GradScaler does),
    // skip_nonfinite skips what the scaler would apply: finite elements whose fp32 norm overflows,
    // as it does without a scaler. The scale stays: the unscaled gradients are that large.
    if (apply && d.scaler_ && d.options_.skip_nonfinite && finite_elements && !finite_grads) {
      apply = false;
      skip("non-finite gradient norm (every element finite, their fp32 norm overflows)");
    }

    out_.clipped_grad_norm = out_.grad_norm;
    if (apply) {
      // Non-finite gradients: the total as it is when it says so (an Inf gradient's norm is inf,
      // not NaN), else NaN (a finite total over non-finite gradients is no norm to clip by).
      const double total = finite_grads || !std::isfinite(out_.grad_norm) ? out_.grad_norm
                                                                          : std::numeric_limits<double>::quiet_NaN();
      const ClipResult c = d.clipper_.clip(grads, norms, total, step_, d.scaler_ != nullptr);
      out_.clip_coef = c.coef;
      out_.clipped_grad_norm = c.clipped_norm;
      if (d.scaler_) {
        const std::int64_t tolerated = d.scaler_->tolerated_overflows();
        const std::int64_t backoffs = d.scaler_->backoffs();
        if (d.scaler_->step(*d.optimizer_)) {
          skip(d.scaler_->tolerated_overflows() > tolerated
                   ? "loss scaler: non-finite gradients, scale kept (hysteresis)"
               : d.scaler_->backoffs() > backoffs
                   ? "loss scaler: non-finite gradients, scale backed off"
                   : "loss scaler: non-finite gradients, scale at its floor (min_scale)");
        } else {
          d.injector_->lr_applied();
        }
      } else if (!finite_grads && d.options_.skip_nonfinite) {
        skip("non-finite gradients");
      } else {
        d.optimizer_->step();
        d.injector_->lr_applied();
      }
    } else if (d.scaler_) {
      d.scaler_->discard_unscale();  // the step is not taken: the scale stays as it was
    }
    if (!bad_ranks.empty() && d.scaler_ && out_.skipped) out_.skip_reason += " (" + bad_ranks_reason(bad_ranks) + ")";
    if (d.options_.rollback && rollback(finite_grads)) out_.rolled_back = true;
    if (!out_.skipped) {
      double loss = out_.loss;
      // Data parallel: the plateau rule sees the ranks' mean loss, so every rank cuts alike.
      if (d.options_.plateau.enabled && d.traits_.gradient_sync) {
        const at::Tensor mean = at::full({1}, loss, at::TensorOptions().dtype(at::kDouble));
        d.traits_.gradient_sync->average({mean});
        loss = mean.item<double>();
      }
      d.schedule_.on_applied(loss, own_lrs_.empty() ? 0.0 : own_lrs_[0]);
      d.clipper_.on_applied(out_.grad_norm);
    }
  }
  restore_lr();
  for (const InjectionEvent& e : d.injector_->fired()) out_.injected.push_back(e.line());
  out_.loss_scale_after = d.loss_scale();
  finished_ = true;
  d.in_step_ = false;
  return out_;
}

// A step that went non-finite (loss, gradients or parameters) restores the state it started
// from -- undoing corrupted weights as well as a bad update. A step another defense already
// skipped changed nothing, so only non-finite parameters call for a rollback then.
bool DefendedStep::rollback(bool finite_grads) {
  Defenses& d = *d_;
  const bool handled = out_.skipped;
  const bool finite_params = d.parameters_finite();
  bool bad = handled ? !finite_params : (!std::isfinite(out_.loss) || !finite_grads || !finite_params);
  // Data parallel: every rank rolls back alike, or none does (a fault on one rank's weights).
  if (d.traits_.gradient_sync) bad = !d.traits_.gradient_sync->ranks_with(bad).empty();
  if (!bad) {
    d.failures_in_a_row_ = 0;
    return false;
  }
  if (d.snapshots_.empty()) return false;  // the step's batch was never taken (cannot happen after batch())
  const std::string why = !finite_params              ? "non-finite parameters"
                          : !std::isfinite(out_.loss) ? "non-finite loss"
                                                      : "non-finite gradients";
  // The scaler keeps what this step taught it (a backoff): restoring its old scale would
  // overflow again and again.
  const std::vector<NamedTensor> scaler_now = d.scaler_ ? clone_all(d.scaler_->state()) : std::vector<NamedTensor>{};
  // The k-th failure in a row goes back to the start of the step k-1 steps before the first
  // failure of the run: a corrupted update that only shows a step later is undone with it.
  const std::int64_t k = ++d.failures_in_a_row_;
  if (k == 1) d.first_failure_ = step_;
  const std::int64_t want = d.first_failure_ - (k - 1);
  std::size_t target = 0;  // the newest snapshot at or before `want`, else the oldest kept
  for (std::size_t i = 0; i < d.snapshots_.size(); ++i) {
    if (d.snapshots_[i].step <= want) target = i;
  }
  const Defenses::Snapshot restore = d.snapshots_[target];
  d.snapshots_.erase(d.snapshots_.begin() + static_cast<std::ptrdiff_t>(target) + 1, d.snapshots_.end());
  d.program().load_state(restore.state);
  if (d.scaler_) d.scaler_->load_state(scaler_now);
  ++d.rollbacks_;
  out_.rolled_back_to = restore.step;
  skip(why + "; restored the state from the start of step " + std::to_string(restore.step));
  return true;
}

}  // namespace retrace
