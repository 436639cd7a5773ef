#pragma once
// Defenses for a training step, as public pieces, and the pipeline that runs them in a user's
// own loop. The built-in scenario program (trainer.h) is one user of exactly these pieces.
//
// A program's step() with the pipeline (examples/encoder/encoder_classifier.cpp is a whole program):
//
//   retrace::StepOutcome step(std::int64_t step, const std::vector<retrace::NamedTensor>& batch,
//                             retrace::StepMonitor* monitor) override {
//     retrace::DefendedStep s = defenses_.begin(step, monitor);  // LR schedule, injections due
//     std::vector<retrace::NamedTensor> b = s.batch(batch);       // corruption, validation
//     if (s.done()) return s.finish();                            // an invalid batch is skipped
//     optimizer_->zero_grad();
//     at::Tensor loss;
//     {
//       auto forward = s.forward();  // autocast, injectors and recompute checks on the segments
//       loss = model_->loss(b[0].tensor, b[1].tensor);
//     }
//     s.backward(loss);              // loss spike, loss scale, backward
//     return s.finish();             // gradient faults, unscale, clip, step or skip, rollback
//   }
//
// and, once, in the constructor: defenses_.attach(*this, *optimizer_, named_parameters(*model_));
// state() appends defenses_.state(), load_state() calls defenses_.load_state(), and
// defenses() returns &defenses_ (so a scenario's `defenses:` and `injections:` reach it).
//
// Order of one step (docs/defenses.md): LR = the optimizer's own LR x lr_scale x plateau
// (floored at min_lr) x warmup x injected spike; batch (injected corruption, validation);
// rollback snapshot; injected state bit flips; forward under autocast with the injector and the
// recompute verifier attached; loss x loss_weight (x injected spike) x loss scale; backward;
// injected gradient faults; data parallel: skip_nonfinite_ranks' check, then the gradient
// all-reduce; the monitor; unscale; gradient norm; recompute verification;
// clipping; optimizer step unless skipped; rollback when the step went non-finite; the schedule
// advances only on applied steps. The optimizer's LR is put back after the step, so a program's
// own LR scheduler composes with the pipeline's.

#include <retrace/autocast.h>
#include <retrace/collectives.h>
#include <retrace/defense_options.h>
#include <retrace/injectors.h>
#include <retrace/loss_scaler.h>
#include <retrace/observer.h>
#include <retrace/program.h>
#include <retrace/verify.h>

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}
namespace torch::nn {
class Module;
}

namespace retrace {

// What the pipeline needs to know of the program's training, beyond its tensors.
struct TrainingTraits {
  c10::Device device = c10::kCPU;
  // The forward runs under autocast to this dtype (kHalf, kBFloat16) on `device`; kFloat: none.
  at::ScalarType autocast = at::kFloat;
  // Inputs (kind kInput) that are token ids lie in [0, vocab): what validate_batch checks and
  // corrupt_batch's token_out_of_range exceeds. 0: the inputs are features.
  std::int64_t vocab = 0;
  double loss_weight = 1.0;  // the loss back-propagated is loss x loss_weight
  // A data-parallel program's group (retrace/dist.h's RankGroup), or nullptr: the pipeline
  // averages the gradients over the ranks after the injected gradient faults, before the
  // monitor, and skip_nonfinite_ranks agrees on the step through it. It must outlive the program.
  GradientSync* gradient_sync = nullptr;
};

// --- The pieces ---------------------------------------------------------------------------------

// What clipping did to one step's gradients.
struct ClipResult {
  double coef = 1.0;  // the factor the gradients were multiplied by (1: not clipped; per-tensor: 1;
                      // NaN: not clipped because the norm was non-finite)
  double clipped_norm = std::numeric_limits<double>::quiet_NaN();  // total norm after clipping
};

// Gradient clipping: global (torch.nn.utils.clip_grad_norm_), per tensor (TensorFlow's
// clip_by_norm on each gradient) or adaptive (threshold = max(max_norm, multiplier x the median
// total norm of the last `window` applied steps)). Never clips on a non-finite norm: scaling by
// max_norm / inf would silently turn Inf into 0 or NaN.
class GradClipper {
 public:
  explicit GradClipper(ClipOptions options = {}) : options_(options) {}
  const ClipOptions& options() const { return options_; }
  // Clips `grads` in place. `norms`: each gradient's norm; `total`: their total norm. A
  // non-finite `total` leaves them as they are (coef NaN), and throws with error_if_nonfinite
  // unless `overflow_is_handled` (a loss scaler will skip the step).
  ClipResult clip(const std::vector<NamedTensor>& grads, const std::vector<at::Tensor>& norms, double total,
                  std::int64_t step, bool overflow_is_handled);
  // The threshold adaptive clipping uses now.
  double threshold() const;
  // An applied step's total norm joins the adaptive window.
  void on_applied(double total);
  std::vector<NamedTensor> state() const;  // "clip.recent_norms" (adaptive only)
  void load_state(const std::vector<NamedTensor>& state);

 private:
  ClipOptions options_;
  std::deque<double> recent_;
};

// The LR schedule on top of the program's own LR: lr_scale, plateau cuts (floored at min_lr),
// linear warmup over the first applied steps.
class LrSchedule {
 public:
  LrSchedule(std::int64_t warmup_steps = 0, double lr_scale = 1.0, PlateauOptions plateau = {})
      : warmup_(warmup_steps), scale_(lr_scale), plateau_(plateau) {}
  // The LR a step uses, from the program's own `base`.
  double lr(double base) const;
  // An applied step: its loss feeds the plateau rule; `base` is the program's LR it ran from (a
  // cut smaller than eps on it is not made; with several parameter groups, the first group's).
  void on_applied(double loss, double base);
  // Warmup and plateau start over (diagnose's restarted schedule).
  void restart();
  std::int64_t applied_steps() const { return applied_; }
  double plateau_factor() const { return factor_; }
  // "schedule.applied_steps", and "schedule.plateau" when the plateau rule is on.
  std::vector<NamedTensor> state() const;
  void load_state(const std::vector<NamedTensor>& state);

 private:
  std::int64_t warmup_;
  double scale_;
  PlateauOptions plateau_;
  std::int64_t applied_ = 0;
  double factor_ = 1.0;
  double best_ = std::numeric_limits<double>::infinity();
  std::int64_t bad_ = 0;
};

// Why `batch` must not be trained on ("" when it may): non-finite features, or token ids outside
// [0, vocab) (vocab > 0), in the tensors of kind kInput.
std::string invalid_batch_reason(const std::vector<NamedTensor>& batch, std::int64_t vocab);

// The module's parameters (kind kParameter) and buffers (kind kBuffer), aliasing the live tensors.
std::vector<NamedTensor> named_parameters(const torch::nn::Module& module, const std::string& prefix = "param.");
std::vector<NamedTensor> named_buffers(const torch::nn::Module& module, const std::string& prefix = "buffer.");
// The optimizer state of `parameters` (kind kOptimizerState), "optim.NAME.exp_avg" for a
// parameter "param.NAME": Adam, AdamW and SGD. Aliases the live tensors.
std::vector<NamedTensor> optimizer_state(torch::optim::Optimizer& optimizer,
                                         const std::vector<NamedTensor>& parameters);
// Rebuilds the optimizer state from `state` (entries absent: that parameter has none yet).
// Throws retrace::Error when an entry is missing or malformed.
void load_optimizer_state(torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& parameters,
                          const std::vector<NamedTensor>& state);
// The same from tensors the caller gives up: the optimizer keeps a moment as it is, instead of a
// clone, when nothing else holds or views it (its tensor's only handle, the only tensor on its
// storage, contiguous over all of it, on the parameter's device); any other is cloned, or copied to
// the parameter's device.
// For Program::adopt_state (docs/replay.md).
void load_optimizer_state(torch::optim::Optimizer& optimizer, const std::vector<NamedTensor>& parameters,
                          std::vector<NamedTensor>&& state);
// Copies `state`'s tensors into `targets` by name, in place (retrace::Error when one is missing
// or has another dtype or shape); gradients of parameters are cleared.
void copy_state_into(const std::vector<NamedTensor>& targets, const std::vector<NamedTensor>& state);

// --- The pipeline ------------------------------------------------------------------------------

class DefendedStep;

// The defenses of one training loop, and its injections. Not thread-safe; one per program.
class Defenses {
 public:
  explicit Defenses(DefenseOptions options = {}, std::vector<InjectionSpec> injections = {});
  ~Defenses();
  Defenses(const Defenses&) = delete;
  Defenses& operator=(const Defenses&) = delete;

  // The training objects the defenses act on; once, in the program's constructor, after the
  // model and optimizer exist. `parameters` alias the live parameters (named_parameters()).
  void attach(Program& program, torch::optim::Optimizer& optimizer, std::vector<NamedTensor> parameters,
              TrainingTraits traits = {});
  // Replaces the defenses and injections (the scenario runner does this on a user's program
  // before its first step). Resets their state. Throws retrace::Error for a combination this
  // program cannot run (token corruption without a vocabulary).
  void configure(DefenseOptions options, std::vector<InjectionSpec> injections);
  const DefenseOptions& options() const { return options_; }
  const TrainingTraits& traits() const { return traits_; }

  // Starts step `step`: sets the step's LR. `monitor` (the recorder's, when recording) is called
  // after backward. Finish the returned step with finish().
  DefendedStep begin(std::int64_t step, StepMonitor* monitor = nullptr);

  // The defenses' state (kind kDefenseState): loss scaler, LR schedule, clipping window. Part of
  // the program's state(), so that replay restores it bitwise.
  std::vector<NamedTensor> state() const;
  void load_state(const std::vector<NamedTensor>& state);
  // Throws retrace::Error unless every tensor of state() is in `program_state` (a program that
  // forgot to append it would replay with another loss scale).
  void check_in(const std::vector<NamedTensor>& program_state) const;

  // What the defenses did so far.
  const LossScaler* scaler() const { return scaler_.get(); }
  const LrSchedule& schedule() const { return schedule_; }
  LrSchedule& schedule() { return schedule_; }
  std::int64_t rollbacks() const { return rollbacks_; }
  std::int64_t caught_recompute_mismatches() const { return caught_mismatches_; }
  const Injector& injector() const { return *injector_; }
  bool parameters_finite() const;
  const std::vector<NamedTensor>& parameters() const { return parameters_; }
  // The LR and loss scale the next step starts with (Program::lr(), Program::loss_scale()).
  double next_lr() const;
  double loss_scale() const;
  // An observer attached during every step's forward and backward, after the injector, so it
  // sees the segment outputs that actually flow on. nullptr detaches; it must outlive its use.
  void observe(SegmentObserver* observer) { extra_observer_ = observer; }

 private:
  friend class DefendedStep;
  struct Snapshot {
    std::int64_t step;
    std::vector<NamedTensor> state;
  };
  Program& program() const;

  DefenseOptions options_;
  TrainingTraits traits_;
  Program* program_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::vector<NamedTensor> parameters_;
  std::vector<std::string> gradient_names_;  // "grad.NAME" per parameter, what the monitor sees
  std::unique_ptr<Injector> injector_;
  std::unique_ptr<LossScaler> scaler_;
  GradClipper clipper_;
  LrSchedule schedule_;
  std::unique_ptr<RecomputeVerifier> verifier_;
  SegmentObserver* extra_observer_ = nullptr;
  std::deque<Snapshot> snapshots_;
  std::int64_t failures_in_a_row_ = 0;
  std::int64_t first_failure_ = 0;  // the step that started the current run of failures
  std::int64_t rollbacks_ = 0;
  std::int64_t caught_mismatches_ = 0;
  bool in_step_ = false;
};

// One step through the defenses: begin() ... batch() ... forward() ... backward() ... finish().
class DefendedStep {
 public:
  DefendedStep(const DefendedStep&) = delete;
  DefendedStep& operator=(const DefendedStep&) = delete;
  ~DefendedStep();  // a step abandoned by an exception detaches its observers and restores the LR

  // Injected corruption, then validation of the inputs (kind kInput). Returns the batch to train
  // on; an invalid one skips the step (done()). Then takes the rollback snapshot and flips the
  // state bits due this step. Exactly once per step, before forward() (which refuses otherwise).
  std::vector<NamedTensor> batch(const std::vector<NamedTensor>& batch);
  // The step was skipped before training (an invalid batch): return finish().
  bool done() const { return done_; }

  // Hold the returned scope around the forward: autocast (TrainingTraits::autocast) while it
  // lives; the injector, the recompute verifier and observe()'s observer stay attached until
  // backward() ends (recomputes run in backward).
  class ForwardScope {
   public:
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;
    ~ForwardScope();

   private:
    friend class DefendedStep;
    explicit ForwardScope(const AutocastState& state);
    std::unique_ptr<AutocastGuard> guard_;
  };
  [[nodiscard]] ForwardScope forward();
  // Back-propagates loss x loss_weight (x an injected spike) x the loss scale. `loss` is the
  // step's loss as the program reports it (any dtype; a float copy is kept). Gradient
  // accumulation: forward() and backward() once per micro-batch; the step's loss (StepOutcome,
  // the trace, loss_finite, final_loss_below, plateau) is the sum of the losses passed -- pass
  // each micro-batch's loss / micro-batches for a mean. A segment injection hits the segment's
  // first run in the step only (docs/injectors.md); a loss spike, every micro-batch's loss.
  void backward(const at::Tensor& loss);
  // After backward: injected gradient faults, the monitor, unscale, gradient norm, recompute
  // check, clipping, the optimizer step or a skip, rollback, the schedule. Returns what happened.
  StepOutcome finish();

 private:
  friend class Defenses;
  DefendedStep(Defenses& d, std::int64_t step, StepMonitor* monitor);
  void skip(std::string why);
  // Data parallel: skip_nonfinite_ranks' check, then the gradient all-reduce. Returns the ranks
  // whose own gradients were not finite (empty: none, or the check is off).
  std::vector<int> sync_gradients(const std::vector<NamedTensor>& grads);
  void detach_observers();
  void restore_lr();
  bool rollback(bool finite_grads);

  Defenses* d_;
  std::int64_t step_;
  StepMonitor* monitor_;
  StepOutcome out_;
  std::vector<double> own_lrs_;  // the optimizer's LR per group before the step
  std::vector<double> set_lrs_;  // ... as begin() set it: the schedule's, times a spike
  // The program's buffers (kind buffer in state()) and their versions as the step began: those a
  // forward wrote (BatchNorm's running statistics) are put back after backward() when its
  // recompute of a checkpointed segment wrote them again.
  std::vector<at::Tensor> buffers_;
  std::vector<std::uint32_t> buffer_versions_;
  bool batch_done_ = false, done_ = false, finished_ = false, backward_done_ = false;
  at::Tensor loss_;
  std::size_t mismatches_before_ = 0;
  std::optional<ObserverScope> inject_scope_, verify_scope_, extra_scope_;
};

// Every parameter of `program` finite: its defenses' parameters where it has defenses (their
// master copies), else the parameters in its state().
bool parameters_finite(Program& program);

}  // namespace retrace
