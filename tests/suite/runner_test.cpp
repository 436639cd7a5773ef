// The scenario runner: results round-trip through JSON, stability figures, and verdicts whose
// evidence is missing (an injection that never fired, a harness error) fail.
#include "../support/scenario_text.h"
#include "../support/state_compare.h"

#include <retrace/runner.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>
#include <set>

namespace retrace {
namespace {

using test::with;

TEST(Runner, ResultsRoundTripThroughJson) {
  const ScenarioResult r = run_scenario(load_scenario("builtin:grad-nan-skip"));
  EXPECT_TRUE(r.passed);
  EXPECT_TRUE(r.replay_bitwise);  // recorded with the injection and the defense, replayed bitwise
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.to_json(), r.to_json());
  EXPECT_EQ(back.checks.size(), r.checks.size());
  EXPECT_EQ(back.notes, r.notes);
  EXPECT_EQ(back.notes_of(StepNoteKind::kSkipped),
            (std::vector<StepNote>{{3, StepNoteKind::kSkipped, "non-finite gradients"}}));
  ASSERT_EQ(back.notes_of(StepNoteKind::kInjected).size(), 1u);
  EXPECT_EQ(back.notes_of(StepNoteKind::kInjected)[0].step, 3);
  // --json's readers also get the notes as lines.
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j.at("skip_reasons"), nlohmann::json::array({"step 3: non-finite gradients"}));
  EXPECT_EQ(j.at("notes").at(1), (nlohmann::json{{"step", 3}, {"kind", "skipped"}, {"text", "non-finite gradients"}}));
  // A check's name is its kind: one the reader does not know is an error, not a check of no kind.
  ASSERT_FALSE(r.checks.empty());
  EXPECT_EQ(j.at("checks").at(0).at("name"), r.checks[0].name());
  EXPECT_EQ(back.checks[0].kind, r.checks[0].kind);
  nlohmann::json unknown = j;
  unknown["checks"][0]["name"] = "params_finit";
  try {
    ScenarioResult::from_json(unknown);
    ADD_FAILURE() << "an unknown check was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown check 'params_finit'"), std::string::npos) << e.what();
  }
}

// Every check kind has its `expect` key as its name, and a role: the verdict's rules ask the role,
// not the name.
TEST(Runner, EveryCheckKindHasANameAndARole) {
  const std::pair<CheckKind, CheckRole> kinds[] = {
      {CheckKind::kParamsFinite, CheckRole::kBreakage},     {CheckKind::kLossFinite, CheckRole::kBreakage},
      {CheckKind::kMaxSkippedSteps, CheckRole::kOther},     {CheckKind::kMinSkippedSteps, CheckRole::kExercise},
      {CheckKind::kMinScaleBackoffs, CheckRole::kExercise}, {CheckKind::kMinScaleGrowths, CheckRole::kExercise},
      {CheckKind::kMinRollbacks, CheckRole::kExercise},     {CheckKind::kFinalLossBelow, CheckRole::kBreakage},
      {CheckKind::kMinAppliedSteps, CheckRole::kBreakage},  {CheckKind::kRecomputeBitwise, CheckRole::kBreakage},
      {CheckKind::kReplayBitwise, CheckRole::kOther},       {CheckKind::kInjectionsFired, CheckRole::kExercise},
      {CheckKind::kInjectionFired, CheckRole::kExercise},   {CheckKind::kRaises, CheckRole::kExercise},
      {CheckKind::kFaultBites, CheckRole::kExercise},       {CheckKind::kFaultCaused, CheckRole::kCause},
  };
  std::set<std::string> names;
  for (const auto& [kind, role] : kinds) {
    EXPECT_EQ(role_of(kind), role) << to_string(kind);
    EXPECT_NE(std::string(to_string(kind)), "?");
    names.insert(to_string(kind));
  }
  EXPECT_EQ(names.size(), std::size(kinds));
  // The names are the expect keys the scenario parser accepts (the automatic injection_fired,
  // fault_bites and fault_caused aside).
  for (const std::string& n : names) {
    if (n == "injection_fired" || n == "fault_bites" || n == "fault_caused") continue;
    const std::string value = n == "final_loss_below" ? "1.0" : (n.rfind("m", 0) == 0 ? "1" : "true");
    EXPECT_NO_THROW(with("expect: {" + n + ": " + value + "}\n")) << n;
  }
  EXPECT_THROW(with("expect: {params_finit: true}\n"), Error);  // the control: a name it does not know
}

TEST(Runner, StabilityFiguresCountASkippedStepAsDisturbed) {
  // grad-nan-skip: step 3's gradients are NaN and skipped; its loss is the fault-free run's, so
  // only the skip makes it disturbed, and step 4 is back on track.
  const ScenarioResult r = bench_scenario(load_scenario("builtin:grad-nan-skip"), /*repeats=*/1);
  ASSERT_TRUE(r.bench.measured && r.bench.injected);
  ASSERT_GE(r.steps.size(), 4u);
  EXPECT_TRUE(r.steps[2].skipped);
  EXPECT_TRUE(std::isfinite(r.steps[2].loss));
  EXPECT_EQ(r.bench.steps_to_recover, 1);
  // Control: undefended, the NaN reaches the parameters and the run never gets back.
  const ScenarioResult off = bench_scenario(load_scenario("builtin:grad-nan-skip-off"), /*repeats=*/1);
  EXPECT_EQ(off.bench.steps_to_recover, -1);
}

TEST(Runner, AFailedExpectationFailsAndADivergingControlPasses) {
  ScenarioSpec spec = with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true}\n");
  ScenarioResult r = run_scenario(spec);
  EXPECT_FALSE(r.passed);
  EXPECT_TRUE(r.broke);
  spec.expect.diverges = true;
  r = run_scenario(spec);
  EXPECT_TRUE(r.passed);
  // The outcome matrix's row (report_tests render it): fault, defense, outcome, expected.
  EXPECT_EQ(r.fault, "grad_nonfinite:nan");
  EXPECT_EQ(r.defense, "none");
  EXPECT_EQ(r.outcome(), "broke");
  EXPECT_TRUE(r.expected_to_break);
}

// A run that goes non-finite with no defense and trains on: the replay ends at that step, so
// replay_bitwise fails (steps after it were not verified), and the report says why instead of
// leaving it to look like the replay's fault. Control: with the step skipped the replay reaches
// the end and the check holds.
TEST(Runner, AReplayEndingAtAnUnhandledNonFiniteStepSaysSo) {
  ScenarioSpec spec = with("injections: [{type: grad_nonfinite, step: 2}]\n"
                           "expect: {diverges: true, replay_bitwise: true}\n");
  ScenarioResult r = run_scenario(spec);
  ASSERT_GT(r.last_step, 2);
  EXPECT_TRUE(r.replayed);
  EXPECT_FALSE(r.replay_bitwise);
  EXPECT_FALSE(r.passed);
  EXPECT_EQ(r.replay_report, "the replay stopped at step 2 of " + std::to_string(r.last_step) +
                                 ": step 2 went non-finite and no defense skipped it, and a replay ends at such a "
                                 "step; steps 1..2 reproduced bitwise, 3.." +
                                 std::to_string(r.last_step) + " were not replayed");
  spec.defenses.skip_nonfinite = true;
  spec.expect.diverges = false;
  r = run_scenario(spec);
  EXPECT_TRUE(r.replay_bitwise) << r.replay_report;
  EXPECT_EQ(r.replay_report, "");
}

TEST(Runner, AnInjectionThatNeverFiresFailsTheScenario) {
  // Adam has no state before its first step: an optimizer flip at step 1 has nothing to flip.
  ScenarioResult r = run_scenario(with("injections: [{type: bit_flip, step: 1, target: optimizer, bit: 30}]\n"
                                       "expect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed);
  bool named = false;
  for (const ExpectationCheck& c : r.checks) named = named || (c.kind == CheckKind::kInjectionFired && !c.passed);
  EXPECT_TRUE(named);
  r = run_scenario(with("injections: [{type: bit_flip, step: 2, target: optimizer, bit: 30}]\n"
                        "expect: {params_finite: true, diverges: true}\n"));
  for (const ExpectationCheck& c : r.checks) EXPECT_NE(c.kind, CheckKind::kInjectionFired);  // it fired at step 2
}

// An LR spike due on a step that validate_batch skips (its batch corrupted by another entry) never
// reaches an optimizer step: it did not fire, and the scenario cannot say the defense held against
// it (found by an outsider test: it said held). The reason names the skip. Control: the same
// spike on a step that is applied fires.
TEST(Runner, AnLrSpikeOnASkippedStepDidNotFire) {
  const auto sgd = [](const std::string& extra) {
    ScenarioSpec spec = with("defenses: {validate_batch: true}\n" + extra);
    spec.training.steps = 6;
    spec.training.optimizer = "sgd";
    spec.training.lr = 1.0;
    return spec;
  };
  ScenarioResult r = run_scenario(sgd("injections: [{type: lr_spike, step: 3, factor: 1.0e6}, "
                                      "{type: corrupt_batch, step: 3}]\nexpect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed);
  const ExpectationCheck* fired = nullptr;
  for (const ExpectationCheck& c : r.checks) {
    if (c.kind == CheckKind::kInjectionFired && !c.passed) fired = &c;
  }
  ASSERT_NE(fired, nullptr) << r.verdict();
  EXPECT_EQ(fired->expected, "injections[0] lr_spike fires (due at step 3)");
  EXPECT_EQ(fired->observed,
            "did not fire; every step it was due on was skipped before it could act: step 3 (invalid batch: token ids "
            "outside the vocabulary in 'input')");
  r = run_scenario(sgd("injections: [{type: lr_spike, step: 3, factor: 1.0e6}]\nexpect: {params_finite: true}\n"));
  for (const ExpectationCheck& c : r.checks) EXPECT_NE(c.kind, CheckKind::kInjectionFired) << c.observed;
  ASSERT_FALSE(r.injections.empty());
  EXPECT_EQ(r.injections[0].fired, (std::vector<std::int64_t>{3}));
}

// A segment fault naming a stage inside a range segment ("block0" in "block0..block1") targets it:
// when it does not fire (its step skipped), the reason says so and does not claim its segment
// never ran (segment_targeted: Injector.SegmentTargetedMatchesANameAndAStageInsideARange).
TEST(Runner, ASegmentInsideARangeIsNotSaidToHaveNeverRun) {
  const auto one_segment = [](const std::string& extra) {
    ScenarioSpec spec = with(extra);
    spec.training.segments = 1;
    return spec;
  };
  ScenarioResult r = run_scenario(one_segment("defenses: {validate_batch: true}\n"
                                              "injections: [{type: corrupt_batch, step: 3}, "
                                              "{type: layernorm_input, step: 3, mode: nan, segment: block0}]\n"
                                              "expect: {params_finite: true}\n"));
  bool said = false;
  for (const ExpectationCheck& c : r.checks) {
    if (c.kind != CheckKind::kInjectionFired) continue;
    said = true;
    EXPECT_EQ(c.observed.find("never ran"), std::string::npos) << c.observed;
    EXPECT_NE(c.observed.find("skipped before it could act: step 3"), std::string::npos) << c.observed;
  }
  EXPECT_TRUE(said) << r.verdict();
}

TEST(Runner, RaisesMatchesTheErrorAndAHarnessErrorNeverPasses) {
  const std::string fault = "injections: [{type: grad_nonfinite, step: 2, mode: inf}]\n"
                            "defenses: {clip: {mode: global, max_norm: 1.0, error_if_nonfinite: true}}\n";
  EXPECT_TRUE(run_scenario(with(fault + "expect: {raises: true, raises_match: \"clipping refuses it\"}\n")).passed);
  EXPECT_FALSE(run_scenario(with(fault + "expect: {raises: true, raises_match: \"out of memory\"}\n")).passed);
  // The step that raised keeps the note of what was injected in it (its outcome, which carries
  // them for a step that ends, never came).
  const ScenarioResult raised = run_scenario(with(fault + "expect: {raises: true}\n"));
  const std::vector<StepNote> injected = raised.notes_of(StepNoteKind::kInjected);
  ASSERT_EQ(injected.size(), 1u) << raised.verdict();
  EXPECT_EQ(injected[0].step, 2);
  EXPECT_EQ(injected[0].text.rfind("grad_nonfinite grad.", 0), 0u) << injected[0].text;
  // The norm it refuses is said as it is: an Inf gradient's is inf. Control: a NaN gradient's is nan.
  EXPECT_TRUE(
      run_scenario(with(fault + "expect: {raises: true, raises_match: \"gradient norm is non-finite (inf)\"}\n"))
          .passed);
  const std::string nan = "injections: [{type: grad_nonfinite, step: 2, mode: nan}]\n"
                          "defenses: {clip: {mode: global, max_norm: 1.0, error_if_nonfinite: true}}\n";
  EXPECT_TRUE(
      run_scenario(with(nan + "expect: {raises: true, raises_match: \"gradient norm is non-finite (nan)\"}\n")).passed);
  // A program that cannot even be built (no CUDA here, or a bad config at run time) shows
  // nothing about the fault: not a pass, not even for a negative control.
  if (!torch::cuda::is_available()) {
    ScenarioSpec spec = with("expect: {diverges: true}\n");
    spec.training.device = "cuda";
    const ScenarioResult r = run_scenario(spec);
    EXPECT_TRUE(r.harness_error);
    EXPECT_FALSE(r.passed);
  }
}

}  // namespace
}  // namespace retrace
