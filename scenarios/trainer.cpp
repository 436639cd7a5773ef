#include <retrace/trainer.h>

#include <retrace/autocast.h>
#include <retrace/error.h>
#include <retrace/number.h>
#include <retrace/observer.h>

#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

namespace retrace {

namespace {

std::shared_ptr<models::SegmentedModel> build_model(const ScenarioSpec& s) {
  const ModelSpec& m = s.model;
  if (m.type == "tiny_gpt") {
    models::GptConfig c;
    c.vocab = m.vocab;
    c.d_model = m.d_model;
    c.heads = m.heads;
    c.layers = m.layers;
    c.seq_len = m.seq_len;
    c.batch = s.data.batch;
    c.dropout = m.dropout;
    c.layernorm_eps = std::max(m.layernorm_eps, s.defenses.layernorm_min_eps);  // the eps guard
    c.layernorm_fp32 = s.defenses.layernorm_fp32;
    return std::make_shared<models::TinyGpt>(c);
  }
  if (m.type == "lstm") {
    models::LstmConfig c;
    c.vocab = m.vocab;
    c.hidden = m.hidden;
    c.layers = m.layers;
    c.seq_len = m.seq_len;
    c.batch = s.data.batch;
    c.dropout = m.dropout;
    return std::make_shared<models::LstmLm>(c);
  }
  models::MlpConfig c;
  c.in_features = m.in_features;
  c.hidden = m.hidden;
  c.out_features = m.out_features;
  c.layers = m.layers;
  c.batch = s.data.batch;
  c.dropout = m.dropout;
  return std::make_shared<models::Mlp>(c);
}

// Adam and AdamW keep the same per-parameter state under different types.
template <typename State>
void save_adam(const State& st, const std::string& prefix, std::vector<NamedTensor>& out) {
  out.push_back({prefix + "step", at::scalar_tensor(st.step(), at::kLong)});
  out.push_back({prefix + "exp_avg", st.exp_avg()});
  out.push_back({prefix + "exp_avg_sq", st.exp_avg_sq()});
  if (st.max_exp_avg_sq().defined() && st.max_exp_avg_sq().numel() > 0) {
    out.push_back({prefix + "max_exp_avg_sq", st.max_exp_avg_sq()});
  }
}

const at::Tensor& need(const std::map<std::string, at::Tensor>& by_name, const std::string& name) {
  auto it = by_name.find(name);
  if (it == by_name.end()) throw Error("the recorded state lacks '" + name + "'; was it recorded by another scenario?");
  return it->second;
}

template <typename State>
std::unique_ptr<State> load_adam(const std::map<std::string, at::Tensor>& by_name, const std::string& prefix) {
  auto st = std::make_unique<State>();
  const at::Tensor& step = need(by_name, prefix + "step");
  if (step.numel() != 1 || step.is_floating_point()) throw Error("the recorded '" + prefix + "step' is not an integer scalar");
  st->step(step.item<std::int64_t>());
  st->exp_avg(need(by_name, prefix + "exp_avg").clone());
  st->exp_avg_sq(need(by_name, prefix + "exp_avg_sq").clone());
  if (auto it = by_name.find(prefix + "max_exp_avg_sq"); it != by_name.end()) st->max_exp_avg_sq(it->second.clone());
  return st;
}

}  // namespace

ScenarioProgram::ScenarioProgram(ScenarioSpec spec) : spec_(std::move(spec)), injector_(spec_.injections) {
  if (spec_.training.device == "cuda") {
    if (!torch::cuda::is_available()) {
      throw Error(spec_.origin + ": key 'training.device': cuda, but no CUDA device is visible; use cpu");
    }
    device_ = c10::Device(c10::kCUDA, 0);
  }
  torch::manual_seed(spec_.training.seed);  // seeds CUDA generators too
  model_ = build_model(spec_);
  if (spec_.model.init_gain != 1.0) {
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : model_->parameters()) {
      if (p.dim() >= 2) p.mul_(spec_.model.init_gain);
    }
  }
  model_->to(device_);
  model_->train();
  const TrainingSpec& t = spec_.training;
  if (t.optimizer == "adamw") {
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        model_->parameters(), torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  } else if (t.optimizer == "adam") {
    optimizer_ = std::make_unique<torch::optim::Adam>(
        model_->parameters(), torch::optim::AdamOptions(t.lr).weight_decay(t.weight_decay));
  } else {
    optimizer_ = std::make_unique<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
  }
  const LossScalingSpec& ls = spec_.defenses.loss_scaling;
  if (ls.enabled) {
    LossScalerOptions o;
    o.init_scale = ls.init_scale;
    o.growth_factor = ls.growth_factor;
    o.backoff_factor = ls.backoff_factor;
    o.growth_interval = ls.growth_interval;
    o.hysteresis = ls.hysteresis;
    o.min_scale = ls.min_scale;
    scaler_ = std::make_unique<LossScaler>(o, device_);
  }
  if (spec_.training.precision == "fp16") injector_.set_activation_dtype(at::kHalf);
  if (spec_.training.precision == "bf16") injector_.set_activation_dtype(at::kBFloat16);
  if (spec_.defenses.verify_recompute) {
    VerifyOptions v;
    v.policy = VerifyPolicy::kRecord;
    verifier_ = std::make_unique<RecomputeVerifier>(v);
  }
}

ScenarioProgram::~ScenarioProgram() = default;

std::string ScenarioProgram::config() const { return to_yaml(spec_); }

std::vector<NamedTensor> ScenarioProgram::state() {
  std::vector<NamedTensor> out;
  const auto params = model_->named_parameters();
  for (const auto& p : params) out.push_back({"param." + p.key(), p.value()});
  for (const auto& b : model_->named_buffers()) out.push_back({"buffer." + b.key(), b.value()});
  auto& states = optimizer_->state();
  for (const auto& p : params) {
    auto it = states.find(p.value().unsafeGetTensorImpl());
    if (it == states.end()) continue;
    const std::string prefix = "optim." + p.key() + ".";
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      save_adam(*s, prefix, out);
    } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      save_adam(*s, prefix, out);
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      if (s->momentum_buffer().defined()) out.push_back({prefix + "momentum_buffer", s->momentum_buffer()});
    }
  }
  if (scaler_) {
    for (NamedTensor& n : scaler_->state()) out.push_back(std::move(n));
  }
  // Schedule state: what the next step's LR and clipping threshold depend on.
  out.push_back({"schedule.applied_steps", at::scalar_tensor(applied_steps_, at::kLong)});
  if (spec_.defenses.plateau.enabled) {
    // [factor, best loss (0 before the first), flat steps, has a best]: finite, so a state check
    // for non-finite values never trips on it.
    const bool has_best = std::isfinite(plateau_best_);
    out.push_back({"schedule.plateau", at::tensor({plateau_factor_, has_best ? plateau_best_ : 0.0,
                                                   static_cast<double>(plateau_bad_), has_best ? 1.0 : 0.0}, at::kDouble)});
  }
  if (spec_.defenses.clip.mode == "adaptive") {
    out.push_back({"clip.recent_norms", at::tensor(std::vector<double>(recent_norms_.begin(), recent_norms_.end()), at::kDouble)});
  }
  return out;
}

void ScenarioProgram::load_state(const std::vector<NamedTensor>& state) {
  std::map<std::string, at::Tensor> by_name;
  for (const NamedTensor& n : state) by_name[n.name] = n.tensor;
  torch::NoGradGuard no_grad;
  auto copy_into = [&](const std::string& name, at::Tensor target) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw Error("the recorded state lacks '" + name + "'; was it recorded by another scenario?");
    if (it->second.sizes() != target.sizes() || it->second.scalar_type() != target.scalar_type()) {
      throw Error("the recorded state's '" + name + "' is " + std::string(c10::toString(it->second.scalar_type())) +
                  " of another shape than the model's; was it recorded by another scenario?");
    }
    target.copy_(it->second);
  };
  const auto params = model_->named_parameters();
  for (const auto& p : params) {
    copy_into("param." + p.key(), p.value());
    p.value().mutable_grad() = at::Tensor();  // gradients are not state; a step starts without them
  }
  for (const auto& b : model_->named_buffers()) copy_into("buffer." + b.key(), b.value());
  auto& states = optimizer_->state();
  states.clear();
  for (const auto& p : params) {
    const std::string prefix = "optim." + p.key() + ".";
    void* key = p.value().unsafeGetTensorImpl();
    const at::Device dev = p.value().device();
    std::map<std::string, at::Tensor> local;
    for (const auto& [name, t] : by_name) {
      if (name.rfind(prefix, 0) == 0) local[name] = t.to(dev);
    }
    if (local.empty()) continue;
    if (spec_.training.optimizer == "adamw") {
      states[key] = load_adam<torch::optim::AdamWParamState>(local, prefix);
    } else if (spec_.training.optimizer == "adam") {
      states[key] = load_adam<torch::optim::AdamParamState>(local, prefix);
    } else {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(need(local, prefix + "momentum_buffer").clone());
      states[key] = std::move(st);
    }
  }
  if (scaler_) scaler_->load_state(state);
  applied_steps_ = 0;
  if (auto it = by_name.find("schedule.applied_steps"); it != by_name.end()) applied_steps_ = it->second.item<std::int64_t>();
  if (auto it = by_name.find("schedule.plateau"); it != by_name.end() && it->second.numel() == 4) {
    const at::Tensor p = it->second.to(at::kDouble).contiguous();
    plateau_factor_ = p[0].item<double>();
    plateau_best_ = p[3].item<double>() != 0 ? p[1].item<double>() : std::numeric_limits<double>::infinity();
    plateau_bad_ = static_cast<std::int64_t>(p[2].item<double>());
  }
  recent_norms_.clear();
  if (auto it = by_name.find("clip.recent_norms"); it != by_name.end()) {
    const at::Tensor r = it->second.to(at::kDouble).contiguous();
    for (std::int64_t i = 0; i < r.numel(); ++i) recent_norms_.push_back(r[i].item<double>());
  }
}

std::vector<NamedTensor> ScenarioProgram::batch(std::int64_t step) {
  const models::Batch b = model_->make_batch(spec_.data.seed * 1000003ULL + static_cast<std::uint64_t>(step));
  return {{"input", b.input.to(device_)}, {"target", b.target.to(device_)}};
}

double ScenarioProgram::scheduled_lr() const {
  const DefenseSpec& d = spec_.defenses;
  double lr = spec_.training.lr * plateau_factor_;
  if (d.plateau.enabled) lr = std::max(lr, std::min(d.plateau.min_lr, spec_.training.lr));  // the floor of the cuts
  if (d.warmup_steps > 0 && applied_steps_ < d.warmup_steps) {
    lr *= static_cast<double>(applied_steps_ + 1) / static_cast<double>(d.warmup_steps);
  }
  return lr;
}

double ScenarioProgram::lr() const { return scheduled_lr(); }
double ScenarioProgram::loss_scale() const { return scaler_ ? scaler_->current_scale() : 1.0; }

void ScenarioProgram::set_lr(double lr) {
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
}

void ScenarioProgram::advance_schedule(double loss) {
  ++applied_steps_;
  const PlateauSpec& p = spec_.defenses.plateau;
  if (!p.enabled) return;
  if (std::isfinite(loss) && loss < plateau_best_ * (1.0 - p.threshold)) {
    plateau_best_ = loss;
    plateau_bad_ = 0;
  } else if (++plateau_bad_ > p.patience) {
    plateau_factor_ *= p.factor;
    plateau_bad_ = 0;
  }
}

bool ScenarioProgram::params_finite() const {
  for (const at::Tensor& p : model_->parameters()) {
    if (!at::isfinite(p).all().item<bool>()) return false;
  }
  return true;
}

StepOutcome ScenarioProgram::step(std::int64_t step, const std::vector<NamedTensor>& batch_in, StepMonitor* monitor) {
  const DefenseSpec& d = spec_.defenses;
  StepOutcome out;
  injector_.begin_step(step);
  auto finish = [&]() -> StepOutcome {
    for (const InjectionEvent& e : injector_.fired()) out.injected.push_back(e.type + " " + e.where + ": " + e.detail);
    out.loss_scale_after = loss_scale();
    return out;
  };
  auto skip = [&](std::string why) {
    out.skipped = true;
    out.skip_reason = std::move(why);
  };

  // Learning rate: schedule x injected spike.
  out.lr = scheduled_lr() * injector_.lr_factor();
  set_lr(out.lr);
  out.loss_scale = loss_scale();

  // Batch: injected corruption, then validation.
  std::vector<NamedTensor> batch = batch_in;
  injector_.corrupt_batch(batch, spec_.model.vocab);
  models::Batch b;
  for (const NamedTensor& n : batch) {
    if (n.name == "input") b.input = n.tensor.to(device_);
    if (n.name == "target") b.target = n.tensor.to(device_);
  }
  if (!b.input.defined() || !b.target.defined()) throw Error("the batch lacks 'input' or 'target'");
  if (d.validate_batch) {
    std::string bad;
    if (b.input.is_floating_point()) {
      if (!at::isfinite(b.input).all().item<bool>()) bad = "non-finite features";
    } else if (b.input.numel() > 0 &&
               (b.input.min().item<std::int64_t>() < 0 || b.input.max().item<std::int64_t>() >= spec_.model.vocab)) {
      bad = "token ids outside the vocabulary";
    }
    if (!bad.empty()) {
      skip("invalid batch: " + bad);
      failures_in_a_row_ = 0;  // nothing ran, nothing rolled back: a run of failures ends here
      return finish();
    }
  }

  // Rollback snapshot, taken before any injected corruption of the state -- but not while a run
  // of failures is being rolled back: the state is then a restored copy of an older snapshot.
  if (d.rollback && failures_in_a_row_ == 0) {
    std::vector<NamedTensor> snapshot;
    for (const NamedTensor& n : state()) snapshot.push_back({n.name, n.tensor.detach().clone()});
    snapshots_.push_back({step, std::move(snapshot)});
    while (static_cast<std::int64_t>(snapshots_.size()) > d.rollback_depth) snapshots_.pop_front();
  }
  if (!injector_.empty()) {
    std::vector<NamedTensor> live = state();
    injector_.flip_state(live);
  }

  optimizer_->zero_grad();
  const std::size_t mismatches_before = verifier_ ? verifier_->mismatches().size() : 0;
  at::Tensor loss;
  std::vector<NamedTensor> grads;
  {
    std::optional<ObserverScope> inject_scope, verify_scope, extra_scope;
    if (!injector_.empty()) inject_scope.emplace(injector_, ObserverOrder::kFirst);  // the others see injected values
    if (verifier_) verify_scope.emplace(*verifier_);
    if (extra_observer_) extra_scope.emplace(*extra_observer_);
    models::CheckpointPlan plan{spec_.training.segments, {}};
    plan.options.preserve_rng_state = d.preserve_rng_state;
    {
      AutocastState ac;
      if (spec_.training.precision != "fp32") {
        const c10::ScalarType dtype = spec_.training.precision == "fp16" ? at::kHalf : at::kBFloat16;
        ac.entries.push_back({device_.type(), true, dtype});
      }
      std::optional<AutocastGuard> autocast;
      if (ac.any_enabled()) autocast.emplace(ac);
      loss = model_->loss(b, plan);
    }
    loss = loss.to(at::kFloat);
    at::Tensor objective = injector_.on_loss(spec_.training.loss_weight != 1.0 ? loss * spec_.training.loss_weight : loss);
    if (scaler_) objective = scaler_->scale(objective);
    objective.backward();
  }
  for (const auto& p : model_->named_parameters()) {
    if (p.value().grad().defined()) grads.push_back({"grad." + p.key(), p.value().grad()});
  }
  injector_.on_grads(grads);
  if (monitor) monitor->after_backward(loss, grads);
  out.loss = loss.item<double>();

  // Unscale (the norm and clipping see true gradients), then the norm before clipping.
  bool finite_grads = true;
  if (scaler_) finite_grads = scaler_->unscale(*optimizer_);
  std::vector<at::Tensor> norms;
  for (const NamedTensor& g : grads) norms.push_back(g.tensor.detach().to(at::kFloat).norm());
  out.grad_norm = norms.empty() ? 0.0 : at::stack(norms).norm().item<double>();
  finite_grads = finite_grads && std::isfinite(out.grad_norm);

  const std::size_t caught = verifier_ ? verifier_->mismatches().size() - mismatches_before : 0;
  const std::string caught_segment = caught > 0 ? verifier_->mismatches()[mismatches_before].segment : "";
  if (verifier_) verifier_->reset();  // per step: its list would otherwise grow for the whole run
  bool apply = true;
  if (caught > 0) {
    caught_mismatches_ += static_cast<std::int64_t>(caught);
    apply = false;
    skip("recompute not bitwise in " + caught_segment);
  }

  // Clipping: never on a non-finite norm (scaling by max_norm/inf would turn Inf into 0 or NaN
  // silently). Clipping alone then leaves the gradients as they are: the step is skipped only by
  // the loss scaler or skip_nonfinite, and raises with error_if_nonfinite (without a scaler).
  const ClipSpec& clip = d.clip;
  out.clipped_grad_norm = out.grad_norm;
  if (apply && clip.mode != "off") {
    if (!finite_grads) {
      out.clip_coef = std::numeric_limits<double>::quiet_NaN();
      if (clip.error_if_nonfinite && !scaler_) {  // with a scaler, an overflow is its to skip
        throw Error("step " + std::to_string(step) + ": the total gradient norm is non-finite (" + number_text(out.grad_norm) +
                    "); clipping refuses it (defenses.clip.error_if_nonfinite)");
      }
    } else {
      torch::NoGradGuard no_grad;
      if (clip.mode == "global") {
        torch::nn::utils::clip_grad_norm_(model_->parameters(), clip.max_norm);
        out.clip_coef = std::min(1.0, clip.max_norm / (out.grad_norm + 1e-6));  // PyTorch's clip_coef_clamped
      } else if (clip.mode == "per_tensor") {
        for (std::size_t i = 0; i < grads.size(); ++i) {  // TensorFlow's clip_by_norm, per gradient
          const double n = norms[i].item<double>();         // the norms computed above
          if (n > clip.max_norm) grads[i].tensor.mul_(clip.max_norm / (n + 1e-6));
        }
      } else {  // adaptive: threshold from the median of recent applied norms
        double threshold = clip.max_norm;
        if (!recent_norms_.empty()) {
          std::vector<double> sorted(recent_norms_.begin(), recent_norms_.end());
          std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2), sorted.end());
          threshold = std::max(clip.max_norm, clip.multiplier * sorted[sorted.size() / 2]);
        }
        if (out.grad_norm > threshold) {
          out.clip_coef = threshold / (out.grad_norm + 1e-6);
          for (const NamedTensor& g : grads) g.tensor.mul_(out.clip_coef);
        }
      }
      std::vector<at::Tensor> clipped;
      for (const NamedTensor& g : grads) clipped.push_back(g.tensor.detach().to(at::kFloat).norm());
      out.clipped_grad_norm = clipped.empty() ? 0.0 : at::stack(clipped).norm().item<double>();
    }
  }

  if (apply) {
    if (scaler_) {
      const std::int64_t tolerated = scaler_->tolerated_overflows();
      const std::int64_t backoffs = scaler_->backoffs();
      if (scaler_->step(*optimizer_)) {
        skip(scaler_->tolerated_overflows() > tolerated ? "loss scaler: non-finite gradients, scale kept (hysteresis)"
             : scaler_->backoffs() > backoffs           ? "loss scaler: non-finite gradients, scale backed off"
                                                        : "loss scaler: non-finite gradients, scale at its floor (min_scale)");
      }
    } else if (!finite_grads && d.skip_nonfinite) {
      skip("non-finite gradients");
    } else {
      optimizer_->step();
    }
  } else if (scaler_) {
    scaler_->discard_unscale();  // the step is not taken: the scale stays as it was
  }

  // Rollback: a step that went non-finite (loss, gradients or parameters) restores the state it
  // started from -- undoing corrupted weights as well as a bad update. A step another defense
  // already skipped changed nothing, so only non-finite parameters call for a rollback then.
  if (d.rollback) {
    const bool handled = out.skipped;
    const bool finite_params = params_finite();
    const bool bad = handled ? !finite_params : (!std::isfinite(out.loss) || !finite_grads || !finite_params);
    if (bad) {
      const std::string why = !finite_params ? "non-finite parameters" : !std::isfinite(out.loss) ? "non-finite loss" : "non-finite gradients";
      // The scaler keeps what this step taught it (a backoff): restoring its old scale would
      // overflow again and again.
      std::vector<NamedTensor> scaler_now;
      if (scaler_) {
        for (const NamedTensor& n : scaler_->state()) scaler_now.push_back({n.name, n.tensor.clone()});
      }
      // The k-th failure in a row goes back to the start of the step k-1 steps before the first
      // failure of the run: a corrupted update that only shows a step later is undone with it.
      const std::int64_t k = ++failures_in_a_row_;
      if (k == 1) first_failure_ = step;
      const std::int64_t want = first_failure_ - (k - 1);
      std::size_t target = 0;  // the newest snapshot at or before `want`, else the oldest kept
      for (std::size_t i = 0; i < snapshots_.size(); ++i) {
        if (snapshots_[i].step <= want) target = i;
      }
      const Snapshot restore = snapshots_[target];
      snapshots_.erase(snapshots_.begin() + static_cast<std::ptrdiff_t>(target) + 1, snapshots_.end());
      load_state(restore.state);
      if (scaler_) scaler_->load_state(scaler_now);
      ++rollbacks_;
      out.rolled_back = true;
      skip(why + "; restored the state from the start of step " + std::to_string(restore.step));
    } else {
      failures_in_a_row_ = 0;
    }
  }
  if (!out.skipped) {
    advance_schedule(out.loss);
    if (clip.mode == "adaptive" && std::isfinite(out.grad_norm)) {
      recent_norms_.push_back(out.grad_norm);
      while (static_cast<std::int64_t>(recent_norms_.size()) > clip.window) recent_norms_.pop_front();
    }
  }
  return finish();
}

void register_builtin_programs() {
  register_program("retrace.scenario", [](const std::string& config) -> std::unique_ptr<Program> {
    return std::make_unique<ScenarioProgram>(parse_scenario_text(config, "<trace program config>"));
  });
}

}  // namespace retrace
