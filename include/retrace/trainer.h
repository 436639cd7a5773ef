#pragma once
// The built-in program: trains one of the harness models as a ScenarioSpec describes, with the
// scenario's defenses and injections. Registered as "retrace.scenario" by
// register_builtin_programs(); its config is the scenario's canonical YAML, so a trace rebuilds
// it -- defenses and injections included -- exactly.
//
// One step (docs/defenses.md has the details):
//   LR = base x warmup x plateau x injected spike; batch (injected corruption, validation);
//   rollback snapshot; injected state bit flips; forward under autocast with the injector
//   attached; loss x loss_weight (x injected spike) x loss scale; backward; injected gradient
//   faults; unscale; gradient norm; recompute verification; clipping; optimizer step unless
//   skipped; rollback when the step went non-finite; scheduler advanced only by applied steps.

#include <retrace/injectors.h>
#include <retrace/loss_scaler.h>
#include <retrace/models.h>
#include <retrace/program.h>
#include <retrace/scenario.h>
#include <retrace/verify.h>

#include <torch/optim/optimizer.h>

#include <deque>
#include <limits>
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
  double lr() const override;
  double loss_scale() const override;

  const ScenarioSpec& spec() const { return spec_; }
  models::SegmentedModel& model() { return *model_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  c10::Device device() const { return device_; }
  // nullptr unless defenses.loss_scaling is on.
  const LossScaler* scaler() const { return scaler_.get(); }
  std::int64_t applied_steps() const { return applied_steps_; }
  // Every parameter holds only finite values.
  bool params_finite() const;
  std::int64_t rollbacks() const { return rollbacks_; }
  // Recompute mismatches defenses.verify_recompute caught (their steps were skipped).
  std::int64_t caught_recompute_mismatches() const { return caught_mismatches_; }
  // An observer attached during every step after the injector, so it sees the segment outputs
  // that actually flow on (an ObserverScope around step() would see them before injection).
  // nullptr detaches. The observer must outlive its use.
  void observe(SegmentObserver* observer) { extra_observer_ = observer; }
  // The scenario's injections: what fired in the current (or last) step -- also when the step
  // raised -- and which steps each entry is due on.
  const Injector& injector() const { return injector_; }

 private:
  double scheduled_lr() const;
  void set_lr(double lr);
  void advance_schedule(double loss);

  ScenarioSpec spec_;
  c10::Device device_{c10::kCPU};
  std::shared_ptr<models::SegmentedModel> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<LossScaler> scaler_;
  Injector injector_;
  std::unique_ptr<RecomputeVerifier> verifier_;  // defenses.verify_recompute
  SegmentObserver* extra_observer_ = nullptr;
  // Schedule and adaptive-clipping state (part of state(), so replay restores it).
  std::int64_t applied_steps_ = 0;
  double plateau_factor_ = 1.0;
  double plateau_best_ = std::numeric_limits<double>::infinity();
  std::int64_t plateau_bad_ = 0;
  std::deque<double> recent_norms_;
  // defenses.rollback: the last rollback_depth step-start snapshots, and how many steps in a row
  // have gone non-finite (each one walks a snapshot further back).
  struct Snapshot {
    std::int64_t step;
    std::vector<NamedTensor> state;
  };
  std::deque<Snapshot> snapshots_;
  std::int64_t failures_in_a_row_ = 0;
  std::int64_t first_failure_ = 0;  // the step that started the current run of failures
  std::int64_t rollbacks_ = 0;
  std::int64_t caught_mismatches_ = 0;
};

// Registers "retrace.scenario" (idempotent). The CLI calls it before anything else.
void register_builtin_programs();

}  // namespace retrace
