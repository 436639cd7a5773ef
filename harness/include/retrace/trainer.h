#pragma once
// The built-in program: trains one of the harness models as a ScenarioSpec describes, its step
// running through the public defense pipeline (defenses.h) like any user's program. Registered as
// "retrace.scenario" by register_builtin_programs(); its config is the scenario's canonical YAML,
// so a trace rebuilds it -- defenses and injections included -- exactly. A scenario that names a
// registered program (`program:`) trains that program instead (make_scenario_program).

#include <retrace/defenses.h>
#include <retrace/dist.h>
#include <retrace/models.h>
#include <retrace/program.h>
#include <retrace/scenario.h>

#include <torch/optim/optimizer.h>

#include <memory>

namespace retrace {

class ScenarioProgram : public Program {
 public:
  // Seeds the CPU (and CUDA) generators with training.seed, then builds model and optimizer.
  // The spec names a built-in model (spec.program empty). With world_size > 1 it first joins the
  // data-parallel group (RankGroup::join, RendezvousOptions::from_env: RANK, WORLD_SIZE, ...);
  // every rank builds the same model from the same seed and trains on its own shard of the data.
  explicit ScenarioProgram(ScenarioSpec spec);
  ~ScenarioProgram() override;

  std::string name() const override { return "retrace.scenario"; }
  std::string config() const override;
  std::vector<NamedTensor> state() override;
  void load_state(const std::vector<NamedTensor>& state) override;
  void adopt_state(std::vector<NamedTensor> state) override;  // keeps the optimizer moments given
  std::vector<NamedTensor> batch(std::int64_t step) override;
  StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch, StepMonitor* monitor) override;
  std::int64_t default_steps() const override { return spec_.training.steps; }
  double lr() const override { return defenses_.next_lr(); }
  double loss_scale() const override { return defenses_.loss_scale(); }
  Defenses* defenses() override { return &defenses_; }
  RankInfo ranks() const override { return group_ ? group_->ranks() : RankInfo{}; }

  const ScenarioSpec& spec() const { return spec_; }
  models::SegmentedModel& model() { return *model_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  c10::Device device() const { return device_; }

 private:
  ScenarioSpec spec_;
  c10::Device device_{c10::kCPU};
  std::unique_ptr<RankGroup> group_;  // world_size > 1: the data-parallel group (rendezvous from the environment)
  std::shared_ptr<models::SegmentedModel> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<NamedTensor> parameters_, buffers_;
  Defenses defenses_;
};

// The program a scenario trains: the built-in models (ScenarioProgram), or the registered
// program the scenario names (`program:`), built from its `config:` with the scenario's
// defenses and injections configured into its pipeline. Either way the program's name() is
// "retrace.scenario" and its config() the scenario's canonical YAML, so a trace rebuilds it --
// defenses and injections included -- exactly. Seeds the generators with training.seed first.
// Throws retrace::Error for an unknown program or one without a defense pipeline (when the
// scenario has defenses or injections).
std::unique_ptr<Program> make_scenario_program(const ScenarioSpec& spec);

// Registers "retrace.scenario" (idempotent). The CLI calls it before anything else.
void register_builtin_programs();

}  // namespace retrace
