#pragma once
// The built-in program: trains one of the harness models as a ScenarioSpec describes. Registered
// as "retrace.scenario" by register_builtin_programs(); its config is the scenario's canonical
// YAML, so a trace rebuilds it exactly.

#include <retrace/models.h>
#include <retrace/program.h>
#include <retrace/scenario.h>

#include <torch/optim/optimizer.h>

#include <memory>

namespace retrace {

class ScenarioProgram : public Program {
 public:
  // Seeds the CPU (and CUDA) generators with training.seed, then builds model and optimizer.
  explicit ScenarioProgram(ScenarioSpec spec);
  ~ScenarioProgram() override;

  std::string name() const override { return "retrace.scenario"; }
  std::string config() const override;
  std::vector<NamedTensor> state() override;
  void load_state(const std::vector<NamedTensor>& state) override;
  std::vector<NamedTensor> batch(std::int64_t step) override;
  StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch, StepMonitor* monitor) override;
  std::int64_t default_steps() const override { return spec_.training.steps; }
  double lr() const override { return spec_.training.lr; }

  const ScenarioSpec& spec() const { return spec_; }
  models::SegmentedModel& model() { return *model_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  c10::Device device() const { return device_; }

 private:
  ScenarioSpec spec_;
  c10::Device device_{c10::kCPU};
  std::shared_ptr<models::SegmentedModel> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// Registers "retrace.scenario" (idempotent). The CLI calls it before anything else.
void register_builtin_programs();

}  // namespace retrace
