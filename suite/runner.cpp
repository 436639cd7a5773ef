#include <retrace/runner.h>

#include <retrace/error.h>
#include <retrace/injectors.h>
#include <retrace/number.h>
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/trace.h>
#include <retrace/observer.h>
#include <retrace/trainer.h>
#include <retrace/verify.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unistd.h>

namespace retrace {

namespace {

std::string fmt(double v) { return number_text(v); }

nlohmann::json num(double v) { return json_number(v); }

double from_num(const nlohmann::json& j) {
  return number_from_json(j).value_or(std::numeric_limits<double>::quiet_NaN());
}

void check(ScenarioResult& r, CheckKind kind, std::string expected, std::string observed, bool passed) {
  r.checks.push_back({kind, std::move(expected), std::move(observed), passed});
}

// A failed check's line among the reasons: "NAME: expected E, got O".
std::string reason_of(const ExpectationCheck& c) {
  return std::string(c.name()) + ": expected " + c.expected + ", got " + c.observed;
}

// Whether r's movement is measured from a state a rollback restored, after the fault's last step
// (ScenarioRun::after_step).
bool measured_after_rollback(const ScenarioResult& r) {
  const std::int64_t rolled_back = r.param_movement_from - 1;
  return rolled_back >= std::max(r.fault_step, r.fault_last_step) &&
         std::any_of(r.steps.begin(), r.steps.end(),
                     [&](const StepPoint& p) { return p.step == rolled_back && p.rolled_back; });
}

std::string steps_text(const std::vector<std::int64_t>& steps) {
  std::string out;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (i == 8) return out + ", ... (" + std::to_string(steps.size()) + " steps)";
    out += (i ? ", " : "") + std::to_string(steps[i]);
  }
  return out;
}

// What the runner watches in the segments: the recompute verifier, and the names of the
// segments that ran (what a segment injection that never fired is compared with).
class RunObserver : public SegmentObserver {
 public:
  explicit RunObserver(RecomputeVerifier& verifier) : verifier_(verifier) {}
  void on_forward(SegmentEvent& e) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (std::find(names_.begin(), names_.end(), e.segment) == names_.end()) names_.push_back(e.segment);
    }
    verifier_.on_forward(e);
  }
  void on_recompute(SegmentEvent& e) override { verifier_.on_recompute(e); }
  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return names_;
  }

 private:
  RecomputeVerifier& verifier_;
  mutable std::mutex mutex_;
  std::vector<std::string> names_;
};

// A failed check that says the fault or the defense never acted (CheckRole::kExercise); a raise
// expected counts only when none came (another raise broke the run).
bool says_not_exercised(const ExpectationCheck& c, bool raised) {
  return !c.passed && role_of(c.kind) == CheckRole::kExercise && !(c.kind == CheckKind::kRaises && raised);
}

// "steps A..B": the final window the final loss averages (or that the run never reached it).
std::string final_window(const ScenarioResult& r) {
  return r.last_step >= r.final_window_first
             ? "steps " + std::to_string(r.final_window_first) + ".." + std::to_string(r.last_step)
             : "steps from " + std::to_string(r.final_window_first) + " (the run stopped at step " +
                   std::to_string(r.last_step) + ")";
}

// Whether some step of the final window was applied (not skipped): else it has no final loss.
bool applied_in_final_window(const ScenarioResult& r) {
  return std::any_of(r.steps.begin(), r.steps.end(),
                     [&](const StepPoint& p) { return p.step >= r.final_window_first && !p.skipped; });
}

// Each expectation of the scenario against what the run did: r.checks.
void check_expectations(const ScenarioSpec& spec, ScenarioResult& r) {
  const ExpectSpec& e = spec.expect;
  const bool raise_expected = e.raises.value_or(false);
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const std::string window = final_window(r);
  if (e.params_finite)
    check(r, CheckKind::kParamsFinite, b(*e.params_finite), b(r.params_finite), r.params_finite == *e.params_finite);
  if (e.loss_finite) {
    // Vacuous when every step at the end was skipped: then no loss at the end was looked at.
    const bool looked = !std::isnan(r.final_loss) || !r.all_losses_finite;
    const bool finite = r.all_losses_finite && looked;
    check(r, CheckKind::kLossFinite, b(*e.loss_finite),
          looked ? b(r.all_losses_finite) : "no applied step in " + window, finite == *e.loss_finite);
  }
  if (e.max_skipped_steps) {
    check(r, CheckKind::kMaxSkippedSteps, "<= " + std::to_string(*e.max_skipped_steps), std::to_string(r.skipped_steps),
          r.skipped_steps <= *e.max_skipped_steps);
  }
  if (e.min_skipped_steps) {
    check(r, CheckKind::kMinSkippedSteps, ">= " + std::to_string(*e.min_skipped_steps), std::to_string(r.skipped_steps),
          r.skipped_steps >= *e.min_skipped_steps);
  }
  if (e.min_scale_backoffs) {
    check(r, CheckKind::kMinScaleBackoffs, ">= " + std::to_string(*e.min_scale_backoffs),
          std::to_string(r.scale_backoffs), r.scale_backoffs >= *e.min_scale_backoffs);
  }
  if (e.min_scale_growths) {
    check(r, CheckKind::kMinScaleGrowths, ">= " + std::to_string(*e.min_scale_growths), std::to_string(r.scale_growths),
          r.scale_growths >= *e.min_scale_growths);
  }
  if (e.min_rollbacks) {
    check(r, CheckKind::kMinRollbacks, ">= " + std::to_string(*e.min_rollbacks), std::to_string(r.rollbacks),
          r.rollbacks >= *e.min_rollbacks);
  }
  if (e.final_loss_below) {
    // NaN is the mean of no step, or of steps one of which applied a NaN loss: said apart.
    const bool any_applied = applied_in_final_window(r);
    // Digits enough to show the two apart where 6 print them alike (a loss just at its bound).
    const int digits = digits_apart(r.final_loss, *e.final_loss_below);
    check(r, CheckKind::kFinalLossBelow, "< " + number_text(*e.final_loss_below, digits) + " (" + window + ")",
          any_applied ? number_text(r.final_loss, digits) : "no applied step in " + window,
          std::isfinite(r.final_loss) && r.final_loss < *e.final_loss_below);
  }
  // A fault due on the run's last step leaves no step after it, where progress and trained are
  // judged: a defense that skips the fault's step and every one after it for good would pass as
  // one that skips the fault's step alone. Not held, and not broke: not shown.
  const bool nothing_after = r.fault_last_step > 0 && r.fault_last_step >= r.last_step;
  if (!e.diverges && !r.raised && !r.harness_error && nothing_after) {
    const std::string n = std::to_string(r.fault_last_step);
    check(r, CheckKind::kStepAfterFault, "a step after step " + n + ", the fault's last, to show training going on",
          "none: the run ends on step " + n + ", which an injection is due on; make training.steps larger than " + n +
              ", or end the injection before the run's last step",
          false);
  }
  // The same where the run's last step rolled back after the fault: trained measures from the
  // restored state on (a rollback's jump back is no training), and no step is left to measure.
  const bool rolled_back_last = !nothing_after && r.param_movement_from > r.last_step && measured_after_rollback(r);
  if (!e.diverges && !r.raised && !r.harness_error && rolled_back_last) {
    const std::string n = std::to_string(r.last_step);
    check(r, CheckKind::kStepAfterFault, "a step after the last rollback to show training going on after it",
          "none: step " + n + ", the run's last, rolled back; make training.steps larger than " + n +
              " to show training going on after the recovery",
          false);
  }
  // Progress: a defense that skips or rolls back (almost) every step after the fault did not let
  // training go on. Not for a run that raised (that is its verdict, expected or not), nor (unless
  // asked) for a control, nor for a fault that lasts to the end (step_after_fault says so).
  const std::int64_t after = r.last_step - r.fault_step + 1;
  if (!r.raised && after > 0 && (e.min_applied_steps || (!e.diverges && !nothing_after))) {
    const std::string span = "of steps " + std::to_string(r.fault_step) + ".." + std::to_string(r.last_step);
    std::string observed = std::to_string(r.applied_from_fault) + " applied";
    if (r.zero_gradient_steps > 0)
      observed += " (and " + std::to_string(r.zero_gradient_steps) + " with a gradient of norm 0, which train nothing)";
    if (e.min_applied_steps) {
      check(r, CheckKind::kMinAppliedSteps, ">= " + std::to_string(*e.min_applied_steps) + " applied " + span, observed,
            r.applied_from_fault >= *e.min_applied_steps);
    } else {
      const std::int64_t half = (after + 1) / 2;
      if (!r.last_step_applied)
        observed += !r.steps.empty() && !r.steps.back().skipped ? ", the last with a gradient of norm 0"
                                                                : ", the last skipped";
      check(r, CheckKind::kMinAppliedSteps, ">= " + std::to_string(half) + " applied " + span + ", the last among them",
            observed, r.applied_from_fault >= half && r.last_step_applied);
    }
  }
  if (e.recompute_bitwise) {
    const bool bitwise = r.silent_recompute_mismatches == 0;
    check(r, CheckKind::kRecomputeBitwise, b(*e.recompute_bitwise),
          b(bitwise) + " (" + std::to_string(r.silent_recompute_mismatches) + " applied, " +
              std::to_string(r.caught_recompute_mismatches) + " caught)",
          bitwise == *e.recompute_bitwise);
  }
  if (e.replay_bitwise) {
    check(r, CheckKind::kReplayBitwise, b(*e.replay_bitwise),
          r.replayed ? b(r.replay_bitwise)
                     : "not replayed (" +
                           (r.harness_error ? std::string("the run never reached its fault") : r.replay_report) + ")",
          r.replayed && r.replay_bitwise == *e.replay_bitwise);
  }
  if (e.injections_fired) {
    const std::size_t fired = r.notes_of(StepNoteKind::kInjected).size();
    check(r, CheckKind::kInjectionsFired, b(*e.injections_fired), std::to_string(fired) + " fired",
          (fired == 0) != *e.injections_fired);
  }
  // Every injection entry must have fired on a step it was due: an injection that did nothing
  // lets a defense "hold", or a control "break", for another reason. An entry due on no step the
  // run reached never had its chance, which proves nothing either way -- except after a raise
  // that a scenario expecting to hold asked for, where the run was meant to stop.
  for (const InjectionTally& t : r.injections) {
    const InjectionSpec& in = spec.injections[t.entry];
    const std::string what = "injections[" + std::to_string(t.entry) + "] " + t.type + " fires";
    if (!t.fired.empty()) continue;
    if (in.rank >= 0 && in.rank != r.rank) continue;  // another rank's: accounted in that rank's result
    if (!t.due.empty()) {
      std::string observed = "did not fire";
      // Due only on steps skipped before it could act (an LR spike on a step whose batch was
      // invalid): say so, with the defenses' reasons.
      const std::vector<StepNote> skips = r.notes_of(StepNoteKind::kSkipped);
      std::string skipped;
      std::size_t skipped_due = 0;
      for (const std::int64_t due : t.due) {
        const auto n = std::find_if(skips.begin(), skips.end(), [&](const StepNote& s) { return s.step == due; });
        if (n == skips.end()) continue;
        ++skipped_due;
        skipped += (skipped.empty() ? "" : ", ") + std::to_string(due) + " (" + n->text + ")";
      }
      if (skipped_due == t.due.size()) {
        observed += "; every step it was due on was skipped before it could act: step " + skipped;
      } else if (in.in_segment() &&
                 std::none_of(r.segments_seen.begin(), r.segments_seen.end(),
                              [&](const std::string& s) { return segment_targeted(in.segment, s); })) {
        // A segment fault whose segment never ran: say which segments did (a typo in the name).
        std::string seen;
        for (const std::string& n : r.segments_seen) seen += (seen.empty() ? "" : ", ") + n;
        observed +=
            "; segment '" + in.segment + "' never ran (the segments that ran: " + (seen.empty() ? "none" : seen) + ")";
      }
      check(r, CheckKind::kInjectionFired, what + " (due at step " + steps_text(t.due) + ")", observed, false);
    } else if (!(r.raised && raise_expected && !e.diverges)) {
      const std::int64_t last_due = in.step + in.duration - 1;
      check(r, CheckKind::kInjectionFired,
            what + " (steps " + std::to_string(in.step) + ".." + std::to_string(last_due) + ")",
            in.step > r.last_step ? "the run stopped at step " + std::to_string(r.last_step)
                                  : "due on no step (probability " + fmt(in.probability) + ")",
            false);
    }
  }
  if (e.raises) {
    const bool matches = e.raises_match.empty() || r.error.find(e.raises_match) != std::string::npos;
    // Holding by raising is a defense's refusal; a control breaks by the fault's own raise (a crash).
    const bool whose = !*e.raises || (e.diverges ? !r.raised_by_defense : r.raised_by_defense);
    std::string observed = r.raised ? "raised: " + r.error : "did not raise";
    if (r.raised && !whose) {
      observed += e.diverges ? " -- a defense's refusal (DefenseRefusal): the defense held the fault, which a "
                               "control must break through"
                             : " -- not a defense's refusal (retrace::DefenseRefusal): the fault crashed the run";
    }
    check(r, CheckKind::kRaises, b(*e.raises) + (e.raises_match.empty() ? "" : " with '" + e.raises_match + "'"),
          observed, r.raised == *e.raises && (!r.raised || (matches && whose)));
  }
}

// State besides the parameters that is non-finite at the end, with finite parameters: what breaks.
std::string nonfinite_state_detail(const ScenarioResult& r) {
  if (r.nonfinite_state_kind == TensorKind::kOptimizerState) {
    return "optimizer state non-finite at the end (" + r.nonfinite_state +
           "): the updates of the parameters it covers are 0 or non-finite from then on";
  }
  return "a buffer non-finite at the end (" + r.nonfinite_state +
         "): what reads it -- BatchNorm's running statistics in eval mode -- computes non-finite values";
}

BreakKind nonfinite_state_break(const ScenarioResult& r) {
  return r.nonfinite_state_kind == TensorKind::kOptimizerState ? BreakKind::kNonFiniteOptimizerState
                                                               : BreakKind::kNonFiniteBuffers;
}

// What broke, and when: r.breakage, from the run and its failed checks.
void find_breakage(const ExpectSpec& e, ScenarioResult& r) {
  const bool raise_expected = e.raises.value_or(false);
  auto failed = [&](CheckKind kind) {
    return std::any_of(r.checks.begin(), r.checks.end(),
                       [&](const ExpectationCheck& c) { return c.kind == kind && !c.passed; });
  };
  auto add = [&](BreakKind kind, std::int64_t step, std::string detail, bool accepted) {
    r.breakage.push_back({kind, step, std::move(detail), accepted && step >= r.fault_step});
  };
  if (!r.params_finite) {
    add(BreakKind::kNonFiniteParams, r.nonfinite_params_since,
        "parameters non-finite from step " + std::to_string(r.nonfinite_params_since) + " on", true);
  }
  if (!r.nonfinite_state.empty() && r.params_finite)
    add(nonfinite_state_break(r), r.last_step, nonfinite_state_detail(r), true);
  if (failed(CheckKind::kLossFinite) && r.first_nonfinite_loss_step > 0) {
    add(BreakKind::kNonFiniteLoss, r.first_nonfinite_loss_step,
        "step " + std::to_string(r.first_nonfinite_loss_step) + " applied a non-finite loss", true);
  }
  if (failed(CheckKind::kFinalLossBelow)) {
    const bool any_applied = applied_in_final_window(r);
    // With no applied step in the window there is no final loss: that is the defenses refusing
    // every step of it (a validated batch skipped, a NaN on the last step skipped), not the fault
    // raising the loss; the progress rule and step_after_fault speak of it.
    add(BreakKind::kFinalLoss, r.last_step,
        (any_applied ? "final loss " + fmt(r.final_loss) + " (" + final_window(r) + ")"
                     : "no applied step in " + final_window(r) + " to take a final loss from") +
            ", expected below " + fmt(*e.final_loss_below),
        any_applied);
  }
  // Either way it is written (a control may expect `false`), a recompute that was not bitwise in
  // an applied step is breakage: the control's claim is that it breaks.
  if (e.recompute_bitwise && r.first_silent_mismatch_step > 0) {
    add(BreakKind::kSilentRecompute, r.first_silent_mismatch_step,
        "step " + std::to_string(r.first_silent_mismatch_step) +
            " applied gradients from a recompute that was not bitwise",
        true);
  }
  if (e.diverges && failed(CheckKind::kMinAppliedSteps)) {
    add(BreakKind::kNoProgress, r.last_step,
        std::to_string(r.applied_from_fault) + " of steps " + std::to_string(r.fault_step) + ".." +
            std::to_string(r.last_step) + " applied, expected at least " + std::to_string(*e.min_applied_steps),
        true);
  }
  if (r.raised && !r.harness_error) {
    // For a control the raise is evidence only when it asked for it (and it matched).
    add(BreakKind::kRaised, r.raised_at_step, "step " + std::to_string(r.raised_at_step) + " raised: " + r.error,
        e.diverges && raise_expected && !failed(CheckKind::kRaises));
  }
}

// A loss that ran away after the fault, finite: its largest applied loss from the fault's step on
// (an injection's own steps left out) more than kRanAway times the median of the applied losses
// before it, said in a line ("" where not, or no step before the fault).
inline constexpr double kRanAway = 2;
std::string loss_ran_away(const ScenarioResult& r) {
  std::vector<double> before;
  const StepPoint* peak = nullptr;
  for (const StepPoint& p : r.steps) {
    if (p.skipped || !std::isfinite(p.loss)) continue;
    if (p.step < r.fault_step) before.push_back(p.loss);
    else if (!p.injected && (!peak || p.loss > peak->loss)) peak = &p;  // a loss_spike's own step is the fault
  }
  if (before.empty() || !peak) return "";
  std::nth_element(before.begin(), before.begin() + static_cast<std::ptrdiff_t>(before.size() / 2), before.end());
  const double median = before[before.size() / 2];
  if (!(median > 0) || !(peak->loss > kRanAway * median)) return "";
  return "its loss rose from a median of " + fmt(median) + " before the fault to " + fmt(peak->loss) + " at step " +
         std::to_string(peak->step) + " and ends at " + fmt(r.final_loss);
}

}  // namespace

void decide_verdict(const ExpectSpec& e, ScenarioResult& r) {
  const bool raise_expected = e.raises.value_or(false);
  r.expected_to_break = e.diverges;
  r.reasons.clear();
  auto reason = [&](std::string why) { r.reasons.push_back(std::move(why)); };
  if (r.harness_error) reason("harness error: " + r.error);
  if (!e.diverges) {
    // What broke: a raise it did not ask for (or not the one it asked for), non-finite parameters,
    // a check of what breaks. A check that fails otherwise (an injection that never fired,
    // max_skipped_steps, replay_bitwise) fails the verdict, not the run.
    const bool wrong_raise = r.raised && !r.harness_error &&
                             std::any_of(r.checks.begin(), r.checks.end(), [](const ExpectationCheck& c) {
                               return c.kind == CheckKind::kRaises && !c.passed;
                             });
    // A harness error never got to its fault: what its checks of what breaks say (loss_finite: no
    // applied step) is no breakage, and its outcome is "not exercised".
    // A final window the defenses skipped whole has no final loss to fail: final_loss_below and
    // loss_finite fail there without breakage (red-team finding: a NaN on the last step, skipped as
    // it should be, "broke" the run; the progress rule and step_after_fault say what it is).
    const bool window_skipped = !applied_in_final_window(r);
    r.broke = !r.harness_error && ((r.raised && !raise_expected) || wrong_raise || !r.params_finite ||
                                   (!r.nonfinite_state.empty() && r.params_finite) ||
                                   std::any_of(r.checks.begin(), r.checks.end(), [&](const ExpectationCheck& c) {
                                     const bool no_final_loss =
                                         window_skipped && (c.kind == CheckKind::kFinalLossBelow ||
                                                            (c.kind == CheckKind::kLossFinite && r.all_losses_finite));
                                     return !c.passed && role_of(c.kind) == CheckRole::kBreakage && !no_final_loss;
                                   }));
    if (r.raised && !raise_expected && !r.harness_error)
      reason("raised at step " + std::to_string(r.raised_at_step) + ": " + r.error);
    if (!r.params_finite && !e.params_finite) reason("non-finite parameters at the end");
    if (!r.nonfinite_state.empty() && r.params_finite && !r.harness_error) reason(nonfinite_state_detail(r));
    for (const ExpectationCheck& c : r.checks) {
      if (!c.passed) reason(reason_of(c));
    }
  } else {
    r.broke = std::any_of(r.breakage.begin(), r.breakage.end(), [](const Breakage& x) { return x.counts; });
    if (!r.harness_error) {
      if (r.last_step < r.fault_step) {
        reason("the run stopped at step " + std::to_string(r.last_step) + ", before the fault at step " +
               std::to_string(r.fault_step));
      }
      if (r.raised && !raise_expected) {
        reason("raised at step " + std::to_string(r.raised_at_step) + ": " + r.error +
               " (a control breaks through its fault: non-finite parameters or loss, final_loss_below, "
               "recompute_bitwise, min_applied_steps, "
               "or the raise that expect.raises names)");
      }
      for (const ExpectationCheck& c : r.checks) {
        if (!c.passed && role_of(c.kind) != CheckRole::kBreakage) reason(reason_of(c));
      }
      const bool without_fault = std::any_of(r.checks.begin(), r.checks.end(), [](const ExpectationCheck& c) {
        return c.kind == CheckKind::kFaultCaused && !c.passed;
      });
      if (!r.broke && !without_fault) {
        std::string early;
        for (const Breakage& x : r.breakage) {
          if (x.step < r.fault_step && x.kind != BreakKind::kRaised)
            early += "; " + x.detail + ", before the fault at step " + std::to_string(r.fault_step);
        }
        // A loss that went non-finite is breakage only where loss_finite asks: say that it did.
        if (!e.loss_finite && r.first_nonfinite_loss_step >= r.fault_step) {
          reason("negative control held: the fault broke nothing its expectations count (its loss was non-finite "
                 "from step " +
                 std::to_string(r.first_nonfinite_loss_step) + " on: add loss_finite: true to count that)" + early);
        } else if (const std::string rose = loss_ran_away(r); !e.final_loss_below && !rose.empty()) {
          // Nor a loss that ran away, finite: breakage only where final_loss_below asks.
          reason("negative control held: the fault broke nothing its expectations count (" + rose +
                 ": add final_loss_below to count that)" + early);
        } else {
          reason("negative control held: the fault did not bite" + early);
        }
      }
    }
  }
  r.passed = r.reasons.empty();
}

namespace {

std::string temp_trace_path(const std::string& name) {
  std::string clean;
  for (char c : name) clean += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return (std::filesystem::temp_directory_path() /
          ("retrace_run_" + std::to_string(::getpid()) + "_" + clean + ".trace"))
      .string();
}

}  // namespace

const char* to_string(Outcome o) {
  switch (o) {
    case Outcome::kHeld: return "held";
    case Outcome::kBroke: return "broke";
    case Outcome::kBrokeEarly: return "broke early";
    case Outcome::kNotExercised: return "not exercised";
    case Outcome::kBrokeWithoutFault: return "broke without the fault";
  }
  return "?";
}

Outcome ScenarioResult::outcome_kind() const {
  if (broke) return Outcome::kBroke;
  if (harness_error) return Outcome::kNotExercised;  // the run never got to its fault
  if (std::any_of(breakage.begin(), breakage.end(), [](const Breakage& x) { return x.without_fault_step > 0; }))
    return Outcome::kBrokeWithoutFault;
  const bool early = expected_to_break && std::any_of(breakage.begin(), breakage.end(),
                                                      [&](const Breakage& x) { return x.step < fault_step; });
  if (early) return Outcome::kBrokeEarly;
  const bool idle = std::any_of(checks.begin(), checks.end(),
                                [&](const ExpectationCheck& c) { return says_not_exercised(c, raised); });
  return idle ? Outcome::kNotExercised : Outcome::kHeld;
}

const char* to_string(CheckKind kind) {
  switch (kind) {
    case CheckKind::kParamsFinite: return "params_finite";
    case CheckKind::kLossFinite: return "loss_finite";
    case CheckKind::kMaxSkippedSteps: return "max_skipped_steps";
    case CheckKind::kMinSkippedSteps: return "min_skipped_steps";
    case CheckKind::kMinScaleBackoffs: return "min_scale_backoffs";
    case CheckKind::kMinScaleGrowths: return "min_scale_growths";
    case CheckKind::kMinRollbacks: return "min_rollbacks";
    case CheckKind::kFinalLossBelow: return "final_loss_below";
    case CheckKind::kMinAppliedSteps: return "min_applied_steps";
    case CheckKind::kRecomputeBitwise: return "recompute_bitwise";
    case CheckKind::kReplayBitwise: return "replay_bitwise";
    case CheckKind::kInjectionsFired: return "injections_fired";
    case CheckKind::kInjectionFired: return "injection_fired";
    case CheckKind::kRaises: return "raises";
    case CheckKind::kFaultBites: return "fault_bites";
    case CheckKind::kFaultCaused: return "fault_caused";
    case CheckKind::kTrained: return "trained";
    case CheckKind::kStepAfterFault: return "step_after_fault";
  }
  return "?";
}

CheckRole role_of(CheckKind kind) {
  switch (kind) {
    case CheckKind::kParamsFinite:
    case CheckKind::kLossFinite:
    case CheckKind::kFinalLossBelow:
    case CheckKind::kRecomputeBitwise:
    case CheckKind::kMinAppliedSteps:
    case CheckKind::kTrained: return CheckRole::kBreakage;
    case CheckKind::kInjectionFired:
    case CheckKind::kInjectionsFired:
    case CheckKind::kMinSkippedSteps:
    case CheckKind::kMinScaleBackoffs:
    case CheckKind::kMinScaleGrowths:
    case CheckKind::kMinRollbacks:
    case CheckKind::kRaises:
    case CheckKind::kFaultBites:
    case CheckKind::kStepAfterFault: return CheckRole::kExercise;
    case CheckKind::kFaultCaused: return CheckRole::kCause;
    case CheckKind::kMaxSkippedSteps:
    case CheckKind::kReplayBitwise: return CheckRole::kOther;
  }
  return CheckRole::kOther;
}

const char* to_string(BreakKind kind) {
  switch (kind) {
    case BreakKind::kNonFiniteParams: return "non_finite_params";
    case BreakKind::kNonFiniteLoss: return "non_finite_loss";
    case BreakKind::kFinalLoss: return "final_loss";
    case BreakKind::kSilentRecompute: return "silent_recompute";
    case BreakKind::kNoProgress: return "no_progress";
    case BreakKind::kRaised: return "raised";
    case BreakKind::kRanksSplit: return "ranks_split";
    case BreakKind::kNonFiniteOptimizerState: return "non_finite_optimizer_state";
    case BreakKind::kNonFiniteBuffers: return "non_finite_buffers";
    case BreakKind::kSaturatedBuffers: return "saturated_buffers";
  }
  return "?";
}

const char* to_string(CounterfactualKind kind) {
  switch (kind) {
    case CounterfactualKind::kNone: return "none";
    case CounterfactualKind::kFaultFree: return "fault_free";
    case CounterfactualKind::kUndefended: return "undefended";
    case CounterfactualKind::kBare: return "bare";
  }
  return "?";
}

const char* to_string(StepNoteKind kind) {
  switch (kind) {
    case StepNoteKind::kInjected: return "injected";
    case StepNoteKind::kSkipped: return "skipped";
  }
  return "?";
}

std::vector<StepNote> ScenarioResult::notes_of(StepNoteKind kind) const {
  std::vector<StepNote> out;
  for (const StepNote& n : notes) {
    if (n.kind == kind) out.push_back(n);
  }
  return out;
}

namespace {
StepNoteKind parse_step_note_kind(const std::string& name) {
  for (StepNoteKind k : {StepNoteKind::kInjected, StepNoteKind::kSkipped}) {
    if (name == to_string(k)) return k;
  }
  throw Error("unknown step note kind '" + name + "' in a scenario result");
}

BreakKind parse_break_kind(const std::string& name) {
  for (BreakKind k :
       {BreakKind::kNonFiniteParams, BreakKind::kNonFiniteLoss, BreakKind::kFinalLoss, BreakKind::kSilentRecompute,
        BreakKind::kNoProgress, BreakKind::kRaised, BreakKind::kRanksSplit, BreakKind::kNonFiniteOptimizerState,
        BreakKind::kNonFiniteBuffers, BreakKind::kSaturatedBuffers}) {
    if (name == to_string(k)) return k;
  }
  throw Error("unknown breakage kind '" + name + "' in a scenario result");
}

constexpr CheckKind kCheckKinds[] = {
    CheckKind::kParamsFinite,     CheckKind::kLossFinite,       CheckKind::kMaxSkippedSteps,
    CheckKind::kMinSkippedSteps,  CheckKind::kMinScaleBackoffs, CheckKind::kMinScaleGrowths,
    CheckKind::kMinRollbacks,     CheckKind::kFinalLossBelow,   CheckKind::kMinAppliedSteps,
    CheckKind::kRecomputeBitwise, CheckKind::kReplayBitwise,    CheckKind::kInjectionsFired,
    CheckKind::kInjectionFired,   CheckKind::kRaises,           CheckKind::kFaultBites,
    CheckKind::kFaultCaused,      CheckKind::kTrained,          CheckKind::kStepAfterFault,
};

CounterfactualKind parse_counterfactual_kind(const std::string& name) {
  for (CounterfactualKind k : {CounterfactualKind::kNone, CounterfactualKind::kFaultFree,
                               CounterfactualKind::kUndefended, CounterfactualKind::kBare}) {
    if (name == to_string(k)) return k;
  }
  throw Error("unknown counterfactual kind '" + name + "' in a scenario result");
}

nlohmann::json scale_json(const std::map<std::string, double>& scale) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, v] : scale) j[name] = num(v);
  return j;
}

nlohmann::json breakage_json(const std::vector<Breakage>& breakage) {
  nlohmann::json out = nlohmann::json::array();
  for (const Breakage& x : breakage) {
    out.push_back({{"kind", to_string(x.kind)},
                   {"step", x.step},
                   {"detail", x.detail},
                   {"counts", x.counts},
                   {"without_fault_step", x.without_fault_step}});
  }
  return out;
}

std::vector<Breakage> breakage_from_json(const nlohmann::json& j) {
  std::vector<Breakage> out;
  for (const auto& x : j) {
    out.push_back({parse_break_kind(x.at("kind").get<std::string>()), x.at("step").get<std::int64_t>(),
                   x.at("detail").get<std::string>(), x.at("counts").get<bool>(),
                   x.at("without_fault_step").get<std::int64_t>()});
  }
  return out;
}

CheckKind parse_check_kind(const std::string& name) {
  for (CheckKind k : kCheckKinds) {
    if (name == to_string(k)) return k;
  }
  throw Error("unknown check '" + name + "' in a scenario result");
}
}  // namespace

std::string fault_label(const ScenarioSpec& spec) {
  if (spec.injections.empty()) return "none";
  std::string out;
  for (const InjectionSpec& in : spec.injections) {
    std::string one = to_string(in.type);
    if (!in.mode.empty()) one += ":" + in.mode;
    if (in.type == InjectionType::kBitFlip)
      one += ":" + in.target + "/" + (in.bit >= 0 ? "bit" + std::to_string(in.bit) : in.bit_class);
    if (in.phase != "both") one += "@" + in.phase;
    if (in.rank >= 0) one += "@rank" + std::to_string(in.rank);
    if (out.find(one) == std::string::npos) out += (out.empty() ? "" : "+") + one;
  }
  return out;
}

namespace {
// An RNG fault is injected: then preserve_rng_state is its defense, not plain configuration.
bool rng_fault(const ScenarioSpec& spec) {
  return std::any_of(spec.injections.begin(), spec.injections.end(),
                     [](const InjectionSpec& in) { return in.type == InjectionType::kRngDesync; });
}
// preserve_rng_state is this scenario's defense: against its RNG fault, or, without injections,
// where it claims bitwise recomputes (its configuration -- checkpointed dropout -- is the fault). The
// built-in models' checkpoint takes it; a registered program's checkpoints are its own (the key is
// refused there).
bool rng_preserved_against_fault(const ScenarioSpec& spec) {
  return spec.program.empty() && spec.defenses.preserve_rng_state &&
         (rng_fault(spec) || (spec.injections.empty() && spec.expect.recompute_bitwise.value_or(false)));
}
}  // namespace

std::string defense_label(const ScenarioSpec& spec) {
  const DefenseSpec& d = spec.defenses;
  std::vector<std::string> parts;
  if (d.loss_scaling.enabled) {
    std::string s = "loss_scaling";
    if (d.loss_scaling.hysteresis > 1) s += "(hysteresis " + std::to_string(d.loss_scaling.hysteresis) + ")";
    parts.push_back(s);
  }
  if (d.clip.mode != ClipMode::kOff)
    parts.push_back(std::string("clip:") + to_string(d.clip.mode) + " " + fmt(d.clip.max_norm));
  if (d.skip_nonfinite) parts.push_back("skip_nonfinite");
  if (d.skip_nonfinite_ranks) parts.push_back("skip_nonfinite_ranks");
  if (d.lr_scale != 1.0) parts.push_back("lr x" + fmt(d.lr_scale));
  if (d.warmup_steps > 0) parts.push_back("warmup " + std::to_string(d.warmup_steps));
  if (d.plateau.enabled) parts.push_back("plateau");
  if (d.layernorm_fp32) parts.push_back("fp32_layernorm");
  if (d.layernorm_min_eps > 0) parts.push_back("eps_guard " + fmt(d.layernorm_min_eps));
  if (d.rollback) parts.push_back("rollback");
  if (!d.preserve_rng_state) parts.push_back("rng_not_preserved");
  else if (rng_preserved_against_fault(spec)) parts.push_back("preserve_rng_state");
  if (d.verify_recompute) parts.push_back("verify_recompute");
  if (d.validate_batch) parts.push_back("validate_batch");
  if (parts.empty()) return "none";
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "+") + p;
  return out;
}

namespace {

// The last step in first..last that an injection is due on, on any rank (0: none): a data-parallel
// run's ranks share their parameters, so a fault on rank 1 is rank 0's fault too.
std::int64_t fault_last_step(const ScenarioSpec& spec, std::int64_t first, std::int64_t last) {
  std::vector<InjectionSpec> any_rank = spec.injections;
  for (InjectionSpec& in : any_rank) in.rank = -1;
  const Injector schedule(any_rank);
  std::int64_t latest = 0;
  for (std::size_t i = 0; i < any_rank.size(); ++i) {
    const std::vector<std::int64_t> due = schedule.due_steps(i, first, last);
    if (!due.empty()) latest = std::max(latest, due.back());
  }
  return latest;
}

// Where trained measures from: the step after the fault's last (what moved on the fault's own
// steps -- a clipped spike -- says nothing of whether training went on after it); `first` without
// injections. Past `last` when the fault lasts to the end.
std::int64_t after_the_fault(const ScenarioSpec& spec, std::int64_t first, std::int64_t last) {
  const std::int64_t latest = fault_last_step(spec, first, last);
  return latest == 0 ? first : latest + 1;
}

// The result's identity and the fault's window, before anything runs.
ScenarioResult start_result(const ScenarioSpec& spec, const RunOptions& options, std::int64_t fault_step) {
  ScenarioResult r;
  r.name = spec.name.empty() ? spec.origin : spec.name;
  r.origin = spec.origin;
  r.fault = fault_label(spec);
  r.defense = defense_label(spec);
  // The fault's step: the first injection's, within this window; the window's first step when
  // there is none (the configuration itself is the fault).
  r.fault_step = options.first_step;
  if (!spec.injections.empty()) {
    std::int64_t first = spec.injections.front().step;
    for (const InjectionSpec& in : spec.injections) first = std::min(first, in.step);
    r.fault_step = std::max(first, options.first_step);
  }
  if (fault_step > 0) r.fault_step = fault_step;  // a control's fault-free run: the control's window
  r.fault_last_step =
      fault_last_step(spec, options.first_step, options.last_step > 0 ? options.last_step : spec.training.steps);
  r.last_step = options.first_step - 1;
  r.nonfinite_params_since = options.first_step - 1;
  for (std::size_t i = 0; i < spec.injections.size(); ++i)
    r.injections.push_back({i, to_string(spec.injections[i].type), {}, {}});
  return r;
}

// One scenario's training, step by step: what each step adds to the result, and what an
// exception means (the fault's doing, or the harness's before the fault's step).
class ScenarioRun {
 public:
  ScenarioRun(ScenarioResult& r, RecomputeVerifier& verifier) : r_(r), verifier_(verifier) {}

  void set_program(std::unique_ptr<Program> program) {
    program_ = std::move(program);
    defenses_ = program_->defenses();
    r_.rank = program_->ranks().rank;
    r_.world_size = program_->ranks().world_size;
  }
  Program* program() const { return program_.get(); }
  Defenses* defenses() const { return defenses_; }
  void mark_started() { started_ = true; }
  // The parameters as the run starts: their finiteness; and how far training moves them is measured
  // from the start of step `movement_from` (the fault's: what moved before it says nothing of what
  // the defenses let through after it).
  void note_initial_params(std::int64_t first_step, std::int64_t movement_from) {
    params_were_finite_ = params_finite();
    movement_from_ = std::max(first_step, movement_from);
    r_.param_movement_from = movement_from_;
    if (movement_from_ == first_step) keep_movement_start();
  }
  bool params_nonfinite_now() const { return !params_were_finite_; }  // after the last step

  bool params_finite() const { return parameters_finite(*program_); }

  // What each injection entry was due on and did in the step that ends (or raised).
  void tally_injections(std::int64_t step) {
    if (!defenses_) return;
    for (InjectionTally& t : r_.injections) {
      if (defenses_->injector().scheduled(t.entry, step)) t.due.push_back(step);
    }
    for (const InjectionEvent& ev : defenses_->injector().fired()) {
      std::vector<std::int64_t>& fired = r_.injections.at(ev.entry).fired;
      if (fired.empty() || fired.back() != step) fired.push_back(step);
    }
  }

  void after_step(std::int64_t step, const StepOutcome& o) {
    ++r_.steps_run;
    r_.last_step = step;
    r_.losses.push_back(o.loss);
    r_.scales.push_back(o.loss_scale);
    r_.lrs.push_back(o.lr);
    r_.steps.push_back({step, o.loss, o.grad_norm, o.loss_scale, o.lr, o.loss_scale_after, o.clip_coef,
                        o.clipped_grad_norm, o.skipped, !o.injected.empty(), o.rolled_back});
    if (!o.skipped && !std::isfinite(o.loss)) {
      r_.all_losses_finite = false;
      if (r_.first_nonfinite_loss_step == 0) r_.first_nonfinite_loss_step = step;
    }
    if (!o.skipped && !o.finite()) ++r_.applied_nonfinite_steps;
    for (const std::string& i : o.injected) r_.notes.push_back({step, StepNoteKind::kInjected, i});
    // A step applied with a gradient of norm 0 -- clipping by 0 a gradient whose norm overflows, a
    // loss scale backed off until the fp16 gradients underflow -- trained nothing of its own (what
    // moves the parameters is momentum or Adam's moments carried from before): not applied.
    const bool zero_gradient = !o.skipped &&
                               (o.clipped_grad_norm == 0.0 || (std::isnan(o.clipped_grad_norm) && o.grad_norm == 0.0));
    if (o.skipped) {
      ++r_.skipped_steps;
      r_.notes.push_back({step, StepNoteKind::kSkipped, o.skip_reason});
    } else if (step >= r_.fault_step && zero_gradient) {
      ++r_.zero_gradient_steps;
    } else if (step >= r_.fault_step) {
      ++r_.applied_from_fault;
    }
    r_.last_step_applied = !o.skipped && !zero_gradient;
    tally_injections(step);
    count_recompute_mismatches(step, o.skipped);
    // When the parameters went non-finite (and stayed so): the step a control's breakage dates from.
    const bool finite = params_finite();
    if (!finite && params_were_finite_) r_.nonfinite_params_since = step;
    params_were_finite_ = finite;
    if (o.rolled_back && step >= movement_from_) {
      // A rollback after the movement's start put back a state from before this step: the jump
      // back (a fault's numbers undone, ~1.0 of the norm they had grown to) is no training. How far
      // training moves is measured from the restored state on, the counterfactual's over the same
      // steps (CounterfactualPlan::movement_from).
      movement_from_ = step + 1;
      r_.param_movement_from = movement_from_;
      keep_movement_start();
    } else if (step + 1 == movement_from_) {
      keep_movement_start();
    }
  }

  void on_exception(const std::exception& e) {
    r_.raised = true;
    r_.raised_by_defense = dynamic_cast<const DefenseRefusal*>(&e) != nullptr;
    r_.error = e.what();
    const auto nl = r_.error.find('\n');  // c10::Error appends a C++ backtrace; keep the message
    if (nl != std::string::npos) r_.error = r_.error.substr(0, nl);
    if (!started_) {  // before the first step: the harness's, not the fault's
      r_.harness_error = true;
      return;
    }
    r_.raised_at_step = r_.last_step + 1;  // the step in progress
    r_.last_step = r_.raised_at_step;
    tally_injections(r_.raised_at_step);  // what fired before it raised
    if (defenses_) {                      // ... and its notes, which the step's outcome would have carried
      for (const InjectionEvent& ev : defenses_->injector().fired())
        r_.notes.push_back({r_.raised_at_step, StepNoteKind::kInjected, ev.line()});
    }
    if (dynamic_cast<const InjectionUnsupported*>(&e) != nullptr) {
      // The scenario asks for an injection this program cannot take: its input, not the fault.
      r_.harness_error = true;
      r_.error = "step " + std::to_string(r_.raised_at_step) + ": the scenario's " + r_.error;
      return;
    }
    if (r_.raised_at_step < r_.fault_step) {
      r_.harness_error = true;
      r_.error = "step " + std::to_string(r_.raised_at_step) + " raised before the fault at step " +
                 std::to_string(r_.fault_step) + ": " + r_.error;
    }
  }

  // The program's end state and what its defenses counted.
  void finish(std::int64_t first_step) {
    if (!program_) return;
    if (defenses_) defenses_->observe(nullptr);
    r_.params_finite = params_finite();
    const std::vector<NamedTensor> state = program_->state();
    for (TensorKind kind : {TensorKind::kOptimizerState, TensorKind::kBuffer}) {
      const auto bad = std::find_if(state.begin(), state.end(), [&](const NamedTensor& n) {
        return n.kind == kind && n.tensor.is_floating_point() && !all_finite(n.tensor);
      });
      if (bad == state.end()) continue;
      r_.nonfinite_state = bad->name;
      r_.nonfinite_state_kind = kind;
      break;
    }
    if (r_.params_finite) r_.nonfinite_params_since = first_step - 1;
    else if (params_were_finite_) r_.nonfinite_params_since = r_.last_step;  // the step that raised broke them
    if (const LossScaler* s = defenses_ ? defenses_->scaler() : nullptr) {
      r_.scale_backoffs = s->backoffs();
      r_.scale_growths = s->growths();
      r_.tolerated_overflows = s->tolerated_overflows();
    }
    if (defenses_) {
      r_.rollbacks = defenses_->rollbacks();
      r_.caught_recompute_mismatches = defenses_->caught_recompute_mismatches();
    }
    if (r_.world_size > 1) {
      for (const NamedTensor& n : program_->state()) r_.state_digests.emplace_back(n.name, digest(n.tensor).hex());
    }
    r_.param_movement = param_movement();
    // Each floating tensor of the kind: the median (optimizer state) or largest (buffers) of its
    // finite elements' magnitudes.
    for (const NamedTensor& n : state) {
      const bool optimizer = n.kind == TensorKind::kOptimizerState, buffer = n.kind == TensorKind::kBuffer;
      if ((!optimizer && !buffer) || !n.tensor.is_floating_point() || n.tensor.numel() == 0) continue;
      const at::Tensor a = n.tensor.detach().abs().to(at::kDouble);
      const at::Tensor finite = a.masked_select(a.isfinite());
      if (finite.numel() == 0) continue;
      if (optimizer) r_.optimizer_state_scale[n.name] = finite.median().item<double>();
      else r_.buffer_scale[n.name] = finite.max().item<double>();
    }
  }

 private:
  // Every segment whose recompute was not bitwise; a skipped step never applied its recompute,
  // so only mismatches in applied steps are "silent".
  void count_recompute_mismatches(std::int64_t step, bool skipped) {
    const std::size_t now = verifier_.mismatches().size();
    r_.recompute_mismatches += static_cast<std::int64_t>(now - seen_mismatches_);
    if (!skipped && now > seen_mismatches_) {
      r_.silent_recompute_mismatches += static_cast<std::int64_t>(now - seen_mismatches_);
      if (r_.first_silent_mismatch_step == 0) r_.first_silent_mismatch_step = step;
    }
    verifier_.reset();
    seen_mismatches_ = verifier_.mismatches().size();
  }

  ScenarioResult& r_;
  RecomputeVerifier& verifier_;
  std::unique_ptr<Program> program_;
  Defenses* defenses_ = nullptr;  // the program's pipeline: what fired, what the defenses did
  bool started_ = false;
  bool params_were_finite_ = true;
  std::int64_t movement_from_ = 1;
  std::vector<at::Tensor> initial_params_;  // at the start of step movement_from_

  void keep_movement_start() {
    initial_params_.clear();
    for (const NamedTensor& n : program_->state()) {
      if (n.kind == TensorKind::kParameter && n.tensor.is_floating_point())
        initial_params_.push_back(n.tensor.detach().clone());
    }
  }

  // ScenarioResult::param_movement: the parameters now against initial_params_, relative to those
  // (NaN where the run never reached step movement_from_).
  double param_movement() const {
    if (initial_params_.empty()) return std::numeric_limits<double>::quiet_NaN();
    double squares = 0, start = 0;
    std::size_t i = 0;
    for (const NamedTensor& n : program_->state()) {
      if (n.kind != TensorKind::kParameter || !n.tensor.is_floating_point()) continue;
      if (i >= initial_params_.size() || !n.tensor.sizes().equals(initial_params_[i].sizes()))
        return std::numeric_limits<double>::quiet_NaN();
      const at::Tensor now = n.tensor.detach().to(at::kCPU, at::kDouble);
      const at::Tensor then = initial_params_[i].to(at::kCPU, at::kDouble);
      squares += (now - then).pow(2).sum().item<double>();
      start += then.pow(2).sum().item<double>();
      ++i;
    }
    if (i != initial_params_.size() || start <= 0) return std::numeric_limits<double>::quiet_NaN();
    return std::sqrt(squares / start);
  }
  std::size_t seen_mismatches_ = 0;
};

// The final window's first step: the last three steps of a run that ended at `last`, none before
// the fault's.
std::int64_t final_window_start(std::int64_t fault_step, std::int64_t last) { return std::max(fault_step, last - 2); }

// The final loss: the mean of the applied steps among the last three, none before the fault.
void set_final_loss(ScenarioResult& r) {
  r.final_window_first = final_window_start(r.fault_step, r.last_step);
  r.final_loss = std::numeric_limits<double>::quiet_NaN();
  double sum = 0;
  int n = 0;
  for (const StepPoint& p : r.steps) {
    if (p.step < r.final_window_first || p.skipped) continue;
    sum += p.loss;
    ++n;
  }
  if (n > 0) r.final_loss = sum / n;
}

// Replays the recorded run and says whether it reproduced every step bit for bit. A run that
// raised replays too: the replay must raise the same message at the same step.
void replay_recorded(const std::string& trace_path, ScenarioResult& r) {
  try {
    const TraceReader trace(trace_path);
    std::unique_ptr<Program> again = program_from_trace(trace, BuildFor::kReplay);
    ReplayOptions ro;
    ro.provenance = false;
    const ReplayResult rr = Replayer(trace, *again).run(ro);
    r.replayed = true;
    // Bitwise means every step: a replay that stopped early verified only a prefix.
    r.replay_bitwise = rr.reproduced && rr.to_step == r.last_step;
    if (rr.first_divergence) {
      r.replay_report = rr.first_divergence->message();
    } else if (rr.to_step != r.last_step) {
      r.replay_report =
          "the replay stopped at step " + std::to_string(rr.to_step) + " of " + std::to_string(r.last_step);
      // Where the run's own record shows the step went non-finite with no defense skipping it
      // (its loss or norm non-finite and applied, or its parameters non-finite after it), say so:
      // a replay ends at such a step, and the steps before it did reproduce.
      const auto point =
          std::find_if(r.steps.begin(), r.steps.end(), [&](const StepPoint& p) { return p.step == rr.to_step; });
      const bool went_nonfinite = point != r.steps.end() && !point->skipped &&
                                  (!std::isfinite(point->loss) || !std::isfinite(point->grad_norm) ||
                                   (!r.params_finite && r.nonfinite_params_since == rr.to_step));
      if (!rr.raised && went_nonfinite) {
        r.replay_report += ": step " + std::to_string(rr.to_step) +
                           " went non-finite and no defense skipped it, and a replay ends at such a step; steps " +
                           std::to_string(rr.from_step) + ".." + std::to_string(rr.to_step) + " reproduced bitwise, " +
                           std::to_string(rr.to_step + 1) + ".." + std::to_string(r.last_step) + " were not replayed";
      }
    }
  } catch (const std::exception& e) {
    r.replay_report = std::string("replay failed: ") + e.what();
  }
}

// The run and its checks and breakage, without the verdict. fault_step > 0: the fault's step to
// judge by (a control's fault-free run has no injection of its own to date it).
ScenarioResult run_and_check(const ScenarioSpec& spec, const RunOptions& options, std::int64_t fault_step = 0) {
  const auto t0 = std::chrono::steady_clock::now();
  std::clock_t c0 = 0;          // at the first step: cpu_seconds is the steps', not the setup's
  register_builtin_programs();  // the replay rebuilds the program from the trace by name
  ScenarioResult r = start_result(spec, options, fault_step);
  const std::int64_t last = options.last_step > 0 ? options.last_step : spec.training.steps;
  const bool replay = spec.expect.replay_bitwise.has_value() && options.replay && options.first_step == 1 &&
                      options.start_state == nullptr;
  const std::string trace_path = options.trace_path.empty() ? temp_trace_path(r.name) : options.trace_path;

  VerifyOptions vo;
  vo.policy = VerifyPolicy::kRecord;
  RecomputeVerifier verifier(vo);
  RunObserver observer(verifier);
  ScenarioRun run(r, verifier);
  try {
    run.set_program(make_scenario_program(spec));
    Program& program = *run.program();
    if (options.start_state) {
      program.load_state(*options.start_state);
      if (options.restart_schedule && run.defenses()) run.defenses()->schedule().restart();
    }
    if (options.start_rng) options.start_rng->restore();
    run.note_initial_params(options.first_step, options.movement_from > 0
                                                    ? options.movement_from
                                                    : after_the_fault(spec, options.first_step, last));
    auto after_step = [&](std::int64_t step, const StepOutcome& o) { run.after_step(step, o); };
    // After the injector: it compares what actually flowed. A program without the pipeline has
    // its segments observed directly.
    std::optional<ObserverScope> verify_scope;
    if (run.defenses()) run.defenses()->observe(&observer);
    else verify_scope.emplace(observer);
    if (replay) {
      // A rank of a data-parallel run replays alone from its collectives' recorded results, which
      // digest mode does not store.
      RecorderOptions recording;
      if (program.ranks().distributed()) recording.mode = RecordMode::kFull;
      Recorder recorder(trace_path, program, recording);
      run.mark_started();
      c0 = std::clock();
      record_run(program, recorder, spec.training.steps, /*stop_on_nonfinite=*/false, after_step);
      recorder.close();
    } else {
      run.mark_started();
      c0 = std::clock();
      for (std::int64_t s = options.first_step; s <= last; ++s) {
        after_step(s, program.step(s, program.batch(s), nullptr));
        if (options.stop_at_nonfinite_params && run.params_nonfinite_now()) break;
      }
    }
  } catch (const std::exception& e) {
    run.on_exception(e);
  }
  r.segments_seen = observer.names();
  run.finish(options.first_step);
  set_final_loss(r);
  if (replay && !r.harness_error) replay_recorded(trace_path, r);
  if (replay && options.trace_path.empty()) {
    std::error_code ec;
    std::filesystem::remove(trace_path, ec);
    std::filesystem::remove(trace_path + ".incomplete", ec);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.cpu_seconds = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  check_expectations(spec, r);
  find_breakage(spec.expect, r);
  return r;
}

ScenarioSpec without_defenses(const ScenarioSpec& spec) {
  ScenarioSpec bare = spec;
  bare.defenses = DefenseSpec{};
  bare.defenses.preserve_rng_state = spec.defenses.preserve_rng_state && !rng_preserved_against_fault(spec);
  bare.training.clip_grad_norm = 0;
  return bare;
}

// Whether the spec has a defense to take away: the pipeline's, the LayerNorm guards, the
// program's own clipping, or the preserved RNG state against an RNG fault.
bool defended(const ScenarioSpec& spec) {
  const DefenseSpec& d = spec.defenses;
  return d.any() || d.layernorm_fp32 || d.layernorm_min_eps > 0 || spec.training.clip_grad_norm > 0 ||
         rng_preserved_against_fault(spec);
}

// The expectations of what breaks, and only those: what a counterfactual run is judged by.
ExpectSpec breakage_expectations(const ExpectSpec& e) {
  ExpectSpec out;
  out.params_finite = e.params_finite;
  out.loss_finite = e.loss_finite;
  out.final_loss_below = e.final_loss_below;
  out.recompute_bitwise = e.recompute_bitwise;
  return out;
}

Counterfactual summary_of(CounterfactualKind kind, const ScenarioResult& c) {
  Counterfactual out;
  out.kind = kind;
  out.last_step = c.last_step;
  out.params_finite = c.params_finite;
  out.final_loss = c.final_loss;
  out.param_movement = c.param_movement;
  out.optimizer_state_scale = c.optimizer_state_scale;
  out.buffer_scale = c.buffer_scale;
  out.breakage = c.breakage;
  out.steps = c.steps;
  return out;
}

// The counterfactual's check, and the verdict it changes: its reason when it fails (the line
// decide_verdict would write, and last, as decide_verdict would order it); a control whose every
// breakage the fault-free run shows too did not break.
void settle_counterfactual(CheckKind kind, std::string expected, std::string observed, bool passed, ScenarioResult& r,
                           bool no_breakage_left) {
  check(r, kind, std::move(expected), std::move(observed), passed);
  if (passed) return;
  r.reasons.push_back(reason_of(r.checks.back()));
  r.passed = false;
  if (no_breakage_left) r.broke = false;
}

// `breakage` dated against a run without the fault, over the whole window: each entry that counts
// and whose kind that run shows too, at any step, counts no longer (without_fault_step says where):
// a fault that only brings forward what the configuration does within the run anyway is not shown
// to break it. Returns the first entry left counting, and the first that stopped with the entry
// like it. A control's fault-free run is judged as a control, so its raise matches only where it
// counts there.
struct Dated {
  const Breakage* kept = nullptr;
  const Breakage* anyway = nullptr;
  const Breakage* anyway_there = nullptr;
};
Dated date_against(std::vector<Breakage>& breakage, const std::vector<Breakage>& without, bool raise_must_count) {
  Dated d;
  for (Breakage& x : breakage) {
    if (!x.counts) continue;
    const auto same = std::find_if(without.begin(), without.end(), [&](const Breakage& y) {
      return y.kind == x.kind && (!raise_must_count || y.kind != BreakKind::kRaised || y.counts);
    });
    if (same == without.end()) {
      if (!d.kept) d.kept = &x;
      continue;
    }
    x.counts = false;
    x.without_fault_step = std::max<std::int64_t>(same->step, 1);  // 0 says "did not" (non-finite from the start: 0)
    if (!d.anyway) {
      d.anyway = &x;
      d.anyway_there = &*same;
    }
  }
  return d;
}

// ", N step(s) later" where the run without the fault showed the breakage later than the run with
// it (the fault brought forward what the configuration does within the run anyway); else "".
std::string later(const Breakage& with, const Breakage& without) {
  if (without.step <= with.step) return "";
  return ", " + std::to_string(without.step - with.step) + (without.step - with.step == 1 ? " step" : " steps") +
         " later";
}

// The breakage of a run compared against (`c`: without the fault), as the run with the fault
// (final loss `with_fault`) is weighed against it:
// - with `nudge`, plus its final loss where the fault moved it less than kFinalLossEdge of the
//   threshold `below`: a fault that only nudges the final loss across a threshold proves nothing
//   (an LR lowered by 0.1% for one step took the tiny GPT's final loss from 4.08486 to 4.08489,
//   across 4.08487), so the final loss without it counts as breaking too;
// - less its final-loss breakage where the fault made the final loss worse by more than that run's
//   own miss of the threshold (3.46 without the fault against a bound of 3.4, 96.5 with it): the
//   run without the fault misses the bound too, but the breakage with it is the fault's.
std::vector<Breakage> against(const ScenarioResult& c, const std::optional<double>& below, double with_fault,
                              bool nudge) {
  std::vector<Breakage> out = c.breakage;
  const auto final_loss =
      std::find_if(out.begin(), out.end(), [](const Breakage& x) { return x.kind == BreakKind::kFinalLoss; });
  if (!below || !std::isfinite(c.final_loss)) return out;
  const double least = kFinalLossEdge * std::abs(*below);
  if (final_loss != out.end()) {
    const double own_miss = std::max(c.final_loss - *below, least);
    if (!std::isfinite(with_fault) || with_fault - c.final_loss > own_miss) out.erase(final_loss);
    return out;
  }
  if (!nudge || !std::isfinite(with_fault) || std::abs(with_fault - c.final_loss) >= least) return out;
  out.push_back({BreakKind::kFinalLoss, c.last_step,
                 "final loss " + fmt(c.final_loss) + " (" + final_window(c) + "), less than " + fmt(least) + " (" +
                     fmt(kFinalLossEdge) + " of the threshold " + fmt(*below) +
                     ") from the run with the fault: the fault only nudged it across",
                 true});
  return out;
}

// A negative control's breakage against the same run without its injections: breakage of a kind
// that run shows too, anywhere in the window, is the configuration's, and does not count.
void weigh_fault_free(const ExpectSpec& e, const CounterfactualPlan& plan, const ScenarioResult& c, ScenarioResult& r) {
  r.counterfactual = summary_of(CounterfactualKind::kFaultFree, c);
  r.counterfactual.broke = !c.harness_error && !c.breakage.empty();
  const std::string expected = "the run without its injections does not break so within the run";
  if (c.harness_error) {  // it never got to show anything: the breakage's cause is not known
    settle_counterfactual(CheckKind::kFaultCaused, expected, "could not tell: " + c.error, false, r, false);
    return;
  }
  // The nudge rule is a control's: a run that expected to hold and whose final loss the fault
  // nudged across did not break without it.
  const std::vector<Breakage> without = against(c, e.final_loss_below, r.final_loss, /*nudge=*/e.diverges);
  const auto [kept, anyway, anyway_there] = date_against(r.breakage, without, /*raise_must_count=*/true);
  const std::string ran = "steps " + std::to_string(plan.first_step) + ".." + std::to_string(c.last_step);
  std::string observed;
  // The run without the fault missed the final-loss bound too, by less than the fault made it worse.
  const auto final_loss = [](const std::vector<Breakage>& b) {
    return std::any_of(b.begin(), b.end(), [](const Breakage& x) { return x.kind == BreakKind::kFinalLoss; });
  };
  const bool made_worse = final_loss(c.breakage) && !final_loss(without);
  if (kept) {
    observed = anyway ? "it broke too, but not so: " + anyway->detail + " without the fault as well" +
                            later(*anyway, *anyway_there) + "; " + kept->detail + " only with it"
               : made_worse ? "it broke too, but not so: final loss " + fmt(c.final_loss) + " (" + final_window(c) +
                                  ") without the fault, " + fmt(r.final_loss) +
                                  " with it: the fault made it worse by more than the run without it misses " +
                                  fmt(*e.final_loss_below) + " by (" + fmt(c.final_loss - *e.final_loss_below) + "); " +
                                  kept->detail + " only with it"
                            : "it did not break (" + ran + ")";
  } else if (anyway) {
    const std::string sooner = later(*anyway, *anyway_there);
    observed = "it broke too" + sooner + ": " + anyway_there->detail + " (with the fault: " + anyway->detail +
               (sooner.empty() ? "); the configuration breaks it, not the fault"
                               : "); the configuration breaks it within the run, the fault only brought that forward");
  } else {
    observed = "nothing of the run's counted to weigh";  // planned only for a run whose breakage counts
  }
  // A run that expected to hold broke without the fault too only where nothing else broke it: a
  // raise it did not ask for, or a defense that stopped training (the progress rule), stays its own.
  const bool nothing_else = e.diverges ||
                            (!r.raised && std::none_of(r.checks.begin(), r.checks.end(), [](const auto& x) {
                              return x.kind == CheckKind::kMinAppliedSteps && !x.passed;
                            }));
  settle_counterfactual(CheckKind::kFaultCaused, expected, observed, kept != nullptr, r,
                        anyway != nullptr && nothing_else);
}

// A run that held, against the run with neither the fault nor the defenses (`c0`; for a scenario
// without injections, the undefended run): it held only if training went on after the fault. From
// the step after the fault's last (after_the_fault), its parameters must move at least kTrainedFraction as far as in
// that run -- an LR scaled to nothing, clipping at 1e-30, a warmup of 1e8 steps, a plateau cut to
// 1e-12 or a loss scale backed off until the gradients underflow "hold" by freezing the model --
// or, where that run runs away (non-finite, or moving more than kRunsAway of their norm), at least
// kMovedAtAll of their own norm; and at least kMovedAtAllInFloat32 of it in any case (a
// configuration that does not train, an LR of 0, shows nothing held either).
// The optimizer-state tensor that grew most against the same tensor of a run with neither the
// fault nor the defenses that trains and stays finite (its state is the scale: an fp16 run whose
// gradients all underflow leaves its state at 0, and any other "saturated"); "" where none grew
// kSaturatedState times or more.
// The same for a buffer (kind buffer in state(): BatchNorm's running statistics), by its largest
// finite magnitude (ScenarioResult::buffer_scale): finite, the non_finite_buffers rule does not see
// it, and the training-mode forward normalizes by the batch's own statistics -- the loss does not
// show it either.
struct Saturation {
  std::string name;
  double scale = 0, scale0 = 0;  // scale0: what it is weighed against
  bool buffer = false;
  double run0 = 0;  // the same tensor's in the run with neither (scale0, or less for a buffer)
  explicit operator bool() const { return !name.empty(); }
  std::string text() const {
    return std::string(buffer ? "its buffer '" : "its optimizer's state '") + name + "' ends with a " +
           (buffer ? "largest" : "median") + " magnitude of " + fmt(scale) + ", " + fmt(scale / scale0) + " times " +
           (run0 < scale0
                ? "1, the floor for a buffer (the run's with neither the fault nor the defenses: " + fmt(run0) + ")"
                : "the run's with neither the fault nor the defenses (" + fmt(scale0) + ")");
  }
  // What follows from it, after text().
  std::string consequence() const {
    return buffer ? "the fault's numbers stay in the model's buffers, and what reads them computes with them "
                    "(BatchNorm's running statistics: the eval-mode forward normalizes by them)"
                  : "the fault's numbers stay in it and scale the updates down while it keeps them";
  }
  BreakKind kind() const { return buffer ? BreakKind::kSaturatedBuffers : BreakKind::kNoProgress; }
};

Saturation saturation(const std::map<std::string, double>& scale, const std::map<std::string, double>& scale0,
                      const ScenarioResult& c0, bool buffer) {
  Saturation worst;
  if (!c0.params_finite || !std::isfinite(c0.param_movement) || c0.param_movement < kMovedAtAllInFloat32) return worst;
  const double bar = buffer ? kSaturatedBuffer : kSaturatedState;
  for (const auto& [name, s] : scale) {
    const auto it = scale0.find(name);
    if (it == scale0.end() || !(it->second > 0) || !std::isfinite(s)) continue;
    // A buffer is weighed against at least kBufferScaleFloor: running statistics start at 0 and 1,
    // and one a weight decay shrank toward 0 in that run makes no scale (red-team finding: 0.12
    // called 6e26 times a running mean of 2e-28).
    const double against = buffer ? std::max(it->second, kBufferScaleFloor) : it->second;
    if (s > bar * against && (worst.name.empty() || s / against > worst.scale / worst.scale0))
      worst = {name, s, against, buffer, it->second};
  }
  return worst;
}
// The optimizer's state first, then the buffers.
template <class Run>
Saturation saturation(const Run& r, const ScenarioResult& c0) {
  if (Saturation s = saturation(r.optimizer_state_scale, c0.optimizer_state_scale, c0, false)) return s;
  return saturation(r.buffer_scale, c0.buffer_scale, c0, true);
}

// How far a run's loss fell: the mean of its applied, finite losses on the steps `head` less that
// on the steps `tail` (NaN where either has none).
struct LossFall {
  double start = std::numeric_limits<double>::quiet_NaN(), end = start;
  double fall() const { return start - end; }
};
LossFall loss_fall(const std::vector<StepPoint>& steps, const std::set<std::int64_t>& head,
                   const std::set<std::int64_t>& tail) {
  const auto mean = [&](const std::set<std::int64_t>& at) {
    double sum = 0;
    int n = 0;
    for (const StepPoint& p : steps) {
      if (!at.count(p.step) || p.skipped || !std::isfinite(p.loss)) continue;
      sum += p.loss;
      ++n;
    }
    return n > 0 ? sum / n : std::numeric_limits<double>::quiet_NaN();
  };
  return {mean(head), mean(tail)};
}

// trained's loss bar (kLossFallFraction): `with_fault`'s steps against those of the same
// configuration without the fault, from the step after the fault's first (after the last rollback
// where r's movement is measured from one) to `last`, the steps an injection fired on left out of
// both (a second, later fault does not move the window past the stall the first one left: a NaN
// gradient skipped at step 55 of 60 did; a fault that lasts 24 steps leaves the steps after it);
// "" where it holds or does not apply (fewer than kLossFallSteps steps, that run did not learn
// clearly). A run that falls less than kLossFallFraction as far stalled only where it also ends
// above that fraction of the other run's way down: one that got ahead (an LR spike that trains
// faster) has less left to fall.
struct LossWindow {
  std::int64_t first = 0;           // the step after the fault's first, or after the last rollback
  std::vector<std::int64_t> steps;  // first..last, the steps no injection fired on
  bool left_out = false;            // some step an injection fired on was left out
  bool weighable() const { return steps.size() >= static_cast<std::size_t>(kLossFallSteps); }
};
LossWindow loss_window(const ScenarioResult& r, const std::vector<StepPoint>& with_fault, std::int64_t last) {
  LossWindow w;
  w.first = measured_after_rollback(r) ? r.param_movement_from : r.fault_step + 1;
  for (const StepPoint& p : with_fault) {
    if (p.step < w.first || p.step > last) continue;
    if (p.injected) w.left_out = true;
    else w.steps.push_back(p.step);
  }
  return w;
}

// The two runs' losses over the window (loss_window), means of a fifth of its steps at each end.
struct LossComparison {
  LossWindow window;
  std::size_t k = 0;  // steps averaged at each end
  LossFall with, without;
  // The level the run without the fault started from: the mean of its first k applied, finite
  // losses (NaN where it has fewer).
  double start_level = std::numeric_limits<double>::quiet_NaN();
  // The window has kLossFallSteps steps, and the run without the fault fell (finite means) at least
  // kLearnedFraction of its level over the window -- or, having learned before it (it converged
  // before the fault), from its start_level to the window's end: only then is there a bar.
  bool reference_learned = false;
  bool level_only = false;  // stalled by the level reached, not by the window's fall
  // With it: fell less than kLossFallFraction as far over the window (not where its means are not
  // finite: the finiteness rules speak), ending above the quarter way; or (level_only, where that
  // run learned from its start) ended above the quarter way from start_level down to that run's end.
  bool stalled = false;
  double quarter_way = std::numeric_limits<double>::quiet_NaN();
  // Not stalled, but ending more than kLossFallFraction of that run's way down (over the window, or
  // from its start_level where it learned before the window) above where that run ends: with
  // defenses, the run with them and without the fault decides whether the fault or the defenses
  // hold it back (a clip at 1e-6 beside a weight decay that shrinks the model to chance, "held").
  bool behind = false;
  double behind_bar = std::numeric_limits<double>::quiet_NaN();
};
LossComparison compare_loss(const ScenarioResult& r, const std::vector<StepPoint>& with_fault,
                            const std::vector<StepPoint>& without_fault, std::int64_t last) {
  LossComparison c;
  c.window = loss_window(r, with_fault, last);
  if (!c.window.weighable()) return c;
  const std::vector<std::int64_t>& steps = c.window.steps;
  c.k = steps.size() / 5;
  const std::set<std::int64_t> head(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(c.k)),
      tail(steps.end() - static_cast<std::ptrdiff_t>(c.k), steps.end());
  c.with = loss_fall(with_fault, head, tail);
  c.without = loss_fall(without_fault, head, tail);
  double sum = 0;
  std::size_t n = 0;
  for (const StepPoint& p : without_fault) {
    if (n == c.k) break;
    if (p.skipped || !std::isfinite(p.loss)) continue;
    sum += p.loss;
    ++n;
  }
  if (n == c.k && n > 0) c.start_level = sum / static_cast<double>(n);
  const bool learned_in_window = std::isfinite(c.without.fall()) &&
                                 c.without.fall() >= kLearnedFraction * std::abs(c.without.start);
  // A run without the fault that converged before the window learns nothing more in it; the run
  // with it must still get down there (red-team finding: a defense that kept the loss at chance,
  // ln 4, from step 1 on, "trained" beside a run that had reached 0.47 by step 30).
  const bool learned_before = std::isfinite(c.start_level) && std::isfinite(c.without.end) &&
                              c.start_level - c.without.end >= kLearnedFraction * std::abs(c.start_level);
  c.reference_learned = learned_in_window || learned_before;
  // Behind: measured wherever that run came down at all, from the window's start where it learned
  // in it, else from its start level (a clip at 1e-6 beside a weight decay: the run drifts to
  // chance, 4.16 = ln 64, the run with neither reaches 3.88 from 4.18, 7% of its level).
  if (const double from = learned_in_window ? c.without.start : c.start_level;
      std::isfinite(c.with.end) && std::isfinite(c.without.end) && std::isfinite(from) && from > c.without.end) {
    c.behind_bar = c.without.end + kLossFallFraction * (from - c.without.end);
    c.behind = c.with.end > c.behind_bar;
  }
  if (!c.reference_learned || !std::isfinite(c.with.fall())) return c;
  if (learned_in_window) {
    c.quarter_way = c.without.start - kLossFallFraction * c.without.fall();
    c.stalled = c.with.fall() / c.without.fall() < kLossFallFraction && c.with.end > c.quarter_way;
  }
  // The level reached, where the run is not learning in the window itself (its loss falls less than
  // kLearnedFraction of its level there): a run at chance whose noise falls as far as the run
  // without the fault does near its floor has not trained (red-team finding). One still coming
  // down from its fault (an LR spike clipped, 7.7 -> 5.0 over ten steps) is training.
  if (!c.stalled && learned_before && c.with.fall() < kLearnedFraction * std::abs(c.with.start)) {
    const double quarter_way = c.start_level - kLossFallFraction * (c.start_level - c.without.end);
    if (c.with.end > quarter_way) {
      c.stalled = c.level_only = true;
      c.quarter_way = quarter_way;
    }
  }
  if (c.stalled) c.behind = false;
  return c;
}

// "its loss ends at 4.16 (means of 5 steps), where without the fault it ends at 3.88: above 4.02, ...":
// a comparison that is behind (LossComparison::behind), said in a line.
std::string behind_text(const LossComparison& c, std::int64_t last) {
  return "over steps " + std::to_string(c.window.first) + ".." + std::to_string(last) + " its loss ends at " +
         fmt(c.with.end) + " (means of " + std::to_string(c.k) + " steps" +
         (c.window.left_out ? ", injected steps left out" : "") + "), where without the fault it ends at " +
         fmt(c.without.end) + ": above " + fmt(c.behind_bar) + " (that end plus " + fmt(kLossFallFraction) +
         " of that run's way down to it)";
}

// trained's runaway bar (kLossRanAway): "" where `steps`' final window (max(fault_step, last - 2)
// .. last: its applied, finite steps no injection fired on) ends at most kLossRanAway times the
// untrained model's loss -- the first step of `ref` (`whose`) -- or at most kLossRanAway times
// where `ref` ends over the same steps (the same batches: a noisy first batch, L0 0.006 beside a run
// ending at 0.6, made any loss above 0.012 "ran away"); or where either is missing; else the
// finding in a line. `ref` without the fault: one that ran away too, past the bar and within
// kLossRanAway of this run or to no finite loss, is the configuration running away (SGD at LR 20
// diverges without its clip). `ref_is_the_fault` (a scenario whose configuration is the fault:
// `ref` is the run without the defenses) takes only its untrained loss.
std::string ran_away_from_untrained(const std::vector<StepPoint>& steps, std::int64_t fault_step, std::int64_t last,
                                    const std::vector<StepPoint>& ref, const std::string& whose,
                                    bool ref_is_the_fault = false) {
  if (ref.empty() || ref.front().skipped || !std::isfinite(ref.front().loss) || ref.front().loss == 0) return "";
  const double untrained = ref.front().loss;
  const std::int64_t from = final_window_start(fault_step, last);
  const auto above = [](double x, double level) { return x - level > (kLossRanAway - 1) * std::abs(level); };
  // The mean over the window of `of`'s applied, finite steps no injection fired on, and how many.
  const auto window_mean = [&](const std::vector<StepPoint>& of) -> std::pair<double, int> {
    double sum = 0;
    int n = 0;
    for (const StepPoint& p : of) {
      if (p.step < from || p.step > last || p.skipped || p.injected || !std::isfinite(p.loss)) continue;
      sum += p.loss;
      ++n;
    }
    return {n > 0 ? sum / n : std::numeric_limits<double>::quiet_NaN(), n};
  };
  const auto [end, n] = window_mean(steps);
  if (n == 0 || !above(end, untrained)) return "";
  std::string against;
  if (!ref_is_the_fault) {
    const double ref_end = window_mean(ref).first;
    if (!std::isfinite(ref_end) || !above(end, ref_end)) return "";
    against = " and " + fmt(kLossRanAway) + " times where that run ends over the same steps, " + fmt(ref_end);
  }
  return "its loss ends at " + fmt(end) + " (steps " + std::to_string(from) + ".." + std::to_string(last) +
         (n < last - from + 1 ? ", " + std::to_string(n) + " of them applied and not injected" : std::string()) +
         "), above " + fmt(kLossRanAway) + " times the untrained model's " + fmt(untrained) + " (step " +
         std::to_string(ref.front().step) + " of " + whose + ")" + against + ": the fault's damage stands";
}

// "rose 0.1 (4.1 -> 4.2)": how a run's loss went over the window.
std::string went(const LossFall& f) {
  return (f.fall() >= 0 ? "fell " + fmt(f.fall()) : "rose " + fmt(-f.fall())) + " (" + fmt(f.start) + " -> " +
         fmt(f.end) + ")";
}

// A comparison's stall said in a line, over steps up to `last`; "" where it did not stall.
std::string stall_text(const LossComparison& c, std::int64_t last) {
  if (!c.stalled) return "";
  if (c.level_only) {
    return "over steps " + std::to_string(c.window.first) + ".." + std::to_string(last) + " its loss ends at " +
           fmt(c.with.end) + " (means of " + std::to_string(c.k) + " steps" +
           (c.window.left_out ? ", injected steps left out" : "") + "), where without the fault it ends at " +
           fmt(c.without.end) + ", having come down from " + fmt(c.start_level) + " over its first " +
           std::to_string(c.k) + " steps: above " + fmt(c.quarter_way) + ", less than " + fmt(kLossFallFraction) +
           " of that way down";
  }
  const LossFall& with = c.with;
  const LossFall& without = c.without;
  const double ratio = with.fall() / without.fall();
  const std::string moved = with.fall() >= 0 ? "fell " + fmt(with.fall()) : "rose " + fmt(-with.fall());
  return "over steps " + std::to_string(c.window.first) + ".." + std::to_string(last) + " its loss " + moved + " (" +
         fmt(with.start) + " -> " + fmt(with.end) + ", means of " + std::to_string(c.k) + " steps at each end" +
         (c.window.left_out ? ", injected steps left out" : "") + "), " +
         (with.fall() >= 0 ? fmt(ratio) + " as far as" : "where it fell " + fmt(without.fall())) +
         " without the fault (" + fmt(without.start) + " -> " + fmt(without.end) + "), and ends above " +
         fmt(c.quarter_way) + ", where that run was " + fmt(kLossFallFraction) + " of its way down";
}

std::string stalled(const ScenarioResult& r, const std::vector<StepPoint>& with_fault,
                    const std::vector<StepPoint>& without_fault, std::int64_t last) {
  return stall_text(compare_loss(r, with_fault, without_fault, last), last);
}

// r against c over the steps both ran.
std::string stalled(const ScenarioResult& r, const ScenarioResult& c) {
  return stalled(r, r.steps, c.steps, std::min(r.last_step, c.last_step));
}

// trained failed: the run broke, training did not go on (`why`).
void training_stopped(ScenarioResult& r, const ExpectationCheck& trained, const std::string& why) {
  r.reasons.push_back(reason_of(trained));
  r.passed = false;
  r.broke = true;
  r.breakage.push_back({BreakKind::kNoProgress, r.last_step, "training did not go on: " + why, true});
}

// How trained weighs the loss (stalled) against c0.
enum class LossBar {
  kNone,               // not at all: c0 is the undefended run of a scenario whose configuration is the fault
  kSameConfiguration,  // c0 is the scenario's own configuration without the fault (a scenario without
                       // defenses): any slowing is the fault's
  kDefended,           // c0 has neither the fault nor the defenses, and a defense may slow training by
                       // design: where the loss stalls against c0, the run with the defenses and without
                       // the fault decides (weigh_defended_loss)
};

// Returns whether trained passed so far and its loss bar needs the run with the defenses and
// without the fault (LossBar::kDefended).
bool weigh_training(const ScenarioResult& c0, ScenarioResult& r, LossBar bar) {
  // Not weighed for a run that held by raising, as it expected (it stops there by design), for one
  // that applied no step from the fault's on (its defenses skipped them all, or applied gradients of
  // norm 0: the progress rule, min_applied_steps, speaks of that), nor where the fault lasts to the
  // end (no step after it to show training going on).
  if (r.raised || r.applied_from_fault == 0 || r.param_movement_from > r.last_step) return false;
  // After a rollback from the fault's last step on, measured from the restored state (ScenarioRun).
  const std::string window =
      (measured_after_rollback(r)
           ? "after the fault and the rollback on step " + std::to_string(r.param_movement_from - 1)
           : std::string("after the fault")) +
      " (steps " + std::to_string(r.param_movement_from) + ".." + std::to_string(r.last_step) + ")";
  const double m = r.param_movement, m0 = c0.param_movement;
  const bool runs_away = !c0.params_finite || !std::isfinite(m0) || m0 > kRunsAway;
  const double ratio = m / m0;
  const bool moved = std::isfinite(m) && m >= kMovedAtAllInFloat32 &&
                     (runs_away ? m >= kMovedAtAll : ratio >= kTrainedFraction);
  // Where both runs report optimizer state and that run's stayed finite: the fault's numbers must
  // not stay in it -- whether or not that run moves more than its norm (a model initialised small
  // does, training as it should).
  const Saturation saturated_state = saturation(r, c0);
  const bool same_configuration = bar == LossBar::kSameConfiguration;
  const std::string stall = same_configuration ? stalled(r, c0) : "";
  const std::string ran_away = ran_away_from_untrained(
      r.steps, r.fault_step, r.last_step, c0.steps,
      bar == LossBar::kNone ? "the run without the defenses" : "the run with neither the fault nor the defenses",
      bar == LossBar::kNone);
  const bool trained = moved && !saturated_state && stall.empty() && ran_away.empty();
  // Where the window is too short for the loss bar, the evidence says so: the check then rests on
  // the movement, the optimizer state and the buffers alone.
  const LossWindow loss_steps = loss_window(r, r.steps, std::min(r.last_step, c0.last_step));
  const std::string unweighed =
      bar == LossBar::kNone || loss_steps.weighable()
          ? std::string()
          : "; its loss not weighed: " + std::to_string(loss_steps.steps.size()) + " step(s) after the fault" +
                (loss_steps.left_out ? " without an injection" : "") + ", where the loss bar needs " +
                std::to_string(kLossFallSteps) + " (run more steps after it to have the loss weighed)";
  check(
      r, CheckKind::kTrained,
      window + ", the parameters move at least " + fmt(kTrainedFraction) +
          " as far as in the run with neither the fault nor the defenses (where that run runs away, " +
          fmt(kMovedAtAll) + " of their norm), and at least " + fmt(kMovedAtAllInFloat32) +
          " of their norm; and the optimizer's state (its median magnitude) ends below " + fmt(kSaturatedState) +
          " times that run's, and the buffers (their largest) below " + fmt(kSaturatedBuffer) +
          " times that run's or " + fmt(kSaturatedBuffer * kBufferScaleFloor) +
          (same_configuration ? "; and where that run's loss falls clearly, this one's falls at least " +
                                    fmt(kLossFallFraction) + " as far"
                              : std::string()) +
          "; and its loss ends at most " + fmt(kLossRanAway) + " times that run's on its first step" +
          (bar == LossBar::kNone ? std::string() : ", or at most " + fmt(kLossRanAway) + " times where that run ends"),
      "they moved " + fmt(m) + ", that run's " +
          (c0.params_finite ? fmt(m0) + (runs_away ? " (it runs away)" : " (" + fmt(ratio) + " as far)")
                            : std::string("non-finite (it runs away)")) +
          (saturated_state ? "; " + saturated_state.text() : std::string()) +
          (stall.empty() ? std::string() : "; " + stall) + (ran_away.empty() ? std::string() : "; " + ran_away) +
          unweighed,
      trained);
  if (trained && bar == LossBar::kDefended) {
    // Its loss against the run with neither: where it stalled, the run with the defenses and
    // without the fault decides (weigh_defended_loss); the numbers stay in the check's evidence.
    const std::int64_t last = std::min(r.last_step, c0.last_step);
    const LossComparison cmp = compare_loss(r, r.steps, c0.steps, last);
    if (!cmp.stalled && !cmp.behind) return false;
    r.checks.back().observed += "; against that run " + (cmp.stalled ? stall_text(cmp, last) : behind_text(cmp, last));
    return true;
  }
  if (trained) return false;
  std::string why =
      "the parameters moved " + fmt(m) + " of their norm from step " + std::to_string(r.param_movement_from) + " on";
  if (moved && !saturated_state) {
    why = (ran_away.empty() ? "its loss stalled: " + stall : "its loss ran away: " + ran_away) +
          " (the parameters moved " + fmt(m) + " of their norm, " + fmt(ratio) + " as far: moving is not training)";
  } else if (moved && saturated_state.buffer) {
    r.reasons.push_back(reason_of(r.checks.back()));
    r.passed = false;
    r.broke = true;
    r.breakage.push_back(
        {saturated_state.kind(), r.last_step, saturated_state.text() + ": " + saturated_state.consequence(), true});
    return false;
  } else if (moved) {
    why = saturated_state.text() + ": " + saturated_state.consequence() + " (the parameters moved " + fmt(m) +
          " of their norm from step " + std::to_string(r.param_movement_from) + " on, " + fmt(ratio) +
          " as far: moving is not training)";
  } else if (!runs_away && m0 < kMovedAtAllInFloat32) {
    why += ", and " + fmt(m0) + " without the fault and the defenses: the configuration does not train";
  } else if (!runs_away) {
    why += ", " + fmt(ratio) + " as far as without the fault and the defenses";
  }
  training_stopped(r, r.checks.back(), why);
  return false;
}

// trained's loss bar for a scenario with defenses whose loss stalled against the run with neither
// the fault nor the defenses: against `c`, the run with its defenses and without the fault, where
// only the fault differs (a clip at 1e6 lets an Adam spike's second moment through, and the loss
// stalls; a warmup slows both runs alike).
void weigh_defended_loss(const ScenarioResult& c, ScenarioResult& r) {
  auto it = std::find_if(r.checks.rbegin(), r.checks.rend(),
                         [](const ExpectationCheck& x) { return x.kind == CheckKind::kTrained; });
  if (it == r.checks.rend()) return;
  ExpectationCheck& trained = *it;
  trained.expected += "; and where the run with its defenses and without the fault learns clearly, its loss falls at "
                      "least " +
                      fmt(kLossFallFraction) + " as far";
  if (c.harness_error) {
    trained.passed = false;
    trained.observed += "; could not tell its loss: the run without the fault: " + c.error;
    r.reasons.push_back(reason_of(trained));
    r.passed = false;
    return;
  }
  const std::int64_t last = std::min(r.last_step, c.last_step);
  const LossComparison cmp = compare_loss(r, r.steps, c.steps, last);
  if (cmp.stalled) {
    const std::string stall = stall_text(cmp, last);
    trained.passed = false;
    trained.observed += "; " + stall + " (with its defenses)";
    training_stopped(r, trained, "its loss stalled: " + stall + " (with its defenses)");
    return;
  }
  if (cmp.window.weighable() && std::isfinite(cmp.without.fall()) && !cmp.reference_learned) {
    // The defenses all but stop training without the fault too (a clip at 1e-6 with weight decay
    // shrinking the weights, an LR x 0.1 over 60 steps): against that run the fault changes
    // nothing, and that shows nothing held -- nor that anything broke. The verdict is not earned.
    trained.passed = false;
    trained.observed += "; could not tell: with its defenses and without the fault its loss " + went(cmp.without) +
                        " over steps " + std::to_string(cmp.window.first) + ".." + std::to_string(last) +
                        (std::isfinite(cmp.start_level)
                             ? " (from " + fmt(cmp.start_level) + " over its first " + std::to_string(cmp.k) + " steps)"
                             : std::string()) +
                        ", less than " + fmt(kLearnedFraction) +
                        " of its level, where the run with neither the fault nor the defenses learns: the defenses "
                        "alone (all but) stop training, and that the fault changes nothing beside them shows "
                        "nothing held; test the defense where it lets the model learn";
    r.reasons.push_back(reason_of(trained));
    r.passed = false;
    return;
  }
  trained.observed += "; its loss fell at least " + fmt(kLossFallFraction) +
                      " as far as the run's with its defenses and without the fault";
}

// Whether the undefended run `c` may have run away by trained's runaway bar: above twice r's first
// step where that came before the fault (the same untrained model and batch), else (a fault on the
// first step) wherever its final loss is finite; the run with neither then says whether it did.
bool may_have_run_away(const ScenarioResult& c, const ScenarioResult& r) {
  if (r.steps.empty() || r.steps.front().step >= r.fault_step) return std::isfinite(c.final_loss);
  return !ran_away_from_untrained(c.steps, r.fault_step, c.last_step, r.steps, "", /*ref_is_the_fault=*/true).empty();
}

// fault_bites' expectation, as the undefended and the bare run state it.
std::string bites_expected(const ScenarioSpec& spec) {
  return "the run without its defenses (" + defense_label(spec) + ") breaks, and not without the fault";
}

std::string held_too(const ScenarioSpec& spec, std::int64_t first, std::int64_t last, double final_loss) {
  std::string observed = "held too (steps " + std::to_string(first) + ".." + std::to_string(last) +
                         ", parameters finite, final loss " + fmt(final_loss) + ")";
  if (!spec.expect.final_loss_below && !spec.expect.loss_finite)
    observed += "; expect.final_loss_below or loss_finite would say what breaking means here";
  return observed;
}

// A run that held, against the same run without its defenses: a fault that does not break that
// run either gave the defenses nothing to hold. When it breaks, the run with neither the fault nor
// the defenses (kBare) comes next: breakage that run shows within the window is the configuration's.
CounterfactualPlan weigh_undefended(const ScenarioSpec& spec, const CounterfactualPlan& plan, const ScenarioResult& c,
                                    ScenarioResult& r) {
  r.counterfactual = summary_of(CounterfactualKind::kUndefended, c);
  const std::string expected = bites_expected(spec);
  // The configuration is the fault (no injections) and the run without the defenses broke by
  // `detail`: the fault bites, and trained weighs the run against this one.
  const auto configuration_broke = [&](const std::string& detail) {
    r.counterfactual.broke = true;
    settle_counterfactual(CheckKind::kFaultBites, expected, "broke: " + detail, true, r, false);
    weigh_training(c, r, LossBar::kNone);
    return CounterfactualPlan{};
  };
  std::string observed;
  if (c.harness_error) {
    observed = "could not tell: " + c.error;
  } else if (r.raised && c.raised && c.raised_at_step == r.raised_at_step && c.error == r.error) {
    // The run held by raising as it expected, and raises the same without its defenses.
    observed = "raised the same: step " + std::to_string(c.raised_at_step) + " raised: " + c.error +
               "; the defenses did not make the raise";
  } else if (c.breakage.empty() && !spec.injections.empty() &&
             (!c.optimizer_state_scale.empty() || !c.buffer_scale.empty() ||
              loss_window(r, c.steps, c.last_step).weighable() || may_have_run_away(c, r))) {
    // It held, by every rule of its own: whether the fault left its optimizer's state or its
    // buffers saturated (training frozen, eval-mode statistics blown, the numbers finite) or its
    // loss stalled or ran away, the run with neither says.
    CounterfactualPlan next = plan;
    next.kind = CounterfactualKind::kBare;
    return next;
  } else if (const std::string away =
                 c.breakage.empty() && spec.injections.empty()
                     ? ran_away_from_untrained(c.steps, r.fault_step, c.last_step, c.steps, "itself", true)
                     : std::string();
             !away.empty()) {
    // The configuration is the fault, and the run without the defenses held by its own rules but
    // ran away (red-team finding: Adam at LR 1 from 4.43 to 61, "held too", not exercised): it broke.
    r.counterfactual.breakage.push_back(
        {BreakKind::kNoProgress, c.last_step, "training did not go on: its loss ran away: " + away, true});
    return configuration_broke(r.counterfactual.breakage.back().detail);
  } else if (c.breakage.empty()) {
    observed = held_too(spec, plan.first_step, c.last_step, c.final_loss);
  } else if (std::none_of(c.breakage.begin(), c.breakage.end(),
                          [&](const Breakage& x) { return x.step >= r.fault_step; })) {
    // It broke, but before the fault fired: what broke it is the defenses' absence, not the fault
    // (without preserve_rng_state every recompute with dropout differs from step 1 on).
    observed = "broke only before the fault at step " + std::to_string(r.fault_step) + ": " +
               c.breakage.front().detail +
               "; the defenses hold the configuration, and this fault's own bite is not shown";
  } else if (spec.injections.empty()) {  // the configuration is the fault: the bare run is this one
    return configuration_broke(c.breakage.front().detail);
  } else {
    CounterfactualPlan next = plan;  // the whole window: breakage later than the fault's counts too
    next.kind = CounterfactualKind::kBare;
    return next;
  }
  settle_counterfactual(CheckKind::kFaultBites, expected, observed, false, r, false);
  return {};
}

// The undefended run's breakage against the run with neither the fault nor the defenses: breakage
// of a kind that run shows too, at or before the same step, is the configuration's (the defenses
// hold it, but not against this fault). The undefended run broke by the fault when some is left.
// Returns the run trained's loss bar needs next (weigh_defended_loss), if any.
CounterfactualPlan weigh_bare(const ScenarioSpec& spec, const CounterfactualPlan& plan, const ScenarioResult& c0,
                              ScenarioResult& r) {
  Counterfactual& cf = r.counterfactual;
  const std::string expected = bites_expected(spec);
  // Any of the undefended run's, a raise too -- but none from before the fault fired.
  for (Breakage& x : cf.breakage) x.counts = x.step >= r.fault_step;
  // An optimizer's state the fault left saturated, against the run with neither (trained's bar):
  // a run that trains no more, though its numbers stay finite.
  // Or whose loss the fault stalled (trained's loss bar: the undefended run is c0's configuration
  // with the fault).
  if (cf.params_finite &&
      std::none_of(cf.breakage.begin(), cf.breakage.end(), [](const Breakage& x) { return x.counts; })) {
    if (const Saturation s = saturation(cf, c0)) {
      cf.breakage.push_back({s.kind(), cf.last_step,
                             (s.buffer ? "" : "training did not go on: ") + s.text() + ": " + s.consequence(), true});
    } else if (const std::string stall = stalled(r, cf.steps, c0.steps, std::min(cf.last_step, c0.last_step));
               !stall.empty()) {
      cf.breakage.push_back(
          {BreakKind::kNoProgress, cf.last_step, "training did not go on: its loss stalled: " + stall, true});
    } else if (const std::string away = ran_away_from_untrained(cf.steps, r.fault_step, cf.last_step, c0.steps,
                                                                "the run with neither the fault nor the defenses");
               !away.empty()) {
      cf.breakage.push_back(
          {BreakKind::kNoProgress, cf.last_step, "training did not go on: its loss ran away: " + away, true});
    }
  }
  if (cf.breakage.empty()) {  // it held (weigh_undefended asked for the saturation and loss rules alone)
    settle_counterfactual(CheckKind::kFaultBites, expected,
                          held_too(spec, plan.first_step, cf.last_step, cf.final_loss), false, r, false);
    return {};
  }
  const std::vector<Breakage> without = against(c0, spec.expect.final_loss_below, cf.final_loss, /*nudge=*/true);
  const auto [kept, anyway, anyway_there] = date_against(cf.breakage, without, /*raise_must_count=*/false);
  cf.broke = kept != nullptr;
  std::string observed;
  if (c0.harness_error) {
    cf.broke = false;
    observed = "could not tell: the run with neither the fault nor the defenses: " + c0.error;
  } else if (kept) {
    observed = "broke: " + kept->detail;
    if (anyway) observed += " (" + anyway_there->detail + " without the fault as well)";
  } else {
    observed = "broke, but so does it without the fault" + later(*anyway, *anyway_there) + ": " + anyway_there->detail +
               " (with the fault: " + anyway->detail +
               "); the defenses hold the configuration, and this fault's own bite is not shown";
  }
  settle_counterfactual(CheckKind::kFaultBites, expected, observed, cf.broke, r, false);
  if (cf.broke && weigh_training(c0, r, LossBar::kDefended)) {
    CounterfactualPlan next = plan;
    next.kind = CounterfactualKind::kFaultFree;
    next.loss_only = true;
    return next;
  }
  return {};
}

// A scenario without defenses that held its fault (the model itself holds), against the run
// without the fault: training must have gone on after it.
void weigh_undefended_model(const ScenarioResult& c, ScenarioResult& r) {
  r.counterfactual = summary_of(CounterfactualKind::kBare, c);
  r.counterfactual.broke = !c.harness_error && !c.breakage.empty();
  if (c.harness_error) {
    settle_counterfactual(CheckKind::kTrained, "training goes on after the fault as without it",
                          "could not tell: the run without the fault: " + c.error, false, r, false);
    return;
  }
  weigh_training(c, r, LossBar::kSameConfiguration);
}

}  // namespace

std::optional<std::string> saturated_state(const ScenarioResult& r, const ScenarioResult& without) {
  const Saturation s = saturation(r, without);
  if (!s) return std::nullopt;
  return s.text();
}

CounterfactualPlan plan_counterfactual(const ScenarioSpec& spec, const RunOptions& options, ScenarioResult& r) {
  CounterfactualPlan plan;
  plan.first_step = options.first_step;
  plan.fault_step = r.fault_step;
  plan.movement_from = r.param_movement_from;
  const bool control = spec.expect.diverges;
  // Without injections the configuration is the fault: a control has none to take away; a held
  // run's defenses can still be taken away.
  if (!options.counterfactual || r.harness_error || (control && spec.injections.empty())) return plan;
  // A run that expected to hold and broke: the run without its injections (its defenses kept) says
  // whether the fault got through or the configuration breaks so anyway -- a final_loss_below out of
  // reach without the fault too is no defense failing.
  if (!control && r.broke && !spec.injections.empty() &&
      std::any_of(r.breakage.begin(), r.breakage.end(), [](const Breakage& x) { return x.counts; })) {
    plan.kind = CounterfactualKind::kFaultFree;
    plan.last_step = options.last_step;
    return plan;
  }
  if (control ? !r.broke : r.outcome_kind() != Outcome::kHeld) return plan;
  if (!control && !defended(spec)) {
    // The scenario claims the model itself holds: no defenses to take away, but the run without
    // the fault shows whether training went on after it (a loss x 1e30 leaves AdamW's second
    // moments infinite, and every later update 0).
    if (spec.injections.empty()) {
      r.counterfactual.why_not = "no defenses to take away and no fault: the scenario claims the model itself holds";
      return plan;
    }
    plan.kind = CounterfactualKind::kBare;
    plan.last_step = options.last_step;
    return plan;
  }
  plan.kind = control ? CounterfactualKind::kFaultFree : CounterfactualKind::kUndefended;
  plan.last_step = options.last_step;  // the whole window: breakage the configuration shows later counts too
  return plan;
}

ScenarioSpec counterfactual_spec(const ScenarioSpec& spec, CounterfactualKind kind) {
  if (kind == CounterfactualKind::kUndefended || kind == CounterfactualKind::kBare) {
    ScenarioSpec bare = without_defenses(spec);
    bare.expect = breakage_expectations(spec.expect);
    // Neither the fault nor the defenses: against an RNG fault, without the forward's RNG state
    // too, so a recompute that differs without it is the configuration's, not the fault's.
    if (kind == CounterfactualKind::kBare) bare.injections.clear();
    return bare;
  }
  ScenarioSpec clean = spec;
  if (kind != CounterfactualKind::kFaultFree) return clean;
  clean.injections.clear();
  clean.expect = breakage_expectations(spec.expect);
  clean.expect.diverges = true;
  clean.expect.min_applied_steps = spec.expect.min_applied_steps;
  clean.expect.raises = spec.expect.raises;
  clean.expect.raises_match = spec.expect.raises_match;
  return clean;
}

ScenarioResult run_counterfactual(const ScenarioSpec& spec, const CounterfactualPlan& plan, const RunOptions& options) {
  if (plan.kind == CounterfactualKind::kNone) throw Error("run_counterfactual: the plan asks for no run");
  RunOptions o = options;
  o.trace_path.clear();
  o.replay = false;
  o.counterfactual = false;
  o.first_step = plan.first_step;
  o.last_step = plan.last_step;
  // The run's: the movements compared cover the same steps (from after the fault's last, or after
  // the run's last rollback).
  o.movement_from = plan.movement_from > 0 ? plan.movement_from
                                           : after_the_fault(spec, plan.first_step,
                                                             plan.last_step > 0 ? plan.last_step : spec.training.steps);
  // Undefended, it has shown what it was run for once the parameters are non-finite -- unless the
  // scenario held by raising: then whether it raises the same, later, is what it was run for (a
  // raise no defense made). Not for the ranks of a data-parallel run: one rank stopping alone would
  // leave the others waiting in the next all-reduce.
  o.stop_at_nonfinite_params = plan.kind == CounterfactualKind::kUndefended && spec.world_size <= 1 &&
                               !spec.expect.raises.value_or(false);
  const ScenarioSpec variant = counterfactual_spec(spec, plan.kind);
  return run_and_check(variant, o, plan.kind == CounterfactualKind::kFaultFree ? plan.fault_step : 0);
}

CounterfactualPlan weigh_counterfactual(const ScenarioSpec& spec, const CounterfactualPlan& plan,
                                        const ScenarioResult& c, ScenarioResult& r) {
  switch (plan.kind) {
    case CounterfactualKind::kFaultFree:
      if (plan.loss_only) weigh_defended_loss(c, r);
      else weigh_fault_free(spec.expect, plan, c, r);
      break;
    case CounterfactualKind::kUndefended: return weigh_undefended(spec, plan, c, r);
    case CounterfactualKind::kBare:
      if (defended(spec)) return weigh_bare(spec, plan, c, r);
      weigh_undefended_model(c, r);
      break;
    case CounterfactualKind::kNone: break;
  }
  return {};
}

ScenarioResult run_scenario(const ScenarioSpec& spec, const RunOptions& options) {
  ScenarioResult r = run_and_check(spec, options);
  decide_verdict(spec.expect, r);
  const CounterfactualPlan plan = plan_counterfactual(spec, options, r);
  if (plan.kind == CounterfactualKind::kNone) return r;
  if (r.world_size > 1) {  // this process is one rank: the ranks' launcher runs it, all ranks again
    r.counterfactual.why_not = "data parallel: run by the ranks' launcher (retrace run), not by a rank";
    return r;
  }
  for (CounterfactualPlan next = plan; next.kind != CounterfactualKind::kNone;)
    next = weigh_counterfactual(spec, next, run_counterfactual(spec, next, options), r);
  return r;
}

ScenarioResult bench_scenario(const ScenarioSpec& spec, int repeats) {
  ScenarioResult r = run_scenario(spec);
  ScenarioSpec clean = spec;
  clean.injections.clear();
  clean.expect = ExpectSpec{};
  ScenarioSpec bare = clean;
  bare.defenses = DefenseSpec{};
  bare.training.clip_grad_norm = 0;
  auto per_step = [](const ScenarioResult& x) {
    return x.steps_run > 0 ? x.seconds / static_cast<double>(x.steps_run) : 0.0;
  };
  // Alternating the two configurations, so that warm-up and drift land on both alike.
  std::vector<double> with_t, without_t;
  ScenarioResult fault_free;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    ScenarioResult x = run_scenario(clean);
    with_t.push_back(per_step(x));
    if (i == 0) fault_free = x;
    without_t.push_back(per_step(run_scenario(bare)));
  }
  std::sort(with_t.begin(), with_t.end());
  std::sort(without_t.begin(), without_t.end());
  const double with_defenses = with_t[with_t.size() / 2];
  const double without = without_t[without_t.size() / 2];
  r.bench.measured = true;
  r.bench.fault_free_final_loss = fault_free.final_loss;
  r.bench.final_loss_delta = r.final_loss - fault_free.final_loss;
  r.bench.overhead = without > 0 ? with_defenses / without : 0;
  std::int64_t first = -1;
  for (const InjectionSpec& in : spec.injections) first = first < 0 ? in.step : std::min(first, in.step);
  r.bench.injected = first > 0;
  if (first > 0) {
    // Disturbed: a skipped step, a non-finite loss, or one more than 10% off the fault-free run's.
    auto disturbed = [&](std::size_t i) {
      const double a = r.steps[i].loss, b = fault_free.steps[i].loss;
      return r.steps[i].skipped || !std::isfinite(a) || std::abs(a - b) > 0.1 * std::abs(b);
    };
    const std::size_t n = std::min(r.steps.size(), fault_free.steps.size());
    std::size_t hit = n;
    for (std::size_t i = static_cast<std::size_t>(first - 1); i < n && hit == n; ++i) {
      if (disturbed(i)) hit = i;
    }
    r.bench.steps_to_recover = hit == n && !r.raised ? 0 : -1;
    for (std::size_t i = hit + 1; i < n; ++i) {
      if (!disturbed(i)) {
        r.bench.steps_to_recover = static_cast<std::int64_t>(i - hit);
        break;
      }
    }
  }
  return r;
}

nlohmann::json ScenarioResult::to_json() const {
  nlohmann::json j;
  j["name"] = name;
  j["origin"] = origin;
  j["fault"] = fault;
  j["defense"] = defense;
  j["outcome"] = outcome();
  j["expected"] = expected_to_break ? "broke" : "held";
  j["passed"] = passed;
  j["raised"] = raised;
  j["harness_error"] = harness_error;
  j["rank"] = rank;
  j["world_size"] = world_size;
  if (!state_digests.empty()) {
    nlohmann::json d = nlohmann::json::array();
    for (const auto& [name, hex] : state_digests) d.push_back({{"name", name}, {"digest", hex}});
    j["state_digests"] = d;
  }
  j["error"] = error;
  j["steps_run"] = steps_run;
  j["skipped_steps"] = skipped_steps;
  j["applied_nonfinite_steps"] = applied_nonfinite_steps;
  j["scale_backoffs"] = scale_backoffs;
  j["scale_growths"] = scale_growths;
  j["tolerated_overflows"] = tolerated_overflows;
  j["rollbacks"] = rollbacks;
  j["recompute_mismatches"] = recompute_mismatches;
  j["silent_recompute_mismatches"] = silent_recompute_mismatches;
  j["caught_recompute_mismatches"] = caught_recompute_mismatches;
  j["params_finite"] = params_finite;
  j["nonfinite_state"] = nonfinite_state;
  j["nonfinite_state_kind"] = to_string(nonfinite_state_kind);
  j["all_losses_finite"] = all_losses_finite;
  j["final_loss"] = num(final_loss);
  j["param_movement"] = num(param_movement);
  j["param_movement_from"] = param_movement_from;
  j["fault_last_step"] = fault_last_step;
  j["optimizer_state_scale"] = scale_json(optimizer_state_scale);
  j["buffer_scale"] = scale_json(buffer_scale);
  for (double v : losses) j["losses"].push_back(num(v));
  for (double v : scales) j["scales"].push_back(num(v));
  for (double v : lrs) j["lrs"].push_back(num(v));
  for (const StepPoint& p : steps) {
    j["steps"].push_back({{"step", p.step},
                          {"loss", num(p.loss)},
                          {"grad_norm", num(p.grad_norm)},
                          {"loss_scale", num(p.loss_scale)},
                          {"lr", num(p.lr)},
                          {"loss_scale_after", num(p.loss_scale_after)},
                          {"clip_coef", num(p.clip_coef)},
                          {"clipped_grad_norm", num(p.clipped_grad_norm)},
                          {"skipped", p.skipped},
                          {"injected", p.injected},
                          {"rolled_back", p.rolled_back}});
  }
  j["notes"] = nlohmann::json::array();
  for (const StepNote& n : notes)
    j["notes"].push_back({{"step", n.step}, {"kind", to_string(n.kind)}, {"text", n.text}});
  // The same notes as lines, for readers of --json (from_json reads "notes").
  j["injected"] = nlohmann::json::array();
  for (const StepNote& n : notes_of(StepNoteKind::kInjected)) j["injected"].push_back(n.line());
  j["skip_reasons"] = nlohmann::json::array();
  for (const StepNote& n : notes_of(StepNoteKind::kSkipped)) j["skip_reasons"].push_back(n.line());
  j["replayed"] = replayed;
  j["replay_bitwise"] = replay_bitwise;
  j["replay_report"] = replay_report;
  j["seconds"] = seconds;
  j["cpu_seconds"] = cpu_seconds;
  if (bench.measured) {
    j["bench"] = {{"injected", bench.injected},
                  {"fault_free_final_loss", num(bench.fault_free_final_loss)},
                  {"final_loss_delta", num(bench.final_loss_delta)},
                  {"steps_to_recover", bench.steps_to_recover},
                  {"overhead", bench.overhead}};
  }
  j["fault_step"] = fault_step;
  j["last_step"] = last_step;
  j["raised_at_step"] = raised_at_step;
  j["raised_by_defense"] = raised_by_defense;
  j["applied_from_fault"] = applied_from_fault;
  j["zero_gradient_steps"] = zero_gradient_steps;
  j["last_step_applied"] = last_step_applied;
  j["final_window_first"] = final_window_first;
  j["nonfinite_params_since"] = nonfinite_params_since;
  j["first_nonfinite_loss_step"] = first_nonfinite_loss_step;
  j["first_silent_mismatch_step"] = first_silent_mismatch_step;
  j["injections"] = nlohmann::json::array();
  for (const InjectionTally& t : injections) {
    j["injections"].push_back({{"entry", t.entry}, {"type", t.type}, {"due", t.due}, {"fired", t.fired}});
  }
  j["segments_seen"] = segments_seen;
  j["breakage"] = breakage_json(breakage);
  j["counterfactual"] = {{"kind", to_string(counterfactual.kind)},
                         {"why_not", counterfactual.why_not},
                         {"last_step", counterfactual.last_step},
                         {"broke", counterfactual.broke},
                         {"params_finite", counterfactual.params_finite},
                         {"final_loss", num(counterfactual.final_loss)},
                         {"param_movement", num(counterfactual.param_movement)},
                         {"optimizer_state_scale", scale_json(counterfactual.optimizer_state_scale)},
                         {"buffer_scale", scale_json(counterfactual.buffer_scale)},
                         {"breakage", breakage_json(counterfactual.breakage)}};
  j["reasons"] = reasons;
  j["checks"] = nlohmann::json::array();
  for (const ExpectationCheck& c : checks) {
    j["checks"].push_back(
        {{"name", c.name()}, {"expected", c.expected}, {"observed", c.observed}, {"passed", c.passed}});
  }
  return j;
}

ScenarioResult ScenarioResult::from_json(const nlohmann::json& j) {
  ScenarioResult r;
  r.name = j.at("name");
  r.origin = j.at("origin");
  r.fault = j.at("fault");
  r.defense = j.at("defense");
  r.expected_to_break = j.at("expected") == "broke";
  r.broke = j.at("outcome") == "broke";
  r.passed = j.at("passed");
  r.raised = j.at("raised");
  r.harness_error = j.value("harness_error", false);
  r.rank = j.value("rank", 0);
  r.world_size = j.value("world_size", 1);
  if (j.contains("state_digests")) {
    for (const auto& d : j.at("state_digests"))
      r.state_digests.emplace_back(d.at("name").get<std::string>(), d.at("digest").get<std::string>());
  }
  r.error = j.at("error");
  r.steps_run = j.at("steps_run");
  r.skipped_steps = j.at("skipped_steps");
  r.applied_nonfinite_steps = j.value("applied_nonfinite_steps", std::int64_t{0});
  r.scale_backoffs = j.at("scale_backoffs");
  r.scale_growths = j.at("scale_growths");
  r.tolerated_overflows = j.at("tolerated_overflows");
  r.rollbacks = j.at("rollbacks");
  r.recompute_mismatches = j.at("recompute_mismatches");
  r.silent_recompute_mismatches = j.at("silent_recompute_mismatches");
  r.caught_recompute_mismatches = j.at("caught_recompute_mismatches");
  r.params_finite = j.at("params_finite");
  r.nonfinite_state = j.at("nonfinite_state");
  r.nonfinite_state_kind = tensor_kind_from_string(j.at("nonfinite_state_kind"));
  r.all_losses_finite = j.at("all_losses_finite");
  r.final_loss = from_num(j.at("final_loss"));
  r.param_movement = from_num(j.at("param_movement"));
  r.param_movement_from = j.at("param_movement_from");
  r.fault_last_step = j.at("fault_last_step");
  for (const auto& [name, s] : j.at("optimizer_state_scale").items()) r.optimizer_state_scale[name] = from_num(s);
  if (j.contains("buffer_scale"))
    for (const auto& [name, s] : j["buffer_scale"].items()) r.buffer_scale[name] = from_num(s);
  if (j.contains("losses"))
    for (const auto& v : j["losses"]) r.losses.push_back(from_num(v));
  if (j.contains("scales"))
    for (const auto& v : j["scales"]) r.scales.push_back(from_num(v));
  if (j.contains("lrs"))
    for (const auto& v : j["lrs"]) r.lrs.push_back(from_num(v));
  if (j.contains("steps")) {
    for (const auto& p : j["steps"]) {
      r.steps.push_back({p.at("step").get<std::int64_t>(), from_num(p.at("loss")), from_num(p.at("grad_norm")),
                         from_num(p.at("loss_scale")), from_num(p.at("lr")), from_num(p.at("loss_scale_after")),
                         from_num(p.at("clip_coef")), from_num(p.at("clipped_grad_norm")), p.at("skipped").get<bool>(),
                         p.at("injected").get<bool>(), p.at("rolled_back").get<bool>()});
    }
  }
  for (const auto& n : j.at("notes")) {  // written by this build's child processes: never absent
    r.notes.push_back({n.at("step").get<std::int64_t>(), parse_step_note_kind(n.at("kind").get<std::string>()),
                       n.at("text").get<std::string>()});
  }
  r.replayed = j.at("replayed");
  r.replay_bitwise = j.at("replay_bitwise");
  r.replay_report = j.at("replay_report");
  r.seconds = j.at("seconds");
  r.cpu_seconds = j.at("cpu_seconds");
  if (j.contains("bench")) {
    const auto& b = j["bench"];
    r.bench.measured = true;
    r.bench.injected = b.value("injected", true);
    r.bench.fault_free_final_loss = from_num(b.at("fault_free_final_loss"));
    r.bench.final_loss_delta = from_num(b.at("final_loss_delta"));
    r.bench.steps_to_recover = b.at("steps_to_recover");
    r.bench.overhead = b.at("overhead");
  }
  r.fault_step = j.at("fault_step");
  r.last_step = j.at("last_step");
  r.raised_at_step = j.at("raised_at_step");
  r.raised_by_defense = j.at("raised_by_defense");
  r.applied_from_fault = j.at("applied_from_fault");
  r.zero_gradient_steps = j.at("zero_gradient_steps");
  r.last_step_applied = j.at("last_step_applied");
  r.final_window_first = j.at("final_window_first");
  r.nonfinite_params_since = j.at("nonfinite_params_since");
  r.first_nonfinite_loss_step = j.at("first_nonfinite_loss_step");
  r.first_silent_mismatch_step = j.at("first_silent_mismatch_step");
  for (const auto& t : j.at("injections")) {
    r.injections.push_back({t.at("entry").get<std::size_t>(), t.at("type").get<std::string>(),
                            t.at("due").get<std::vector<std::int64_t>>(),
                            t.at("fired").get<std::vector<std::int64_t>>()});
  }
  r.segments_seen = j.at("segments_seen").get<std::vector<std::string>>();
  r.breakage = breakage_from_json(j.at("breakage"));
  const auto& cf = j.at("counterfactual");
  r.counterfactual.kind = parse_counterfactual_kind(cf.at("kind").get<std::string>());
  r.counterfactual.why_not = cf.at("why_not");
  r.counterfactual.last_step = cf.at("last_step");
  r.counterfactual.broke = cf.at("broke");
  r.counterfactual.params_finite = cf.at("params_finite");
  r.counterfactual.final_loss = from_num(cf.at("final_loss"));
  r.counterfactual.param_movement = from_num(cf.at("param_movement"));
  for (const auto& [name, s] : cf.at("optimizer_state_scale").items())
    r.counterfactual.optimizer_state_scale[name] = from_num(s);
  if (cf.contains("buffer_scale"))
    for (const auto& [name, s] : cf["buffer_scale"].items()) r.counterfactual.buffer_scale[name] = from_num(s);
  r.counterfactual.breakage = breakage_from_json(cf.at("breakage"));
  r.reasons = j.at("reasons").get<std::vector<std::string>>();
  for (const auto& c : j.at("checks")) {
    r.checks.push_back(
        {parse_check_kind(c.at("name").get<std::string>()), c.at("expected"), c.at("observed"), c.at("passed")});
  }
  return r;
}

ScenarioSpec load_scenario(const std::string& path_or_builtin) {
  const std::string prefix = "builtin:";
  if (path_or_builtin.rfind(prefix, 0) == 0) {
    const std::string name = path_or_builtin.substr(prefix.size());
    for (const BuiltinScenario& b : builtin_suite()) {
      if (b.name == name) return parse_scenario_text(b.text, "builtin:" + name);
    }
    std::string known;
    for (const BuiltinScenario& b : builtin_suite()) known += (known.empty() ? "" : ", ") + b.name;
    throw Error("no built-in scenario '" + name + "'; built-in scenarios: " + known);
  }
  return parse_scenario_file(path_or_builtin);
}

const Breakage* ScenarioResult::evidence() const {
  for (const Breakage& x : breakage) {
    if (x.counts) return &x;
  }
  return nullptr;
}

std::string ScenarioResult::verdict() const {
  if (passed) {
    const Breakage* x = expected_to_break ? evidence() : nullptr;
    return x ? "ok (broke: " + x->detail + ")" : "ok";
  }
  std::string v = "FAILED";
  for (const std::string& why : reasons) v += " (" + why + ")";
  return v;
}

}  // namespace retrace
