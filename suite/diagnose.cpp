#include <retrace/diagnose.h>

#include <retrace/digest.h>
#include <retrace/error.h>
#include <retrace/injectors.h>
#include <retrace/number.h>
#include <retrace/replayer.h>
#include <retrace/records.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>

namespace retrace {

namespace {

struct Window {
  std::int64_t start = 1;
  std::vector<NamedTensor> state;
  RngState rng;
  // What a variant's loss that ran away is measured against: the run's finite applied losses before
  // the window, whose median is the level it trained at (one step's loss is noisy -- a batch of 1
  // drew 0.22 at step 1 of a run that trains at 0.46 -- and the last ones may have climbed already);
  // empty where the window starts at step 1 (then the variant's own first kReferenceSteps).
  std::vector<double> before;
  // The run with neither the scenario's injections nor its defenses over the same steps, from the
  // same state: what a variant's optimizer state is measured against (saturated_state).
  std::optional<ScenarioResult> neither;
  void reference(std::int64_t step, double loss) {
    if (step < start && std::isfinite(loss)) before.push_back(loss);
  }
};

constexpr std::size_t kReferenceSteps = 3;

// The upper median: of an even count the larger middle one (the reference errs high: a run-away
// loss is called so only when it clearly is).
double upper_median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}


std::string fmt(double v, int precision = 4) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// What went non-finite in a step: the first of loss, gradient norm, parameters (after it).
std::string nonfinite_kind(double loss, double norm) {
  return !std::isfinite(loss) ? "loss" : !std::isfinite(norm) ? "gradient norm" : "parameters";
}

// Whether a step failed, as diagnose finds failing steps and classifies them: the kind
// (nonfinite_kind) of a non-finite loss or gradient norm no defense skipped (a skipped one was
// handled), "parameters" when its update left them non-finite; nullopt when it did not fail.
std::optional<std::string> step_failure(const StepOutcome& o, const std::vector<NamedTensor>& state_after) {
  if (!o.finite() && !o.skipped) return nonfinite_kind(o.loss, o.grad_norm);
  if (!parameters_finite(state_after)) return "parameters";
  return std::nullopt;
}

std::string failure_text(std::int64_t step, const std::string& kind) {
  return "step " + std::to_string(step) + ": non-finite " + kind + (kind == "parameters" ? " after its update" : "");
}

// Sets LibTorch's intra-op threads for the diagnosis (timings comparable across variants and
// runs), and puts the old count back.
class ThreadsGuard {
 public:
  explicit ThreadsGuard(int threads) : old_(at::get_num_threads()) {
    if (threads > 0) at::set_num_threads(threads);
  }
  ~ThreadsGuard() { at::set_num_threads(old_); }
  ThreadsGuard(const ThreadsGuard&) = delete;
  ThreadsGuard& operator=(const ThreadsGuard&) = delete;

 private:
  int old_;
};

// A variant whose final loss ends more than this many times above the run's level (Window::before)
// has not fixed the blow-up: its loss runs away without going non-finite.
constexpr double kLossRunsAway = 2.0;

// What still fails in a run, or "" when it held. The scenario's expectations about the outcome
// count; those about a defense's mechanics (skips, backoffs, rollbacks, replay) do not, since a
// variant may avoid the failure by other means.
std::string judge(const ScenarioResult& r, const ExpectSpec& e, const Window& w) {
  if (r.raised) return "raised: " + r.error;
  if (!r.params_finite) return "non-finite parameters";
  if (r.applied_nonfinite_steps > 0) return std::to_string(r.applied_nonfinite_steps) + " non-finite step(s) applied";
  // Training must go on, as "held" demands of a scenario: a variant that skips or rolls back
  // (nearly) every step after the fault avoids the non-finite numbers by not training. (A window
  // that ends at the fault's step shows no step after it to judge by: DiagnoseOptions::steps chose that.)
  const std::int64_t after = r.last_step - r.fault_step + 1;
  if (after > 1 && !(r.applied_from_fault >= (after + 1) / 2 && r.last_step_applied)) {
    return "training stopped: " + std::to_string(r.applied_from_fault) + " of steps " + std::to_string(r.fault_step) +
           ".." + std::to_string(r.last_step) + " applied" + (r.last_step_applied ? "" : ", the last skipped");
  }
  if (r.silent_recompute_mismatches > 0) {
    return std::to_string(r.silent_recompute_mismatches) + " non-bitwise recompute(s) reached applied gradients";
  }
  if (e.final_loss_below && !(std::isfinite(r.final_loss) && r.final_loss < *e.final_loss_below)) {
    return "final loss " + fmt(r.final_loss) + ", expected below " + fmt(*e.final_loss_below);
  }
  // A loss that ends far above the run's level avoided the non-finite numbers, not the blow-up
  // (outsider findings: clipping at 1.0 of SGD at LR 40, loss 2.4 -> 110-173, ranked first; from a
  // window that starts after the loss has climbed, 1.5e12 at the end was "held").
  if (w.neither) {
    if (const std::optional<std::string> s = saturated_state(r, *w.neither)) return "training did not go on: " + *s;
  }
  std::vector<double> own;
  std::string whose = "the median of the run's losses before step " + std::to_string(w.start) + ", ";
  if (w.before.empty()) {
    whose = "the median of its own first " + std::to_string(kReferenceSteps) + " losses, ";
    for (const StepPoint& p : r.steps) {
      if (!p.skipped && std::isfinite(p.loss) && own.size() < kReferenceSteps) own.push_back(p.loss);
    }
  }
  const double level = upper_median(w.before.empty() ? own : w.before);
  if (level > 0 && std::isfinite(r.final_loss) && r.final_loss > kLossRunsAway * level) {
    return "the loss ran away: " + fmt(r.final_loss) + " at the end (steps " + std::to_string(r.final_window_first) +
           ".." + std::to_string(r.last_step) + "), more than " + fmt(kLossRunsAway) + " times " + whose + fmt(level);
  }
  return "";
}

// An injected fault that lives in a checkpointed segment's outputs cannot fire once checkpointing
// is off; "checkpointing off" then avoids the injection, not the failure mode. (An RNG desync
// needs a recompute to exist at all, so without checkpointing it is truly gone.)
// Whether an injection of the scenario lands in a checkpointed segment's forward (an activation
// overflow, bad LayerNorm input or activation bit flip in its forward): without checkpointing it
// cannot fire, though the fault it stands for -- a forward that overflows -- would happen all the
// same. An RNG desync or a fault in the recompute alone is checkpointing's own: off, it is gone.
bool hits_segments(const ScenarioSpec& s) {
  for (const InjectionSpec& in : s.injections) {
    if (in.in_segment() && in.type != InjectionType::kRngDesync && in.phase != "recompute") return true;
  }
  return false;
}

struct Variant {
  std::string name, change;
  ScenarioSpec spec;
  bool restart_schedule = false;
  std::string caveat;
};

// The variants of a scenario; those that cannot apply to it go to `not_applicable` with why.
std::vector<Variant> make_variants(const ScenarioSpec& base, std::vector<std::string>& not_applicable) {
  std::vector<Variant> out;
  const bool program = !base.program.empty();
  auto cannot = [&](const std::string& name, const std::string& setting) {
    not_applicable.push_back(name + ": program '" + base.program + "' sets its " + setting +
                             " in its own config; try it there (the scenario's config:)");
  };
  auto add = [&](std::string name, std::string change, auto edit, bool restart = false, std::string caveat = "") {
    Variant v{std::move(name), std::move(change), base, restart, std::move(caveat)};
    edit(v.spec);
    out.push_back(std::move(v));
  };
  const TrainingSpec& t = base.training;
  const DefenseSpec& d = base.defenses;
  if (program) cannot("checkpointing off, more/fewer segments", "checkpointing");
  if (t.segments > 0 && !program && hits_segments(base)) {
    // It would "fix" the failure by not firing the fault: nothing shown (red-team finding: the
    // only fixing variant, exit code 0).
    not_applicable.push_back("checkpointing off: the scenario's fault is injected in a checkpointed segment's forward "
                             "and cannot fire without one, while what it stands for (a forward that overflows) "
                             "would happen all the same");
  } else if (t.segments > 0 && !program) {
    add("checkpointing off", "training.segments: 0", [](ScenarioSpec& s) { s.training.segments = 0; });
  }
  for (double clip : {1.0, 0.5}) {
    if (d.clip.mode == ClipMode::kGlobal && d.clip.max_norm == clip) continue;
    const std::string label = clip == 1.0 ? "1.0" : "0.5";
    add("clip " + label, "defenses.clip: global, max_norm " + label, [clip](ScenarioSpec& s) {
      s.defenses.clip.mode = ClipMode::kGlobal;
      s.defenses.clip.max_norm = clip;
      s.training.clip_grad_norm = 0;
    });
  }
  if (program) {  // the pipeline scales the program's own LR
    add(
        "lr / 10 + warmup", "defenses.lr_scale: " + fmt(d.lr_scale / 10) + ", defenses.warmup_steps: 5",
        [](ScenarioSpec& s) {
          s.defenses.lr_scale /= 10;
          s.defenses.warmup_steps = 5;
        },
        /*restart=*/true);
  } else {
    add(
        "lr / 10 + warmup", "training.lr: " + fmt(t.lr / 10) + ", defenses.warmup_steps: 5",
        [](ScenarioSpec& s) {
          s.training.lr /= 10;
          s.defenses.warmup_steps = 5;
        },
        /*restart=*/true);
  }
  if (program) cannot("fp32", "precision");
  if (t.precision != "fp32" && !program) {
    add("fp32", "training.precision: fp32 (was " + t.precision + ")",
        [](ScenarioSpec& s) { s.training.precision = "fp32"; });
  }
  if (!d.loss_scaling.enabled) {
    add("loss scaling", "defenses.loss_scaling: true", [](ScenarioSpec& s) { s.defenses.loss_scaling.enabled = true; });
  }
  if (!d.rollback) {
    add("rollback", "defenses.rollback: true", [](ScenarioSpec& s) { s.defenses.rollback = true; });
  }
  if (!d.rollback && d.skip_nonfinite) {
    // Beside a defense that skips, rollback acts only on non-finite parameters (a skipped step
    // is handled): a finite weight gone huge, which every later step skips on, is left to it. On
    // its own, rollback restores at the first non-finite step.
    add("rollback, not skip", "defenses.rollback: true, defenses.skip_nonfinite: false", [](ScenarioSpec& s) {
      s.defenses.rollback = true;
      s.defenses.skip_nonfinite = false;
    });
  }
  if (!d.skip_nonfinite) {
    add("skip non-finite", "defenses.skip_nonfinite: true", [](ScenarioSpec& s) { s.defenses.skip_nonfinite = true; });
  }
  if (t.segments > 0 && t.segments < base.model.layers && !program) {
    add("more segments", "training.segments: " + std::to_string(t.segments + 1),
        [](ScenarioSpec& s) { ++s.training.segments; });
  }
  if (t.segments > 1 && !program) {
    add("fewer segments", "training.segments: " + std::to_string(t.segments - 1),
        [](ScenarioSpec& s) { --s.training.segments; });
  }
  if (program) cannot("half batch", "batch size");
  if (base.data.batch > 1 && !program) {
    add("half batch", "data.batch: " + std::to_string(base.data.batch / 2), [](ScenarioSpec& s) { s.data.batch /= 2; });
  }
  return out;
}

RunOptions window_options(const Variant& v, const Window& w, std::int64_t last) {
  RunOptions o;
  o.replay = false;
  o.first_step = w.start;
  o.last_step = last;
  o.start_state = &w.state;
  o.start_rng = &w.rng;
  o.restart_schedule = v.restart_schedule;
  o.counterfactual = false;  // a variant is judged against the failing run (judge), its evidence
  return o;
}

ScenarioSpec variant_spec(const Variant& v) {
  ScenarioSpec spec = v.spec;
  spec.expect = ExpectSpec{};
  spec.expect.recompute_bitwise = true;  // the verifier counts silent recompute mismatches only when asked
  return spec;
}

// CPU seconds per step: the process's CPU time, which other processes on a busy machine disturb
// far less than wall time (diagnose runs one intra-op thread).
double cpu_per_step(const ScenarioResult& r) {
  return r.steps_run > 0 ? r.cpu_seconds / static_cast<double>(r.steps_run) : 0.0;
}

// One run of the variant: its outcome, and a first timing.
VariantResult run_variant(const Variant& v, const Window& w, std::int64_t last, const ExpectSpec& expect) {
  const ScenarioResult r = run_scenario(variant_spec(v), window_options(v, w, last));
  VariantResult out;
  out.name = v.name;
  out.change = v.change;
  out.caveat = v.caveat;
  const std::string failed = judge(r, expect, w);
  out.fixes = failed.empty();
  out.outcome = failed.empty() ? "held (final loss " + fmt(r.final_loss) + ")" : failed;
  out.seconds_per_step_runs.push_back(cpu_per_step(r));
  out.seconds_per_step = out.seconds_per_step_runs.front();
  out.skipped_steps = r.skipped_steps;
  out.final_loss = r.final_loss;
  return out;
}

// The window run with neither the scenario's injections nor its defenses (Window::neither).
ScenarioResult run_neither(const ScenarioSpec& spec, const Window& w, std::int64_t last) {
  const Variant neither{"neither", "", counterfactual_spec(spec, CounterfactualKind::kBare), false, ""};
  return run_scenario(variant_spec(neither), window_options(neither, w, last));
}

// Another timing of the variant (every run starts from the same state and RNG: same outcome).
// The first timing, taken cold (allocations, first-touch), is dropped once there are others.
void time_again(const Variant& v, const Window& w, std::int64_t last, VariantResult& out, bool first_round) {
  if (first_round) out.seconds_per_step_runs.clear();
  out.seconds_per_step_runs.push_back(cpu_per_step(run_scenario(variant_spec(v), window_options(v, w, last))));
  std::vector<double> sorted = out.seconds_per_step_runs;
  std::sort(sorted.begin(), sorted.end());
  out.seconds_per_step = sorted[sorted.size() / 2];
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& i : items) out += (out.empty() ? "" : "; ") + i;
  return out;
}

// Re-executes `step` twice from the window's state (which must start at `step`) and compares the
// two runs with each other and with what the run did the first time.
Classification classify(const ScenarioSpec& spec, const Window& w, double original_loss, double original_norm) {
  Classification c;
  c.step = w.start;
  struct Run {
    double loss, norm;
    std::vector<Digest> state;
    std::vector<std::string> injected;
    bool failed;  // step_failure: by the rule that found the failing step
  };
  auto once = [&](const ScenarioSpec& spec) {
    const std::unique_ptr<Program> p = make_scenario_program(spec);
    p->load_state(w.state);
    w.rng.restore();
    const StepOutcome o = p->step(w.start, p->batch(w.start), nullptr);
    const std::vector<NamedTensor> after = p->state();
    Run r{o.loss, o.grad_norm, {}, o.injected, step_failure(o, after).has_value()};
    for (const NamedTensor& n : after) r.state.push_back(digest(n.tensor));
    return r;
  };
  try {
    const Run a = once(spec), b = once(spec);
    const bool same = same_bits(a.loss, b.loss) && same_bits(a.norm, b.norm) && a.state == b.state;
    const bool fails = a.failed;
    if (!same) {
      c.kind = "nondeterministic";
      c.detail = "two re-executions from the same state and RNG differ (loss " + fmt(a.loss, 9) + " vs " +
                 fmt(b.loss, 9) + "): look for nondeterministic kernels, uninitialised memory or a race";
    } else if (fails) {
      const bool as_before = same_bits(a.loss, original_loss) && same_bits(a.norm, original_norm);
      c.kind = "persistent";
      c.detail = std::string("re-executing the step from its state fails again") +
                 (as_before ? ", bit for bit as the run did" : " (with other bits than the run)") +
                 ": the cause is in the state, the data or the code, and a restart on other hardware will not help";
      // An injection on an earlier step left the state it fails from (where one fires in this step
      // too, the detail below weighs that one instead).
      const Injector schedule(spec.injections);
      std::string earlier;
      for (std::size_t i = 0; i < spec.injections.size(); ++i) {
        const std::vector<std::int64_t> due = schedule.due_steps(i, 1, w.start - 1);
        if (!due.empty())
          earlier += (earlier.empty() ? "" : ", ") + std::string(to_string(spec.injections[i].type)) + " on step " +
                     std::to_string(due.back());
      }
      if (!earlier.empty()) c.detail += "; the scenario injected " + earlier + " before it, which left that state";
      if (!a.injected.empty()) {
        // The scenario's own injection fires again on re-execution: say whether it is the cause.
        ScenarioSpec clean = spec;
        clean.injections.clear();
        const Run c2 = once(clean);
        const bool fails_clean = c2.failed;
        // Bad data comes back with its batch: only the other faults pass with a retry. (A
        // corrupt_batch due on the step fires: it always has inputs to corrupt.) A fault the step
        // computes (an overflow, a loss or LR spike, bad LayerNorm input) a real run's same state
        // and data would compute again, unlike a bit flip or a stray NaN.
        bool data = false, computed = false;
        std::int64_t again = 0, last_again = 0;  // later steps an injection that is not data is due on
        for (std::size_t i = 0; i < spec.injections.size(); ++i) {
          const InjectionType type = spec.injections[i].type;
          const bool now = schedule.scheduled(i, w.start);
          data = data || (type == InjectionType::kCorruptBatch && now);
          if (type == InjectionType::kCorruptBatch) continue;
          computed = computed || (now && type != InjectionType::kBitFlip && type != InjectionType::kGradNonFinite &&
                                  type != InjectionType::kRngDesync);
          const std::vector<std::int64_t> due = schedule.due_steps(i, w.start + 1, spec.training.steps);
          again += static_cast<std::int64_t>(due.size());
          if (!due.empty()) last_again = std::max(last_again, due.back());
        }
        c.injected_fault_repeats = !fails_clean && !data && again > 0;
        c.detail = "re-executing the step from its state fails again" +
                   std::string(as_before ? ", bit for bit as the run did," : "") + " with the scenario's " +
                   (a.injected.size() > 1 ? "injections (" : "injection (") + joined(a.injected) +
                   ") applied again; without the injections it " +
                   (fails_clean ? "fails too: the cause is in the state, the data or the code"
                    : data      ? "does not fail (loss " + fmt(c2.loss) +
                                 "): the injected bad batch is the cause -- in a real run bad data comes back with "
                                 "its batch, and a retry fails again: validate or fix the data"
                    : c.injected_fault_repeats
                        ? "does not fail (loss " + fmt(c2.loss) +
                              "): the injected fault is the cause, and the scenario injects it again on " +
                              std::to_string(again) + " later step" + (again > 1 ? "s" : "") + " (up to step " +
                              std::to_string(last_again) +
                              "): a rollback or a retry does not get past a fault that comes back -- in a real run "
                              "one that does is in the state, the data or the code"
                    : computed
                        ? "does not fail (loss " + fmt(c2.loss) +
                              "): the injected fault is the cause -- in a real run a fault like it (an overflow, a "
                              "spike) comes from the step's own numbers and comes back from the same state and data: "
                              "loss scaling, clipping or a lower LR, not a retry"
                        : "does not fail (loss " + fmt(c2.loss) +
                              "): the injected fault is the cause -- in a real "
                              "run a fault like it (a bit flip, a stray NaN) comes from outside the state and is "
                              "transient, and a rollback and retry is enough");
      }
    } else {
      c.kind = "transient";
      c.detail =
          "re-executing the step from its state does not fail (loss " + fmt(a.loss) +
          "): the fault came from outside the state -- hardware, a stray write -- and a rollback and retry is enough";
    }
  } catch (const std::exception& e) {
    c.kind = "persistent";
    c.detail = std::string("re-executing the step raises again: ") + e.what();
  }
  return c;
}

void rank(Diagnosis& d) {
  const double base = d.baseline.seconds_per_step > 0 ? d.baseline.seconds_per_step : 1;
  d.baseline.cost = 1.0;
  for (VariantResult& v : d.variants) v.cost = v.seconds_per_step / base;
  // Costs within timing noise rank in the variants' fixed order: compared at 0.25x resolution
  // (a fix that costs 0.7x ranks before one at 1.0x; 0.95x and 1.05x are the same price).
  auto bucket = [](double cost) { return std::llround(cost * 4); };
  std::stable_sort(d.variants.begin(), d.variants.end(), [&](const VariantResult& a, const VariantResult& b) {
    if (a.fixes != b.fixes) return a.fixes;
    if (a.fixes && a.caveat.empty() != b.caveat.empty()) return a.caveat.empty();
    return a.fixes ? bucket(a.cost) < bucket(b.cost) : false;
  });
}

Diagnosis diagnose_window(const ScenarioSpec& spec, Window w, const DiagnoseOptions& options, Diagnosis d) {
  const std::int64_t last = options.steps > 0 ? std::min(spec.training.steps, w.start + options.steps - 1)
                                              : spec.training.steps;
  d.from_step = w.start;
  d.to_step = std::max(w.start, last);
  d.lookback = options.lookback;
  if (d.failing_step > 0 && d.to_step < d.failing_step) {
    // Re-running steps that stop before the failure would let every variant "fix" it.
    throw Error("DiagnoseOptions::steps " + std::to_string(options.steps) + " re-runs steps " +
                std::to_string(d.from_step) + ".." + std::to_string(d.to_step) +
                ", which stop before the failing step " + std::to_string(d.failing_step) + "; use " +
                std::to_string(d.failing_step - d.from_step + 1) + " or more (retrace diagnose --steps)");
  }
  const Variant as_recorded{"as recorded", "none", spec, false, ""};
  if (!w.neither || w.neither->last_step != d.to_step) w.neither = run_neither(spec, w, d.to_step);
  d.baseline = run_variant(as_recorded, w, d.to_step, spec.expect);
  if (d.baseline.fixes) {
    d.failure += " -- but it does not come back when steps " + std::to_string(d.from_step) + ".." +
                 std::to_string(d.to_step) + " are re-run from the state before them";
  }
  const std::vector<Variant> variants = make_variants(spec, d.not_applicable);
  for (const Variant& v : variants) d.variants.push_back(run_variant(v, w, d.to_step, spec.expect));
  // Further timings in rounds over all of them, so that a change in the machine's load lands on
  // every variant alike; each cost is then the median of its rounds.
  // With more than one repeat, the outcome run only warms up and `repeats` rounds are timed.
  for (int round = 0; options.repeats > 1 && round < options.repeats; ++round) {
    time_again(as_recorded, w, d.to_step, d.baseline, round == 0);
    for (std::size_t i = 0; i < variants.size(); ++i) time_again(variants[i], w, d.to_step, d.variants[i], round == 0);
  }
  rank(d);
  return d;
}


// No step failed: judge the whole run, from step 1, as the scenario expects it (a final loss
// that stays too high is a failure to diagnose too).
Diagnosis diagnose_whole_run(const ScenarioSpec& spec, const DiagnoseOptions& options, Diagnosis d) {
  Window start;
  {
    const std::unique_ptr<Program> p = make_scenario_program(spec);  // seeds the generators as the run did
    start = {1, clone_all(p->state()), RngState::capture_all()};
  }
  start.neither = run_neither(spec, start, spec.training.steps);
  const VariantResult r =
      run_variant(Variant{"as is", "none", spec, false, ""}, start, spec.training.steps, spec.expect);
  if (r.fixes) {
    // Nothing a variant could change failed. The scenario may still fail on what diagnose does not
    // judge -- how a defense worked (min_skipped_steps), an injection that never fired, a negative
    // control that held -- and is then not said to meet its expectations: its verdict, as retrace
    // run gives it.
    const ScenarioResult run = run_scenario(spec);
    d.failure = run.passed ? "none: the run meets its expectations"
                           : "none that a variant could fix: no step went non-finite or raised" +
                                 std::string(spec.expect.final_loss_below ? ", training went on and the final loss met "
                                                                            "its bound"
                                                                          : " and training went on") +
                                 "; the scenario fails on what diagnose does not judge (" + joined(run.reasons) +
                                 "), as retrace run reports";
    d.failure_kind = "none";
    d.from_step = 1;
    d.to_step = spec.training.steps;
    d.baseline = r;
    return d;
  }
  d.failure = r.outcome;
  d.failure_kind = "expectation";
  return diagnose_window(spec, std::move(start), options, std::move(d));
}

}  // namespace

Diagnosis diagnose_scenario(const ScenarioSpec& spec, const DiagnoseOptions& options) {
  register_builtin_programs();
  const ThreadsGuard threads(options.threads);
  Diagnosis d;
  d.source = spec.origin;
  // The run as it is, keeping the last few step-start states, up to its first failing step: a
  // non-finite loss or gradient norm the defenses did not skip, parameters non-finite after the
  // step, or a raise.
  std::deque<Window> recent;
  double loss = 0, norm = 0;
  std::vector<std::pair<std::int64_t, double>> applied;  // (step, loss) of the applied steps
  {
    const std::unique_ptr<Program> p = make_scenario_program(spec);
    for (std::int64_t s = 1; s <= spec.training.steps; ++s) {
      recent.push_back({s, clone_all(p->state()), RngState::capture_all()});
      while (static_cast<std::int64_t>(recent.size()) > options.lookback + 1) recent.pop_front();
      try {
        const StepOutcome o = p->step(s, p->batch(s), nullptr);
        if (std::optional<std::string> kind = step_failure(o, p->state())) {
          d.failing_step = s;
          loss = o.loss;
          norm = o.grad_norm;
          d.failure_kind = std::move(*kind);
          d.failure = failure_text(s, d.failure_kind);
          break;
        }
        if (!o.skipped) applied.emplace_back(s, o.loss);
      } catch (const std::exception& e) {
        d.failing_step = s;
        loss = norm = std::numeric_limits<double>::quiet_NaN();
        d.failure_kind = "raised";
        d.failure = "step " + std::to_string(s) + " raised: " + exception_message(e);
        break;
      }
    }
  }
  if (d.failing_step < 0) return diagnose_whole_run(spec, options, std::move(d));
  d.classification = classify(spec, recent.back(), loss, norm);
  for (const auto& [s, l] : applied) recent.front().reference(s, l);
  return diagnose_window(spec, recent.front(), options, std::move(d));
}

Diagnosis diagnose_trace(const std::string& path, const DiagnoseOptions& options) {
  register_builtin_programs();
  const ThreadsGuard threads(options.threads);
  const TraceReader trace(path);
  const TraceHeader header = TraceHeader::decode(trace);
  const std::string program = header.program ? header.program->name : std::string();
  if (program != "retrace.scenario") {
    throw Error(path + ": this trace was recorded by program '" + program +
                "' without a scenario, and diagnose re-runs the failing steps as variants of a scenario (its "
                "defenses on and off); write one naming the program ('program: " +
                program +
                "' and its 'config:', docs/scenarios.md), then diagnose that file, or a trace "
                "recorded from it (record SCENARIO.yaml)");
  }
  if (header.ranks && header.ranks->distributed()) {
    // Its variants would each be one process of a data-parallel run (red-team finding: every variant
    // "raised" the world_size refusal, and diagnose called the step persistent, with no fix).
    throw Error(path + ": this is rank " + std::to_string(header.ranks->rank) + "'s trace of a data-parallel run of " +
                std::to_string(header.ranks->world_size) +
                " ranks, and diagnose re-runs a failing step in one process; name the culprit rank with "
                "'retrace replay' or 'retrace inspect' of every rank's trace (docs/data-parallel.md)");
  }
  const ScenarioSpec spec =
      parse_scenario_text(header.program->config, path + " (program config)", ScenarioSource::kCanonical);
  Diagnosis d;
  d.source = path;
  double loss = 0, norm = 0;
  // Replaying to a step, and re-executing it bit for bit, needs the intra-op thread count the
  // trace was recorded with (the replayer refuses another); only the variants' timing uses
  // options.threads.
  int recorded_threads = 0;
  {
    const auto it = header.environment.bitwise.find("intra_op_threads");
    const std::string t = it == header.environment.bitwise.end() ? std::string() : it->second;
    if (!t.empty() && t.find_first_not_of("0123456789") == std::string::npos && t.size() < 6)
      recorded_threads = std::stoi(t);
  }
  // The first failing step as recorded: a non-finite step the defenses did not skip, or a step
  // that raised.
  for (std::size_t i = 0; i < trace.records().size() && d.failing_step < 0; ++i) {
    const RecordType type = trace.records()[i].type;
    if (type == RecordType::kEvent) {
      const std::optional<ExceptionEvent> e = EventRecord::decode(trace.read_table(i), path).exception;
      if (!e || !e->raised_by_step) continue;
      d.failing_step = e->step;
      loss = norm = std::numeric_limits<double>::quiet_NaN();
      d.failure_kind = "raised";
      d.failure = "step " + std::to_string(e->step) + " raised: " + e->what;
    } else if (type == RecordType::kStepEnd) {
      const StepEndRecord rec = StepEndRecord::decode(trace.read_table(i), path);
      if (rec.finite || rec.skipped) continue;  // fine, or handled
      d.failing_step = rec.step;
      loss = rec.loss;
      norm = rec.grad_norm;
      d.failure_kind = nonfinite_kind(loss, norm);
      d.failure = failure_text(d.failing_step, d.failure_kind);
    }
  }
  if (d.failing_step < 0) {
    // No recorded step failed. A run that stopped before its scenario's last step (--steps, a
    // kill) is diagnosed over the steps it reached: a failure after them is not the trace's.
    std::int64_t last_recorded = 0;
    for (const RecordInfo& r : trace.records()) {
      if (r.type == RecordType::kStepEnd) last_recorded = std::max(last_recorded, r.step);
    }
    ScenarioSpec reached = spec;
    if (last_recorded > 0 && last_recorded < spec.training.steps) reached.training.steps = last_recorded;
    return diagnose_whole_run(reached, options, std::move(d));
  }
  // The state before a step, by replaying the trace up to it (bit for bit, or we say so).
  auto state_before = [&](std::int64_t step) {
    const ThreadsGuard as_recorded(recorded_threads);
    // Built for a replay from a snapshot only when one follows: step 1 starts from the constructor.
    std::unique_ptr<Program> p = program_from_trace(trace, step > 1 ? BuildFor::kReplay : BuildFor::kFreshStart);
    if (step > 1) {
      ReplayOptions ro;
      ro.step = step - 1;
      ro.provenance = false;
      const ReplayResult rr = Replayer(trace, *p).run(ro);
      if (!rr.reproduced) {
        d.failure += "; note: the replay up to step " + std::to_string(step - 1) + " diverged (" +
                     (rr.first_divergence ? rr.first_divergence->message() : std::string("?")) + ")";
      }
    }
    return Window{step, clone_all(p->state()), RngState::capture_all()};
  };
  Window at_failure = state_before(d.failing_step);
  if (d.failing_step > 1 && !parameters_finite(at_failure.state)) {
    // The step before left the parameters non-finite with a finite loss and gradient norm (the
    // trace's step_end does not say): that step is the failure, as the scenario's diagnosis finds.
    d.failing_step -= 1;
    d.failure_kind = "parameters";
    d.failure = failure_text(d.failing_step, d.failure_kind);
    at_failure = state_before(d.failing_step);
    for (std::size_t i = 0; i < trace.records().size(); ++i) {
      if (trace.records()[i].type != RecordType::kStepEnd) continue;
      const StepEndRecord rec = StepEndRecord::decode(trace.read_table(i), path);
      if (rec.step != d.failing_step) continue;
      loss = rec.loss;
      norm = rec.grad_norm;
    }
  }
  {
    const ThreadsGuard as_recorded(recorded_threads);  // "bit for bit as the run did" compares with the trace
    d.classification = classify(spec, at_failure, loss, norm);
  }
  const std::int64_t start = std::max<std::int64_t>(1, d.failing_step - options.lookback);
  Window w = start == d.failing_step ? std::move(at_failure) : state_before(start);
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    if (trace.records()[i].type != RecordType::kStepEnd || trace.records()[i].step >= w.start) continue;
    const StepEndRecord rec = StepEndRecord::decode(trace.read_table(i), path);
    if (!rec.skipped) w.reference(rec.step, rec.loss);
  }
  return diagnose_window(spec, std::move(w), options, std::move(d));
}

std::string Diagnosis::report() const {
  std::ostringstream os;
  os << "diagnosis of " << source << "\n";
  os << "failure: " << failure << "\n";
  if (classification.kind != "none") {
    os << "step " << classification.step << " is " << classification.kind << ": " << classification.detail << "\n";
  }
  if (variants.empty()) return os.str();
  os << "re-ran steps " << from_step << ".." << to_step << " from the state before step " << from_step
     << " under each variant (cost: time per step relative to the run as it was):\n";
  if (failing_step > 0 && failing_step - lookback < from_step) {
    os << "(a lookback of " << lookback << " steps from the failing step " << failing_step
       << " reaches before step 1: they start at step " << from_step << ")\n";
  }
  os << "\n";
  std::size_t w = 18;
  for (const VariantResult& v : variants) w = std::max(w, v.name.size());
  auto line = [&](const std::string& rank, const VariantResult& v) {
    os << std::left << std::setw(4) << rank << std::setw(static_cast<int>(w) + 2) << v.name << std::setw(7)
       << (v.fixes ? "fixes" : "no") << std::right << std::setw(6) << std::fixed << std::setprecision(2) << v.cost
       << "x  " << std::defaultfloat << std::left << v.outcome
       << (v.caveat.empty() ? "" : " (caveat: " + v.caveat + ")") << "\n";
  };
  os << std::left << std::setw(4) << "#" << std::setw(static_cast<int>(w) + 2) << "variant" << std::setw(7) << "result"
     << std::right << std::setw(7) << "cost"
     << "  " << std::left << "outcome\n";
  line("-", baseline);
  int n = 0;
  for (const VariantResult& v : variants) line(v.fixes ? std::to_string(++n) : "", v);
  if (n == 0) {
    os << "\nno variant avoids the failure from step " << from_step;
    // From step 1 there is nothing earlier to start from.
    if (classification.injected_fault_repeats) {
      os << "; the scenario injects its fault again on later steps, and no earlier start avoids that";
    } else if (from_step > 1) {
      os << "; try a larger DiagnoseOptions::lookback (retrace diagnose --lookback)";
    }
    os << ".\n";
  }
  if (!not_applicable.empty()) {
    os << "\nnot tried:\n";
    for (const std::string& why : not_applicable) os << "  " << why << "\n";
  }
  return os.str();
}

nlohmann::json Diagnosis::to_json() const {
  auto variant = [](const VariantResult& v) {
    nlohmann::json j = {{"name", v.name},
                        {"change", v.change},
                        {"fixes", v.fixes},
                        {"outcome", v.outcome},
                        {"cost", v.cost},
                        {"seconds_per_step", v.seconds_per_step},
                        {"skipped_steps", v.skipped_steps}};
    j["final_loss"] = json_number(v.final_loss);
    j["seconds_per_step_runs"] = v.seconds_per_step_runs;
    if (!v.caveat.empty()) j["caveat"] = v.caveat;
    return j;
  };
  nlohmann::json j;
  j["source"] = source;
  j["failing_step"] = failing_step >= 0 ? nlohmann::json(failing_step) : nlohmann::json(nullptr);
  j["failure"] = failure;
  j["failure_kind"] = failure_kind;
  j["from_step"] = from_step;
  j["lookback"] = lookback;
  j["to_step"] = to_step;
  j["classification"] = {{"kind", classification.kind},
                         {"step", classification.step},
                         {"detail", classification.detail},
                         {"injected_fault_repeats", classification.injected_fault_repeats}};
  j["baseline"] = variant(baseline);
  j["variants"] = nlohmann::json::array();
  for (const VariantResult& v : variants) j["variants"].push_back(variant(v));
  nlohmann::json fixing = nlohmann::json::array();
  for (const VariantResult& v : variants) {
    if (v.fixes) fixing.push_back(v.name);
  }
  j["fixing_variants"] = fixing;
  j["not_applicable"] = not_applicable;
  return j;
}

}  // namespace retrace
