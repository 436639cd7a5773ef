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

TrainingTraits traits_of(const ScenarioSpec& s, c10::Device device) {
  TrainingTraits t;
  t.device = device;
  if (s.training.precision == "fp16") t.autocast = at::kHalf;
  if (s.training.precision == "bf16") t.autocast = at::kBFloat16;
  if (s.model.type != "mlp") t.vocab = s.model.vocab;  // tiny_gpt and lstm take token ids
  t.loss_weight = s.training.loss_weight;
  return t;
}

}  // namespace

ScenarioProgram::ScenarioProgram(ScenarioSpec spec)
    : spec_(std::move(spec)), defenses_(spec_.defenses, spec_.injections) {
  if (spec_.training.device == "cuda") {
    if (!torch::cuda::is_available()) {
      throw Error(spec_.origin + ": key 'training.device': cuda, but no CUDA device is visible; use cpu");
    }
    device_ = c10::Device(c10::kCUDA, 0);
  }
  if (spec_.world_size > 1) {
    RendezvousOptions rendezvous = RendezvousOptions::from_env();
    if (!replayed_rank() && rendezvous.world_size != spec_.world_size) {
      throw Error(spec_.origin + ": key 'world_size': the scenario asks for " + std::to_string(spec_.world_size) +
                  " ranks, but this process was launched as one of " + std::to_string(rendezvous.world_size) +
                  " (WORLD_SIZE); run it with retrace record --ranks " + std::to_string(spec_.world_size) +
                  " or retrace run, or a launcher that starts " + std::to_string(spec_.world_size) + " ranks");
    }
    group_ = RankGroup::join(rendezvous, to_yaml(spec_), device_);
  }
  torch::manual_seed(spec_.training.seed);  // seeds CUDA generators too
  model_ = build_model(spec_);
  if (spec_.model.init_gain != 1.0 && !restoring_state()) {  // restoring: values yet to come
    torch::NoGradGuard no_grad;
    for (const at::Tensor& p : model_->parameters()) {
      if (p.dim() >= 2) p.mul_(spec_.model.init_gain);
    }
  }
  model_->to(device_);
  model_->train();
  const TrainingSpec& t = spec_.training;
  if (t.optimizer == "adamw") {
    optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(),
                                                       torch::optim::AdamWOptions(t.lr).weight_decay(t.weight_decay));
  } else if (t.optimizer == "adam") {
    optimizer_ = std::make_unique<torch::optim::Adam>(model_->parameters(),
                                                      torch::optim::AdamOptions(t.lr).weight_decay(t.weight_decay));
  } else {
    optimizer_ = std::make_unique<torch::optim::SGD>(
        model_->parameters(), torch::optim::SGDOptions(t.lr).momentum(t.momentum).weight_decay(t.weight_decay));
  }
  parameters_ = named_parameters(*model_);
  buffers_ = named_buffers(*model_);
  TrainingTraits traits = traits_of(spec_, device_);
  traits.gradient_sync = group_.get();
  defenses_.attach(*this, *optimizer_, parameters_, traits);
}

ScenarioProgram::~ScenarioProgram() = default;

std::string ScenarioProgram::config() const { return to_yaml(spec_); }

std::vector<NamedTensor> ScenarioProgram::state() {
  std::vector<NamedTensor> out;
  // Parameters, buffers, and up to 4 optimizer entries a parameter (Adam's step, moments and max).
  out.reserve(parameters_.size() * 5 + buffers_.size() + 8);
  out.insert(out.end(), parameters_.begin(), parameters_.end());
  out.insert(out.end(), buffers_.begin(), buffers_.end());
  for (NamedTensor& n : optimizer_state(*optimizer_, parameters_)) out.push_back(std::move(n));
  for (NamedTensor& n : defenses_.state()) out.push_back(std::move(n));
  return out;
}

void ScenarioProgram::load_state(const std::vector<NamedTensor>& state) {
  copy_state_into(parameters_, state);
  copy_state_into(buffers_, state);
  load_optimizer_state(*optimizer_, parameters_, state);
  defenses_.load_state(state);
}

void ScenarioProgram::adopt_state(std::vector<NamedTensor> state) {
  // Parameters and buffers are copied in (a no-op for a tensor decoded into the program's own,
  // as the replayer does); the optimizer keeps the moments it is given.
  copy_state_into(parameters_, state);
  copy_state_into(buffers_, state);
  defenses_.load_state(state);
  load_optimizer_state(*optimizer_, parameters_, std::move(state));
}

std::vector<NamedTensor> ScenarioProgram::batch(std::int64_t step) {
  // Each rank's shard: rank 0 draws what a single-process run draws.
  const std::uint64_t rank = group_ ? static_cast<std::uint64_t>(group_->ranks().rank) : 0;
  const models::Batch b = model_->make_batch(spec_.data.seed * 1000003ULL + static_cast<std::uint64_t>(step) +
                                             rank * 0x9E3779B97F4A7C15ULL);
  return {{"input", b.input.to(device_), TensorKind::kInput}, {"target", b.target.to(device_), TensorKind::kTarget}};
}

// One step through the public defense pipeline (defenses.h has the order of what it does).
StepOutcome ScenarioProgram::step(std::int64_t step, const std::vector<NamedTensor>& batch_in, StepMonitor* monitor) {
  DefendedStep s = defenses_.begin(step, monitor);
  const std::vector<NamedTensor> batch = s.batch(batch_in);
  if (s.done()) return s.finish();
  models::Batch b;
  for (const NamedTensor& n : batch) {
    if (n.kind == TensorKind::kInput) b.input = n.tensor.to(device_);
    if (n.kind == TensorKind::kTarget) b.target = n.tensor.to(device_);
  }
  if (!b.input.defined() || !b.target.defined()) throw Error("the batch lacks a tensor of kind input or target");
  optimizer_->zero_grad();
  models::CheckpointPlan plan{spec_.training.segments, {}, spec_.training.recompute == "selective"};
  plan.options.preserve_rng_state = spec_.defenses.preserve_rng_state;
  at::Tensor loss;
  {
    const DefendedStep::ForwardScope forward = s.forward();
    loss = model_->loss(b, plan);
  }
  s.backward(loss);
  return s.finish();
}

namespace {

// A registered program trained by a scenario: the program does the work; the name and config
// are the scenario's, so that replay rebuilds the program with the scenario's defenses.
class ProgramUnderScenario : public Program {
 public:
  ProgramUnderScenario(ScenarioSpec spec, std::unique_ptr<Program> inner)
      : spec_(std::move(spec)), inner_(std::move(inner)) {}
  std::string name() const override { return "retrace.scenario"; }
  std::string config() const override { return to_yaml(spec_); }
  std::string describe() const override {
    return inner_->describe() + ", run by scenario '" + spec_.name + "' (" + spec_.origin + ")";
  }
  std::vector<NamedTensor> state() override { return inner_->state(); }
  void load_state(const std::vector<NamedTensor>& state) override { inner_->load_state(state); }
  void adopt_state(std::vector<NamedTensor> state) override { inner_->adopt_state(std::move(state)); }
  std::vector<NamedTensor> batch(std::int64_t step) override { return inner_->batch(step); }
  StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch, StepMonitor* monitor) override {
    return inner_->step(step, batch, monitor);
  }
  std::int64_t default_steps() const override { return spec_.training.steps; }
  double lr() const override { return inner_->lr(); }
  double loss_scale() const override { return inner_->loss_scale(); }
  Defenses* defenses() override { return inner_->defenses(); }
  RankInfo ranks() const override { return inner_->ranks(); }

 private:
  ScenarioSpec spec_;
  std::unique_ptr<Program> inner_;
};

}  // namespace

std::unique_ptr<Program> make_scenario_program(const ScenarioSpec& spec) {
  if (spec.program.empty()) return std::make_unique<ScenarioProgram>(spec);
  const std::vector<std::string> known = registered_programs();
  if (std::find(known.begin(), known.end(), spec.program) == known.end()) {
    std::string names;
    for (const std::string& n : known) {
      if (n != "retrace.scenario") names += (names.empty() ? "" : ", ") + n;
    }
    throw Error(spec.origin + ": key 'program': '" + spec.program +
                "' is not registered in this binary (it has: " + (names.empty() ? "none" : names) +
                "); run the scenario with the binary that registers it (retrace::main "
                "or retrace::ProgramRegistration)");
  }
  torch::manual_seed(spec.training.seed);  // seeds CUDA generators too
  std::unique_ptr<Program> inner;
  try {
    inner = make_program(spec.program, spec.program_config);
  } catch (const Error& e) {  // the program refuses its config: say which file and key
    throw Error(spec.origin +
                (spec.program_config_line > 0 ? ":" + std::to_string(spec.program_config_line) : std::string()) +
                ": key 'config': " + e.what());
  }
  // Launched as a rank, a program that joins no group trains alone, as rank 0: a data-parallel
  // scenario's verdict would rest on runs that synced nothing (and an injection for rank 1 would
  // never be due). (Not launched as one -- `retrace run` checking the scenario before it starts the
  // ranks -- the program has no group to join yet.)
  if (spec.world_size > 1 && !replayed_rank() && RendezvousOptions::from_env().world_size == spec.world_size &&
      inner->ranks().world_size != spec.world_size) {
    throw Error(spec.origin + ": key 'world_size': the scenario asks for " + std::to_string(spec.world_size) +
                " ranks, but program '" + spec.program + "' trains as one of " +
                std::to_string(inner->ranks().world_size) +
                " (Program::ranks(): it joins no rank group); drop world_size, or make the program data-parallel "
                "(retrace::RankGroup, docs/data-parallel.md)");
  }
  Defenses* d = inner->defenses();
  if (!d) {
    if (spec.defenses.any() || !spec.injections.empty()) {
      throw Error(spec.origin + ": key 'program': '" + spec.program +
                  "' has no defense pipeline (its defenses() returns nullptr), so the scenario's defenses and "
                  "injections cannot reach it; run its step through retrace::Defenses (retrace/defenses.h)");
    }
  } else {
    if (spec.defenses.skip_nonfinite_ranks && !d->traits().gradient_sync) {
      throw Error(spec.origin + ": key 'defenses.skip_nonfinite_ranks': program '" + spec.program +
                  "' trains in one process (no TrainingTraits::gradient_sync): use skip_nonfinite");
    }
    try {
      d->configure(spec.defenses, spec.injections);
    } catch (const Error& e) {
      throw Error(spec.origin + ": key 'injections': " + e.what());
    }
    try {
      d->check_in(inner->state());
    } catch (const Error& e) {  // the program's state() leaves out the defenses': say which file
      throw Error(spec.origin + ": key 'program': program '" + spec.program + "': " + e.what());
    }
  }
  return std::make_unique<ProgramUnderScenario>(spec, std::move(inner));
}

void register_builtin_programs() {
  register_program("retrace.scenario", [](const std::string& config) -> std::unique_ptr<Program> {
    return make_scenario_program(parse_scenario_text(config, "<trace program config>", ScenarioSource::kCanonical));
  });
}

}  // namespace retrace
