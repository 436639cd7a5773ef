#pragma once
// The replayer: restores a recorded step (parameters, optimizer state, RNG, batch) and
// re-executes it — forward, recompute, backward, clipping, optimizer — comparing every recorded
// digest or tensor in order. The result is "reproduced bitwise" or the first divergence (step,
// segment, phase, tensor, how far off). For a step that went non-finite it re-runs the step with
// op-level instrumentation (at::RecordFunction, replay only) and names the first op whose output
// holds NaN or Inf.

#include <retrace/diff.h>
#include <retrace/digest.h>
#include <retrace/environment.h>
#include <retrace/program.h>
#include <retrace/trace.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace retrace {

struct Divergence {
  std::int64_t step = -1;
  std::string segment;  // "" for state outside segments: "(loss)", "(parameters)", "(state)"
  // step_begin | forward | recompute | backward | optimizer. For a step that raised in one run
  // and not in the other, or raised another message: how far the replay got (its last segment
  // event, or optimizer once the program handed its gradients to StepMonitor::after_backward).
  std::string phase;
  std::string tensor;  // e.g. "output.0", "grad.lm_head.weight", "state.param.block0.fc.weight"
  Digest recorded, replayed;
  std::optional<DiffReport> diff;  // when the trace holds the recorded values
  std::string detail;              // for structural differences (missing record, other segment)
  // What probably caused it, where the replay can tell; "" otherwise. Set for a divergence in the
  // first step replayed from a snapshot taken after the run's first step: after its optimizer
  // step in (state), everything before it matched, the program's state() probably leaves out
  // something that step depends on (optimizer moments, a schedule counter); elsewhere, either
  // state() leaves something out or the program is not deterministic, and the hint names the
  // replay from the run's first step that tells them apart.
  std::string hint;
  std::string message() const;
  nlohmann::json to_json() const;
};

struct TensorStats {
  std::string name;  // "input 0"
  std::string meta;  // "Float[4, 16]"
  // Over the finite elements (what explains a NaN: the negative input of sqrt, the zero divisor);
  // NaN when a floating tensor holds no finite element.
  double min = 0, max = 0, abs_max = 0;
  NonFiniteCounts nonfinite;
};

struct NonFiniteOrigin {
  std::int64_t step = -1;
  std::string segment;  // "" outside checkpointed segments
  // The op ran in an observer of the segment's output (an injector replacing it), after the
  // segment's own code: the value is the observer's doing, not the segment's.
  bool by_observer = false;
  // forward | recompute | backward (checkpointed segments and autograd), post-backward (after
  // autograd's backward, before the program hands its gradients to StepMonitor::after_backward:
  // gradient faults, gradient post-processing), optimizer (after that call: loss-scaler unscale,
  // clipping, the optimizer step)
  std::string phase;
  std::string op;  // e.g. "aten::div", "autograd::engine::evaluate_function: MulBackward0"
  // When `op` made the value inside its own kernel and handed it to a nested op, that nested op
  // (the first to return it): op "aten::mse_loss", inner_op "aten::sum". Empty otherwise.
  std::string inner_op;
  // `op` was given an infinity as an argument (masked_fill(mask, -inf), fill_(inf)): an infinity by
  // design, named because no later op absorbed it. `nan_op` (in `nan_segment`, `nan_phase`) is the
  // first op that turned it into a NaN (a softmax of a row masked whole, a product with 0); empty
  // when it stayed an infinity, and `carried_to` is the last op that carried it on (the loss's
  // sum, a gradient norm, a parameter update).
  bool given_infinity = false;
  std::string nan_op, nan_segment, nan_phase;
  std::string carried_to;
  std::vector<TensorStats> inputs;   // `op`'s, as they were before it ran (an in-place op's too)
  std::vector<TensorStats> outputs;  // of the op that first returned the value (inner_op, else op)
  std::string message() const;
  nlohmann::json to_json() const;
};

// A replayed step that raised. The replay stops there; it reproduced when the recorded run raised
// the same message at the same step (else first_divergence says how the runs differ).
struct RaisedStep {
  std::int64_t step = -1;
  std::string what;                     // exception_message() of the replay's exception
  std::optional<std::string> recorded;  // what the recorded run raised at this step, if it did
  nlohmann::json to_json() const;
};

struct ReplayOptions {
  std::optional<std::int64_t> step;  // the last step to replay; default: the last recorded
  // Replay from the latest full snapshot at or before this step (default: the latest at or
  // before `step`, so a full-mode or flight-ring trace re-executes just the target step).
  std::optional<std::int64_t> from;
  bool force = false;      // replay despite an incompatible environment
  bool provenance = true;  // find the first non-finite op of a non-finite step
};

struct ReplayResult {
  bool reproduced = false;
  std::int64_t from_step = -1, to_step = -1;  // replayed range
  std::int64_t target_step = -1;              // the step asked for (--step, else the trace's last)
  // Why the replay ended before target_step ("" when it reached it): a step that went non-finite
  // and was not skipped with its parameters finite (named: its loss, or the first non-finite
  // state() tensor and its kind), a divergence, a raise.
  std::string ended_early;
  // The first step before which the recorded run's Program::batch() drew from a global generator
  // (the program's contract broken; the replay goes on from the recorded RNG state and notes it
  // once); 0: none seen.
  std::int64_t batch_draws_rng_from = 0;
  std::optional<Divergence> first_divergence;
  // Why the replay shows neither reproduction nor a divergence (reproduced false, no
  // first_divergence): no step re-executed to its end, or none whose outcome the trace holds (the
  // run died in the one step replayed). "" otherwise.
  std::string not_shown;
  std::optional<NonFiniteOrigin> first_nonfinite;
  std::optional<RaisedStep> raised;
  std::vector<EnvironmentDifference> environment;  // bitwise-relevant differences (forced)
  std::vector<std::string> notes;                  // e.g. the truncated-trace warning
  nlohmann::json to_json() const;
};

// Thrown when the environment differs in a field that breaks bitwise equality and
// ReplayOptions::force is off. what() names the field, both values and the fix.
class EnvironmentMismatch : public Error {
 public:
  explicit EnvironmentMismatch(std::vector<EnvironmentDifference> d);
  const std::vector<EnvironmentDifference>& differences() const { return differences_; }

 private:
  std::vector<EnvironmentDifference> differences_;
};

class Replayer {
 public:
  Replayer(const TraceReader& trace, Program& program);
  // Restores the program to the anchor's snapshot and re-executes. The snapshot is decoded
  // straight into the program's own state() tensors where they fit (CPU, contiguous, the
  // recorded dtype and shape) and handed over with Program::adopt_state; a trace found bad
  // while it is decoded (a TraceError) may leave the program's state partly overwritten.
  ReplayResult run(const ReplayOptions& options = {});

 private:
  const TraceReader& trace_;
  Program& program_;
};

// What a program rebuilt from a trace is for.
enum class BuildFor : std::uint8_t {
  kFreshStart,  // it starts from its constructor's state (e.g. diagnose re-running step 1)
  kReplay,      // Replayer::run restores its state() from a snapshot before any step: built
                // under a RestoringStateScope, its constructor may skip drawing initial values
};
// Rebuilds the program named in the trace header through the registry. With BuildFor::kReplay
// the program's state() may hold uninitialized memory until Replayer::run restores it: use such a
// program only for replay.
std::unique_ptr<Program> program_from_trace(const TraceReader& trace, BuildFor purpose = BuildFor::kFreshStart);

}  // namespace retrace
