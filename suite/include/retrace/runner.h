#pragma once
// Runs a scenario -- train, inject, defend -- and checks its expectations; the built-in suite of
// fault x defense scenarios, each with its negative control. `retrace run` (tools/run.cpp) runs
// these in child processes so that one crash cannot take down the suite.

#include <retrace/program.h>
#include <retrace/rng.h>
#include <retrace/scenario.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace retrace {

// One step of a run, condensed from its StepOutcome: what the HTML report draws.
struct StepPoint {
  std::int64_t step = 0;
  double loss = std::numeric_limits<double>::quiet_NaN();
  double grad_norm = std::numeric_limits<double>::quiet_NaN();          // before clipping
  double loss_scale = 1.0;                                              // at the step's start
  double lr = 0.0;                                                      // the LR the step used
  double loss_scale_after = 1.0;                                        // after the step's update
  double clip_coef = 1.0;                                               // StepOutcome::clip_coef
  double clipped_grad_norm = std::numeric_limits<double>::quiet_NaN();  // after clipping
  bool skipped = false;                                                 // the optimizer step was skipped
  bool injected = false;                                                // an injection fired in the step
  bool rolled_back = false;  // a rollback restored an earlier step-start state
};

// The checks a run is judged by (docs/scenarios.md, "Expectations and the verdict"): one per
// `expect` key that makes one, plus the automatic progress (kMinAppliedSteps), per-entry injection
// (kInjectionFired) and counterfactual (kFaultBites, kFaultCaused) checks.
enum class CheckKind {
  kParamsFinite,
  kLossFinite,
  kMaxSkippedSteps,
  kMinSkippedSteps,
  kMinScaleBackoffs,
  kMinScaleGrowths,
  kMinRollbacks,
  kFinalLossBelow,
  kMinAppliedSteps,
  kRecomputeBitwise,
  kReplayBitwise,
  kInjectionsFired,
  kInjectionFired,
  kRaises,
  kFaultBites,      // automatic, a scenario that expects to hold: its fault breaks the run without its
                    // defenses (Counterfactual)
  kFaultCaused,     // automatic, a negative control, or a run that expected to hold and broke: the run
                    // without its injections does not break so within the window (Counterfactual)
  kTrained,         // automatic, a scenario that held: from the fault's step on, its parameters moved
                    // at least kTrainedFraction as far as in the run with neither the fault nor the
                    // defenses (kRunsAway, kMovedAtAll, kMovedAtAllInFloat32), and its optimizer's
                    // state does not end saturated (kSaturatedState) -- defenses that hold by
                    // freezing training (an LR scaled to nothing) held nothing
  kStepAfterFault,  // automatic, a scenario that expects to hold: a step after the fault's last
                    // (fault_last_step), where progress and trained are judged -- a fault due on
                    // the last step leaves a skip that stops training for good unseen; likewise a
                    // step after the run's last rollback (trained measures from the restored state)
};
// trained's bar, from the start of the fault's step to the end: a run that held moved its parameters
// at least kTrainedFraction as far as the run with neither the fault nor the defenses (an LR / 10
// moves them about 0.1 as far; an LR x 1e-12, nothing) -- or, where that run runs away (non-finite
// at the end, or moving more than kRunsAway of their norm), at least kMovedAtAll of their norm --
// and at least kMovedAtAllInFloat32 of their norm in any case (float32's relative precision: less
// is a model that does not train, whatever the other run did).
inline constexpr double kTrainedFraction = 0.01;
inline constexpr double kMovedAtAll = 1e-4;
inline constexpr double kRunsAway = 1.0;
inline constexpr double kMovedAtAllInFloat32 = 1.1920928955078125e-07;  // FLT_EPSILON
// trained's other bar: no tensor of the optimizer's state ends with a typical (median) magnitude
// kSaturatedState times the same tensor's in the run with neither the fault nor the defenses
// (ScenarioResult::optimizer_state_scale). Adam's second moment 1e4 times larger scales its updates
// 100 times down, for ~1/(1-beta2) steps; an unclipped loss x 1e4 leaves it ~1e6 times larger, x 1e18
// 1e32 times, while the spike's momentum and the weight decay still move the parameters. The median
// leaves out a single element (a bit flip in one of 2048 stalls that one only).
inline constexpr double kSaturatedState = 1e4;
// The same bar for a buffer (kind buffer in state(): BatchNorm's running statistics), by its
// largest magnitude (ScenarioResult::buffer_scale), against the larger of the same buffer's in that
// run and kBufferScaleFloor: a running variance 100 times larger is a standard deviation 10 times
// larger, and an eval-mode forward normalized by it is at chance (a fc1 output x 300 for one step
// left running_var 5800 times the run's without it, eval accuracy 0.27 against 0.74, the training
// loss bit for bit the same).
inline constexpr double kSaturatedBuffer = 100;
inline constexpr double kBufferScaleFloor = 1;
// trained's loss bar, against a run of the same configuration without the fault (for a scenario
// without defenses, the run without the fault; with defenses, the run with neither, and where that
// stalls the run with the defenses kept): over the steps after the fault's first no injection fired
// on (at least kLossFallSteps of them), where that run's loss fell at least kLearnedFraction of its
// level, the run's loss (the mean of a fifth of the steps at each end, applied and finite) must fall
// at least kLossFallFraction as far, or end no higher than that run's was kLossFallFraction of its
// way down. An unclipped loss x 700 under Adam left its second moment ~500 times larger: the
// parameters moved a third as far, the loss fell 0.11 as far (4.12 -> 3.93 over steps 4..60, against
// 3.99 -> 2.23), and the run "held".
inline constexpr double kLossFallFraction = 0.25;
inline constexpr double kLearnedFraction = 0.1;
inline constexpr std::int64_t kLossFallSteps = 10;
// trained's runaway bar, whatever the window's length: the run's final loss (the final window's
// applied, finite steps no injection fired on) ends at most kLossRanAway times the untrained model's
// -- the loss of the first step of the run with neither the fault nor the defenses, before any update
// (for a loss L0 that is not positive: at most L0 + (kLossRanAway - 1) |L0|), or at most kLossRanAway
// times where that run ends over the same steps (one that ends with no finite loss there: the
// configuration runs away, and the bar is off; where the configuration is the fault, the first
// step alone counts). A loss x 1e10 clipped
// at 1e6 left an SGD run's loss at 1e10 over the last five of eight steps, too few for the loss bar,
// and it "held" on its parameters' movement.
inline constexpr double kLossRanAway = 2;
// The least change of the final loss, as a fraction of final_loss_below, that a fault must make for
// its final-loss breakage to be its own: one that moves it less only nudged it across the threshold
// (the run without it then counts as breaking too).
inline constexpr double kFinalLossEdge = 0.01;
const char* to_string(CheckKind kind);  // "params_finite", ...: the `expect` key and the JSON's name

// What a failed check says of the run.
enum class CheckRole {
  kBreakage,  // a fault got through (a negative control's evidence; a held scenario broke):
              // params_finite, loss_finite, final_loss_below, recompute_bitwise, min_applied_steps,
              // trained
  kExercise,  // the fault or the defense never acted (outcome "not exercised"): injection_fired,
              // injections_fired, min_skipped_steps, min_scale_backoffs, min_scale_growths,
              // min_rollbacks, raises (when nothing was raised; a wrong raise breaks), fault_bites
              // (the fault does not break the run without the defenses either: Counterfactual)
  kOther,     // describes the run: max_skipped_steps, replay_bitwise
  kCause,     // a control's breakage was not its fault's: fault_caused (the run without its
              // injections breaks within the window: outcome "broke without the fault"; Counterfactual)
};
CheckRole role_of(CheckKind kind);

struct ExpectationCheck {
  CheckKind kind = CheckKind::kParamsFinite;
  std::string expected;  // "true", "<= 1", "< 3.5"
  std::string observed;  // "false", "3", "4.12"
  bool passed = false;
  const char* name() const { return to_string(kind); }
};

// What broke a run, and the first step that showed it: the evidence a negative control's verdict
// rests on (docs/scenarios.md, "Expectations and the verdict").
enum class BreakKind {
  kNonFiniteParams,          // parameters non-finite at the end (step: since when, without a finite step between)
  kNonFiniteLoss,            // an applied step's loss was non-finite (expect.loss_finite: true failed)
  kFinalLoss,                // expect.final_loss_below failed (step: the run's last step)
  kSilentRecompute,          // a recompute that was not bitwise reached applied gradients
                             // (expect.recompute_bitwise: true failed)
  kNoProgress,               // a control's expect.min_applied_steps failed: the defense stopped training
                             // (step: the run's last step)
  kRaised,                   // the run raised (step: the step in progress)
  kRanksSplit,               // data parallel: the ranks ended with different state (step: the run's last
                             // step); found when `retrace run` combines the ranks' results
  kNonFiniteOptimizerState,  // the optimizer's state non-finite at the end, the parameters finite
                             // (step: the run's last): an Adam second moment of Inf makes every
                             // later update of its parameters 0, a silent freeze
  kNonFiniteBuffers,         // a buffer non-finite at the end, the parameters and the optimizer's
                             // state finite (step: the run's last): BatchNorm's running statistics,
                             // which eval mode reads
  kSaturatedBuffers,         // a held run's (or the undefended run's) buffer ends kSaturatedBuffer
                             // times the same buffer's largest magnitude in the run with neither the
                             // fault nor the defenses, or kBufferScaleFloor (step: the run's last):
                             // finite running statistics blown up break eval mode as NaN ones do
};
const char* to_string(BreakKind kind);  // "non_finite_params", ...

struct Breakage {
  BreakKind kind = BreakKind::kRaised;
  std::int64_t step = 0;
  std::string detail;   // "parameters non-finite from step 5 on", "step 3 raised: ..."
  bool counts = false;  // at or after the fault step, of a kind the scenario's verdict accepts, and
                        // (a control's) not shown anywhere in the window by the run without its
                        // injections
  // A control's: the step at which the run without its injections showed the same kind of
  // breakage, anywhere in the window (then it does not count: a fault that only brings it forward
  // did not cause it); 0: it did not.
  std::int64_t without_fault_step = 0;
};

// What a step did that the run's counters do not say: an injection that fired in it, or why a
// defense skipped it. Kept as data (step, kind, text); reporters render it ("step 3: ...").
enum class StepNoteKind {
  kInjected,  // text: the injection's own line, "TYPE WHERE: DETAIL" (StepOutcome::injected)
  kSkipped,   // text: the skip reason (StepOutcome::skip_reason), a rollback's restore included
};
const char* to_string(StepNoteKind kind);  // "injected", "skipped"

struct StepNote {
  std::int64_t step = 0;
  StepNoteKind kind = StepNoteKind::kInjected;
  std::string text;
  std::string line() const { return "step " + std::to_string(step) + ": " + text; }  // "step N: TEXT"
  bool operator==(const StepNote& o) const { return step == o.step && kind == o.kind && text == o.text; }
};

// What a run did, as the outcome matrix shows it (ScenarioResult::outcome_kind).
enum class Outcome {
  kHeld,
  kBroke,
  kBrokeEarly,         // a negative control broken only before its fault's step
  kNotExercised,       // nothing broke, but the fault or the defense never acted: an injection entry
                       // that did not fire, a defense's expected action that did not happen
                       // (min_skipped_steps, min_scale_*, min_rollbacks, a raise expected and not raised),
                       // or a harness error (the run never got to its fault); also a run that held
                       // where its fault does not break the run without its defenses either
  kBrokeWithoutFault,  // a run whose breakage the run without its injections shows too, within the
                       // window: the configuration broke it, not the fault (a negative control; or
                       // a run that expected to hold, where nothing else broke it)
};
const char* to_string(Outcome o);  // "held", "broke", "broke early", "not exercised", "broke without the fault"

// The verdict's counterfactual (docs/scenarios.md, "Did the fault do it?"): the same run, same
// seed and window, without its injections (a negative control: breakage the configuration shows
// anyway does not count) or without its defenses, judged as a negative control (a scenario that
// expects to hold: a fault that does not break the undefended run gave the defenses nothing to
// hold). Its verdict is the fault_caused or fault_bites check.
enum class CounterfactualKind {
  kNone,        // not run: no injections (the configuration is the fault), no defenses to take away,
                // a harness error, nothing a control counted, a run that did not hold, or data
                // parallel (Counterfactual::why_not says which, where it matters)
  kFaultFree,   // a control without its injections
  kUndefended,  // a scenario that expects to hold, without its defenses
  kBare,        // neither the fault nor the defenses: run after an undefended run that broke, to
                // date which of its breakage the configuration shows anyway (a plan's kind only:
                // the result's counterfactual stays kUndefended, its breakage marked)
};
const char* to_string(CounterfactualKind kind);  // "none", "fault_free", "undefended", "bare"

struct Counterfactual {
  CounterfactualKind kind = CounterfactualKind::kNone;
  std::string why_not;         // kNone: why it was not run ("" when the rules ask for none)
  std::int64_t last_step = 0;  // the last step it reached: the window's (undefended, it stops at
                               // the first step from the fault's that leaves parameters non-finite)
  bool broke = false;          // fault_free: it broke at all; undefended: by the fault (some of
                               // its breakage the run with neither fault nor defenses does not show
                               // within the window: counts, without_fault_step 0)
  bool params_finite = true;
  double final_loss = std::numeric_limits<double>::quiet_NaN();
  double param_movement = std::numeric_limits<double>::quiet_NaN();  // ScenarioResult's, from the
                                                                     // same step as the run's
  std::map<std::string, double> optimizer_state_scale;               // ScenarioResult's
  std::map<std::string, double> buffer_scale;                        // ScenarioResult's
  std::vector<Breakage> breakage;  // what broke in it (undefended: without_fault_step set where the
                                   // run with neither fault nor defenses showed it too, at any step)
  // Its steps, for weighing its loss against the run with neither (trained's loss bar). In memory
  // only: not in the JSON (the counterfactual's evidence there is the fields above).
  std::vector<StepPoint> steps;
};

// One entry of the scenario's injection list, and what became of it in the run.
struct InjectionTally {
  std::size_t entry = 0;            // index in spec.injections
  std::string type;                 // to_string(InjectionType)
  std::vector<std::int64_t> due;    // steps reached on which its seeded schedule selected it
  std::vector<std::int64_t> fired;  // steps it fired on
};

struct ScenarioResult {
  std::string name;
  std::string origin;   // file path or builtin:NAME
  std::string fault;    // injection types, "none" without
  std::string defense;  // the defenses switched on, "none" without

  // What happened.
  bool raised = false;         // an exception left the run
  bool harness_error = false;  // ... before the fault's step (the program or trace could not be set
                               // up, or a step before the fault raised): such a run never passes,
                               // not even as a negative control
  std::string error;           // its message
  // A data-parallel run: the rank this result is of, and how many there were. Each rank judges its
  // own run (an injection for another rank is accounted in that rank's result); `retrace run`
  // combines the ranks' results into one (rank 0's, failing when any rank failed or they disagree).
  int rank = 0;
  int world_size = 1;
  // Data parallel: the digest (hex) of each tensor of the program's state() at the end, by name,
  // in state() order -- what `retrace run` compares across the ranks (in step, they are equal).
  std::vector<std::pair<std::string, std::string>> state_digests;
  std::int64_t steps_run = 0;
  std::int64_t skipped_steps = 0;
  std::int64_t applied_nonfinite_steps = 0;  // steps not skipped with a non-finite loss or norm
  std::int64_t scale_backoffs = 0, scale_growths = 0, tolerated_overflows = 0;
  std::int64_t rollbacks = 0;
  std::int64_t recompute_mismatches = 0;         // segments whose recompute was not bitwise
  std::int64_t silent_recompute_mismatches = 0;  // ... in steps whose gradients were applied
  std::int64_t caught_recompute_mismatches = 0;  // ... caught by defenses.verify_recompute
  bool params_finite = true;
  // Every floating-point tensor of kind optimizer_state in state() finite at the end; else the
  // first that is not, by name.
  // The first floating-point tensor of state() besides the parameters -- optimizer state first,
  // then buffers (BatchNorm's running statistics) -- that is non-finite at the end, by name; ""
  // where all are finite. Defense state is not looked at (a best loss so far may start at +inf).
  std::string nonfinite_state;
  TensorKind nonfinite_state_kind = TensorKind::kOther;
  bool all_losses_finite = true;  // over applied (not skipped) steps
  double final_loss = 0;          // mean loss of the applied steps in the final window
                                  // (final_window_first .. last_step); NaN: none
  // How far training moved the parameters from the start of step param_movement_from (the step
  // after the fault's last, RunOptions::movement_from; after a rollback at or after it, the step
  // after the last rollback: the jump back to a restored state is no training) to the run's end:
  // the L2 norm, in double, of the change of every floating-point parameter in state(), relative to
  // their L2 norm at that start; NaN where not known (a parameter's shape changed, the run never
  // reached that step, all parameters zero).
  double param_movement = std::numeric_limits<double>::quiet_NaN();
  std::int64_t param_movement_from = 1;
  // Each floating-point tensor of kind optimizer_state in state() at the end, by name: the median
  // magnitude of its finite elements (empty where the program reports none). A fault that leaves one
  // kSaturatedState times the same tensor's in the run without the fault and the defenses held
  // nothing: its numbers stay in the state and scale the optimizer's updates down for as long.
  std::map<std::string, double> optimizer_state_scale;
  // Each floating-point tensor of kind buffer in state() at the end, by name: the largest magnitude
  // of its finite elements. One kSaturatedBuffer times the same buffer's in the run with neither the
  // fault nor the defenses (or kBufferScaleFloor) held nothing either (BreakKind::kSaturatedBuffers).
  std::map<std::string, double> buffer_scale;
  // The last step of the window an injection is due on, on any rank (0: none). At the run's last
  // step, no step after the fault shows training going on (kStepAfterFault).
  std::int64_t fault_last_step = 0;
  std::vector<double> losses, scales, lrs;  // per step
  std::vector<StepPoint> steps;             // per step, all of it (the report's curves)
  std::vector<StepNote> notes;              // in step order; per step, its injections before its skip
  bool replayed = false, replay_bitwise = false;
  std::string replay_report;  // the first divergence when not bitwise
  double seconds = 0;
  double cpu_seconds = 0;  // the process's CPU time over the steps (recording included, setup
                           // and replay not; 0 when a step raised): steadier than wall time on a
                           // busy machine (what diagnose ranks fixes by)
  // The fault and what it did.
  std::int64_t fault_step = 1;          // the first injection's step (the window's first step, or 1,
                                        // when there is none: then the configuration is the fault)
  std::int64_t last_step = 0;           // the last step the run reached (the one that raised included)
  std::int64_t raised_at_step = 0;      // the step in progress when it raised; 0: did not, or before any
  bool raised_by_defense = false;       // what it raised was a defense's refusal (DefenseRefusal)
  std::int64_t applied_from_fault = 0;  // applied steps from fault_step to the end, with a gradient
  // Steps from fault_step on applied with a gradient of norm 0 (clipped by 0, underflowed): they
  // train nothing of their own, and the progress rule does not count them as applied.
  std::int64_t zero_gradient_steps = 0;
  bool last_step_applied = false;
  std::int64_t final_window_first = 0;          // final_loss averages the applied steps of
                                                // max(fault_step, last_step - 2) .. last_step
  std::int64_t nonfinite_params_since = 0;      // parameters non-finite after this step and every
                                                // later one (the step before the first: from the start)
  std::int64_t first_nonfinite_loss_step = 0;   // first applied step with a non-finite loss
  std::int64_t first_silent_mismatch_step = 0;  // first applied step with a non-bitwise recompute
  std::vector<InjectionTally> injections;
  std::vector<std::string> segments_seen;  // checkpointed segments that ran, in order of first run
  std::vector<Breakage> breakage;          // what broke, in the order found

  Counterfactual counterfactual;  // the same run without the fault or without the defenses

  // Stability figures (retrace run --bench): against the same run without its injections.
  struct Bench {
    bool measured = false;
    bool injected = false;  // the scenario injects (else its "fault" is its config and
                            // there is no fault-free run to compare with)
    double fault_free_final_loss = 0;
    double final_loss_delta = 0;  // final_loss - fault_free_final_loss
    // From the first disturbed step at or after the first injection (skipped, non-finite, or a
    // loss more than 10% off the fault-free run's) to the first undisturbed one; 0 when no step
    // was disturbed, -1 when the run never got back.
    std::int64_t steps_to_recover = -1;
    double overhead = 0;  // time per step with the defenses / without, fault-free
  } bench;

  // Verdict.
  std::vector<ExpectationCheck> checks;
  // A scenario that expects to hold broke when it raised (unless expect.raises, and then when it
  // raised another message), ended with non-finite parameters or failed a check of what breaks
  // (params_finite, loss_finite, final_loss_below, recompute_bitwise, min_applied_steps). A
  // negative control broke when some breakage counts: at or after fault_step, of the kinds its
  // expectations name.
  bool broke = false;
  bool expected_to_break = false;  // expect.diverges (a negative control)
  bool passed = false;
  std::vector<std::string> reasons;  // why it did not pass, one line each (empty when it passed)

  // held, broke, broke early (a negative control whose only breakage came before its fault's
  // step: it showed nothing about the fault, and the run did not hold either), or not exercised
  // (nothing broke, and a check says the fault or the defense never acted: such a run held
  // nothing, whatever it expected).
  Outcome outcome_kind() const;
  std::string outcome() const { return to_string(outcome_kind()); }
  // The notes of one kind, in step order.
  std::vector<StepNote> notes_of(StepNoteKind kind) const;
  // The first breakage that counts (a control's evidence), or nullptr.
  const Breakage* evidence() const;
  // The matrix's verdict: "ok", or "FAILED" followed by the reasons in parentheses.
  std::string verdict() const;
  // The result as one JSON object (docs/scenarios.md, "JSON"), and back: results come from `retrace
  // run`'s child processes this way. from_json throws nlohmann::json's errors for a missing or
  // mistyped field and retrace::Error for an unknown kind of note or breakage.
  nlohmann::json to_json() const;
  static ScenarioResult from_json(const nlohmann::json& j);
};

struct RunOptions {
  // Where the recorded trace goes when expect.replay_bitwise asks for a replay ("" = a temporary
  // file, removed afterwards).
  std::string trace_path;
  bool replay = true;  // honour expect.replay_bitwise (only for runs from step 1)
  // A window of the run instead of all of it (retrace diagnose): steps first_step..last_step
  // (0 = training.steps), starting from `start_state` and `start_rng` when set.
  std::int64_t first_step = 1, last_step = 0;
  const std::vector<NamedTensor>* start_state = nullptr;
  const RngState* start_rng = nullptr;
  bool restart_schedule = false;  // drop the snapshot's schedule state (warmup starts over)
  // Run the verdict's counterfactual (Counterfactual): off only where the caller
  // judges the run by other evidence (retrace diagnose's variants, judged against the failing run).
  bool counterfactual = true;
  // Stop after the first step from the fault's on that leaves the parameters non-finite (a
  // counterfactual run: what it was run to show has shown).
  bool stop_at_nonfinite_params = false;
  // The step from whose start ScenarioResult::param_movement is measured (0: the run's fault step).
  std::int64_t movement_from = 0;
};

// Runs `spec` in this process. Never throws for what the scenario does (an exception from
// training is the result's `raised`); throws retrace::Error only for a broken environment (the
// trace file cannot be created).
ScenarioResult run_scenario(const ScenarioSpec& spec, const RunOptions& options = {});

// The verdict from a run's checks and breakage, computed once and stored: r.broke, r.passed and
// r.reasons -- why it did not pass, one line each, the only such text; the reporters render these
// lines and never derive their own. run_scenario decides it; `retrace run` decides a
// data-parallel run's again on the ranks' combined result.
void decide_verdict(const ExpectSpec& expect, ScenarioResult& r);

// The counterfactual a run's verdict needs (Counterfactual), in three steps: planned from the run's
// result, run, and weighed in. run_scenario does all three in one process; for a data-parallel
// scenario `retrace run` does them across the ranks, launching them again for the counterfactual
// (each rank's own run_scenario leaves it to the launcher: why_not says so).
struct CounterfactualPlan {
  CounterfactualKind kind = CounterfactualKind::kNone;  // kNone: none to run
  std::int64_t first_step = 1, last_step = 0;           // its window: the run's (RunOptions')
  std::int64_t fault_step = 1;                          // the run's: the fault-free run dates breakage by it
  // The run's ScenarioResult::param_movement_from: the counterfactual's movement covers the same
  // steps (0: from after the fault's last step).
  std::int64_t movement_from = 0;
  // kFaultFree for a held scenario with defenses: its loss stalled against the run with neither the
  // fault nor the defenses, and this run (the defenses kept) says whether the fault or the defenses
  // slowed it (trained's loss bar, kLossFallFraction). Not on the ranks' command line: the launcher
  // weighs it.
  bool loss_only = false;
};
// Which counterfactual r's verdict needs: none when RunOptions::counterfactual is off, r is a
// harness error or has no injections, a control did not break, or a run that expects to hold did
// not hold (outcome held) or has no defense to take away (then r.counterfactual.why_not says so).
CounterfactualPlan plan_counterfactual(const ScenarioSpec& spec, const RunOptions& options, ScenarioResult& r);
// The scenario the counterfactual runs: without its injections, judged as a negative control by
// its expectations of what breaks (kFaultFree), or without its defenses -- every `defenses:` entry
// off, training.clip_grad_norm 0, preserve_rng_state off against an rng_desync fault -- judged by
// its expectations of what breaks (kUndefended).
ScenarioSpec counterfactual_spec(const ScenarioSpec& spec, CounterfactualKind kind);
// trained's second bar: the optimizer-state tensor of `r` whose median magnitude ended
// kSaturatedState times or more the same tensor's in `without` -- a run with neither the fault nor
// the defenses over the same steps, that trains and stays finite -- said in a line; nullopt where
// none did. diagnose judges its variants by it too.
std::optional<std::string> saturated_state(const ScenarioResult& r, const ScenarioResult& without);
// Runs the plan's counterfactual in this process (one rank of it, for a data-parallel scenario):
// counterfactual_spec over the plan's window, no replay, no counterfactual of its own.
ScenarioResult run_counterfactual(const ScenarioSpec& spec, const CounterfactualPlan& plan,
                                  const RunOptions& options = {});
// Weighs the counterfactual run `c` into r (whose verdict is decided): r.counterfactual, the
// fault_caused or fault_bites check, a control's breakage that `c` shows within the window no longer
// counting, and the verdict as those change it. A `c` that could not run (harness error) fails
// the check: the verdict is not earned. Returns the plan of the run still needed before the check
// is decided (an undefended run that broke: the bare run, weighed in the same way), else kNone:
//   for (plan = plan_counterfactual(...); plan.kind != kNone;)
//     plan = weigh_counterfactual(spec, plan, run_counterfactual(spec, plan), r);
CounterfactualPlan weigh_counterfactual(const ScenarioSpec& spec, const CounterfactualPlan& plan,
                                        const ScenarioResult& c, ScenarioResult& r);

// run_scenario plus the stability figures: the run without its injections (defenses on, for the
// loss delta and recovery) and without injections or defenses (for the defenses' overhead,
// median of `repeats` runs each).
ScenarioResult bench_scenario(const ScenarioSpec& spec, int repeats = 5);

// "fault" and "defense" labels of a scenario, as the outcome matrix shows them.
std::string fault_label(const ScenarioSpec& spec);
std::string defense_label(const ScenarioSpec& spec);

// The built-in suite (suite/scenarios/*.yaml, compiled in): names and texts, in file-name order.
struct BuiltinScenario {
  std::string name;  // file name without .yaml
  std::string text;
};
const std::vector<BuiltinScenario>& builtin_suite();
// "builtin:NAME" or a path -> the parsed scenario (retrace::Error for an unknown name).
ScenarioSpec load_scenario(const std::string& path_or_builtin);
// The renderings of results -- console, JSON, JUnit, HTML -- are in reporter.h and report.h.

}  // namespace retrace
