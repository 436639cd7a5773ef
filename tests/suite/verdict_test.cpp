// The verdict rules of docs/scenarios.md ("Expectations and the verdict"), each with a scenario
// that meets it and a negative control built to trip it: a control passes only when its own
// fault broke the run, at or after the fault's step, with every injection fired; "held" needs
// training to go on; the final loss and loss_finite look at applied steps at the end of the run;
// every injection entry must fire; a raise before the fault is a harness error.
#include "../support/scenario_text.h"

#include <retrace/diagnose.h>
#include <retrace/error.h>
#include <retrace/recorder.h>
#include <retrace/runner.h>
#include <retrace/scenario.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace retrace {
namespace {

using test::kGpt;
using test::with;

std::string why(const ScenarioResult& r) {
  std::string out = r.verdict() + "\n";
  for (const ExpectationCheck& c : r.checks)
    out += "  " + std::string(c.name()) + ": " + c.expected + " / " + c.observed + (c.passed ? "" : " FAILED") + "\n";
  return out;
}

bool has_reason(const ScenarioResult& r, const std::string& text) {
  return std::any_of(r.reasons.begin(), r.reasons.end(),
                     [&](const std::string& s) { return s.find(text) != std::string::npos; });
}

const ExpectationCheck* find_check(const ScenarioResult& r, const std::string& name) {
  for (const ExpectationCheck& c : r.checks) {
    if (c.name() == name) return &c;
  }
  return nullptr;
}

// --- negative controls must break because of their fault ---------------------------------------

TEST(Verdict, AControlPassesOnItsFaultsEvidenceAndSaysWhich) {
  const ScenarioResult r = run_scenario(
      with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true, diverges: true}\n"));
  ASSERT_TRUE(r.passed) << why(r);
  const Breakage* x = r.evidence();
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->kind, BreakKind::kNonFiniteParams);
  EXPECT_EQ(x->step, 2);  // the NaN gradient is applied at step 2
  EXPECT_NE(r.verdict().find("ok (broke: parameters non-finite from step 2 on)"), std::string::npos) << r.verdict();
  EXPECT_EQ(
      r.to_json().at("breakage"),
      nlohmann::json::parse(
          R"([{"counts":true,"detail":"parameters non-finite from step 2 on","kind":"non_finite_params","step":2,"without_fault_step":0}])"))
      << r.to_json();
}

TEST(Verdict, AControlWithAnInjectionThatNeverFiredFails) {
  // The NaN gradient bites; the optimizer flip at step 1 cannot fire (Adam has no state yet). The
  // control's claim -- these faults break it -- is then not what ran.
  const std::string bites = "{type: grad_nonfinite, step: 2}";
  ScenarioResult r = run_scenario(with("injections: [" + bites +
                                       ", {type: bit_flip, step: 1, target: optimizer, bit: 30}]\n"
                                       "expect: {params_finite: true, diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "injections[1] bit_flip fires (due at step 1)")) << why(r);
  // Control: the same flip at step 2, where Adam has state, fires and the control passes.
  r = run_scenario(with("injections: [" + bites +
                        ", {type: bit_flip, step: 2, target: optimizer, bit: 30}]\n"
                        "expect: {params_finite: true, diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
}

// A control whose fault made the loss non-finite, which its expectations do not count, failed
// with "the fault did not bite" (red-team finding: the loss was Inf on every step from the
// fault's on). The reason says what did break and how to count it; with loss_finite it passes.
TEST(Verdict, AControlWhoseLossWentNonFiniteUncountedSaysSo) {
  const std::string run = "name: t\nmodel: {type: mlp, layers: 2, hidden: 32, in_features: 16, out_features: 4}\n"
                          "data: {batch: 16, seed: 1}\n"
                          "training: {steps: 6, optimizer: adam, lr: 0.003, segments: 2, loss_weight: 1.0e-30}\n"
                          "injections: [{type: activation_overflow, step: 3, duration: 4, segment: layer1, "
                          "factor: 1.0e20}]\n";
  ScenarioResult r =
      run_scenario(parse_scenario_text(run + "expect: {params_finite: true, diverges: true}\n", "t.yaml"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "negative control held: the fault broke nothing its expectations count (its loss was "
                            "non-finite from step 3 on: add loss_finite: true to count that)"))
      << why(r);
  r = run_scenario(
      parse_scenario_text(run + "expect: {params_finite: true, loss_finite: true, diverges: true}\n", "t.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
}

// The same for a finite loss that ran away: a loss x 100 under SGD puts the loss from ~0.4 to 1.4
// the step after, and it ends at 0.84 -- the control held by what it counts, and says what it did
// not count (red-team finding: "the fault did not bite" for a control whose loss went 1.38 ->
// 72429). Control: with final_loss_below 0.5 it broke.
TEST(Verdict, AControlWhoseLossRanAwayUncountedSaysSo) {
  const std::string run = "name: t\nmodel: {type: mlp, layers: 2, hidden: 32, in_features: 16, out_features: 4}\n"
                          "data: {batch: 16, seed: 1}\ntraining: {steps: 8, optimizer: sgd, lr: 0.1}\n"
                          "injections: [{type: loss_spike, step: 3, factor: 100}]\n";
  ScenarioResult r =
      run_scenario(parse_scenario_text(run + "expect: {params_finite: true, diverges: true}\n", "t.yaml"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "negative control held: the fault broke nothing its expectations count (its loss rose "
                            "from a median of 0.4"))
      << why(r);
  EXPECT_TRUE(has_reason(r, " before the fault to 1.41")) << why(r);
  EXPECT_TRUE(has_reason(r, " at step 4 and ends at 0.84")) << why(r);
  EXPECT_TRUE(has_reason(r, ": add final_loss_below to count that)")) << why(r);
  r = run_scenario(
      parse_scenario_text(run + "expect: {params_finite: true, final_loss_below: 0.5, diverges: true}\n", "t.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
}

TEST(Verdict, AControlThatFailsAnUnrelatedExpectationFails) {
  // A benign mantissa flip: nothing breaks; min_rollbacks fails only because rollback is off.
  ScenarioResult r = run_scenario(with("injections: [{type: bit_flip, step: 2, target: weights, bit: 2}]\n"
                                       "expect: {params_finite: true, min_rollbacks: 1, diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_FALSE(r.broke);
  EXPECT_TRUE(has_reason(r, "negative control held")) << why(r);
  EXPECT_TRUE(has_reason(r, "min_rollbacks: expected >= 1, got 0")) << why(r);
  // A control that does break still fails an unrelated expectation it states...
  r = run_scenario(with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true, min_rollbacks: "
                        "1, diverges: true}\n"));
  EXPECT_TRUE(r.broke);
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "min_rollbacks")) << why(r);
  // ... and passes once that expectation is true of the run.
  r = run_scenario(with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true, min_rollbacks: "
                        "0, diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
}

TEST(Verdict, AControlThatRaisesWithoutSayingSoFailsAndOneThatNamesItsRaisePasses) {
  // A token id past the vocabulary makes the embedding lookup raise at the fault's step.
  const std::string fault = "injections: [{type: corrupt_batch, step: 2}]\n";
  ScenarioResult r = run_scenario(with(fault + "expect: {params_finite: true, diverges: true}\n"));
  EXPECT_TRUE(r.raised);
  EXPECT_EQ(r.raised_at_step, 2);
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "raised at step 2: ")) << why(r);
  r = run_scenario(with(fault + "expect: {raises: true, raises_match: \"index out of range\", diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  ASSERT_NE(r.evidence(), nullptr);
  EXPECT_EQ(r.evidence()->kind, BreakKind::kRaised);
  // The raise it names must be the one that happened.
  r = run_scenario(with(fault + "expect: {raises: true, raises_match: \"out of memory\", diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
}

TEST(Verdict, ARaiseBeforeTheFaultIsAHarnessErrorNeverAPass) {
  // Weights x1e6 under fp16 autocast: the very first step's gradients overflow and clipping's
  // error_if_nonfinite raises at step 1 -- before the injection scheduled for step 3.
  const std::string run =
      "model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8, init_gain: 1.0e6}\n"
      "training: {steps: 4, segments: 2, precision: fp16}\n"
      "defenses: {clip: {mode: global, error_if_nonfinite: true}}\n";
  // Its outcome is "not exercised" whatever the scenario expects: the run never got to its fault,
  // so the checks of what breaks that failed with it (loss_finite: no applied step) are no breakage.
  for (const char* expect : {"expect: {raises: true, diverges: true}\n", "expect: {raises: true}\n",
                             "expect: {loss_finite: true}\n", "expect: {loss_finite: true, diverges: true}\n"}) {
    const ScenarioResult r = run_scenario(
        parse_scenario_text(run + "injections: [{type: grad_nonfinite, step: 3}]\n" + expect, "early.yaml"));
    EXPECT_TRUE(r.harness_error) << why(r);
    EXPECT_FALSE(r.passed) << why(r);
    EXPECT_TRUE(has_reason(r, "harness error: step 1 raised before the fault at step 3")) << why(r);
    EXPECT_EQ(r.outcome(), "not exercised") << expect << why(r);
    EXPECT_EQ(ScenarioResult::from_json(r.to_json()).outcome(), "not exercised") << expect;
  }
  // Control: the fault at step 1 -- the raise is now at the fault's step, no harness error, and
  // the raise counts as the run's. What the verdict then says is that the configuration breaks at
  // step 1 with or without the fault (fault_bites): the defense holds the configuration.
  const ScenarioResult r = run_scenario(
      parse_scenario_text(run + "injections: [{type: grad_nonfinite, step: 1}]\nexpect: {raises: true}\n", "at.yaml"));
  EXPECT_FALSE(r.harness_error);
  EXPECT_TRUE(r.raised);
  ASSERT_EQ(r.reasons.size(), 1u) << why(r);
  EXPECT_TRUE(has_reason(r, "fault_bites: expected the run without its defenses (clip:global 1) breaks, and not "
                            "without the fault, got broke, but so does it without the fault: parameters non-finite "
                            "from step 1 on"))
      << why(r);
}

TEST(Verdict, BreakageBeforeTheFaultDoesNotCount) {
  // Without preserved RNG state the recompute is not bitwise from step 1, whatever is injected
  // at step 3: a control resting on that proves nothing about the injection.
  const std::string run = "defenses: {preserve_rng_state: false}\n";
  ScenarioResult r = run_scenario(with(run + "injections: [{type: rng_desync, step: 3, segment: block0}]\n"
                                             "expect: {recompute_bitwise: true, diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(
      has_reason(r, "step 1 applied gradients from a recompute that was not bitwise, before the fault at step 3"))
      << why(r);
  // The outcome matrix does not call such a run "held": it broke, before its fault.
  EXPECT_EQ(r.outcome_kind(), Outcome::kBrokeEarly);
  EXPECT_EQ(r.outcome(), "broke early");
  EXPECT_EQ(ScenarioResult::from_json(r.to_json()).outcome(), "broke early");
  // Control: without the injection the configuration is the fault (step 1), and the control passes.
  r = run_scenario(with(run + "expect: {recompute_bitwise: true, diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.evidence()->kind, BreakKind::kSilentRecompute);
  EXPECT_EQ(r.outcome(), "broke");
  // A control may write what it expects, `false`: the same breakage, the same verdict (it had
  // passed its check and counted no breakage, "held" beside a recompute that was not bitwise).
  r = run_scenario(with(run + "expect: {recompute_bitwise: false, diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  ASSERT_TRUE(r.evidence()) << why(r);
  EXPECT_EQ(r.evidence()->kind, BreakKind::kSilentRecompute);
  EXPECT_EQ(r.outcome(), "broke");
  // And a control whose fault did not bite, with nothing broken before it, held.
  r = run_scenario(with("injections: [{type: loss_spike, step: 3, factor: 0.999}]\nexpect: {params_finite: true, "
                        "diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
}

// --- the fault must have done it: the same run without the fault, or without the defenses ------

// A control whose configuration breaks it anyway proves nothing about its fault: the same run
// without its injections fails final_loss_below too (the tiny GPT never gets near 0.01 in four
// steps), so the breakage does not count. Control: a NaN gradient that breaks the parameters,
// which the fault-free run keeps finite, passes -- though its final loss fails without it too.
TEST(Verdict, AControlWhoseConfigurationBreaksItAnywayDoesNotPass) {
  ScenarioResult r = run_scenario(with("injections: [{type: bit_flip, step: 2, target: weights, bit: 2}]\n"
                                       "expect: {final_loss_below: 0.01, diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_FALSE(r.broke) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kBrokeWithoutFault) << why(r);
  EXPECT_EQ(r.outcome(), "broke without the fault");
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kFaultFree);
  ASSERT_EQ(r.breakage.size(), 1u) << why(r);
  EXPECT_EQ(r.breakage[0].kind, BreakKind::kFinalLoss);
  EXPECT_FALSE(r.breakage[0].counts);
  EXPECT_EQ(r.breakage[0].without_fault_step, 4);
  EXPECT_TRUE(has_reason(r, "fault_caused: expected the run without its injections does not break so within the "
                            "run, got it broke too: final loss"))
      << why(r);
  EXPECT_TRUE(has_reason(r, "the configuration breaks it, not the fault")) << why(r);
  EXPECT_FALSE(has_reason(r, "negative control held")) << why(r);
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.outcome(), "broke without the fault");
  EXPECT_EQ(back.counterfactual.kind, CounterfactualKind::kFaultFree);
  EXPECT_EQ(back.breakage.at(0).without_fault_step, 4);
  EXPECT_EQ(back.counterfactual.breakage.size(), r.counterfactual.breakage.size());
  EXPECT_EQ(back.to_json(), r.to_json());

  r = run_scenario(
      with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {final_loss_below: 0.01, diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "broke");
  ASSERT_NE(r.evidence(), nullptr);
  EXPECT_EQ(r.evidence()->kind, BreakKind::kNonFiniteParams);
  const ExpectationCheck* caused = find_check(r, "fault_caused");
  ASSERT_NE(caused, nullptr) << why(r);
  EXPECT_TRUE(caused->passed);
  EXPECT_NE(caused->observed.find("only with it"), std::string::npos) << caused->observed;
}

// A control whose fault only brings forward what its configuration does within the run anyway
// proves nothing about its fault: SGD at LR 50 leaves the tiny GPT's parameters non-finite from
// step 6 on by itself, and a NaN gradient at step 5 breaks it one step sooner. So the fault-free run
// covers the whole window, not only the steps up to the breakage. Control: the same run in five
// steps, which end before the configuration breaks, passes.
constexpr const char* kSgd50 = R"(
name: t
model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8, dropout: 0.1}
data: {batch: 4}
training: {steps: STEPS, optimizer: sgd, lr: 50, segments: 2}
)";

ScenarioSpec sgd50(int steps, const std::string& extra) {
  std::string text(kSgd50);
  text.replace(text.find("STEPS"), 5, std::to_string(steps));
  return parse_scenario_text(text + extra, "sgd50.yaml");
}

TEST(Verdict, AControlWhoseFaultOnlyBringsTheBreakageForwardDoesNotPass) {
  const std::string nan =
      "injections: [{type: grad_nonfinite, step: 5}]\nexpect: {params_finite: true, diverges: true}\n";
  ScenarioResult r = run_scenario(sgd50(8, nan));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kBrokeWithoutFault) << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kFaultFree);
  EXPECT_EQ(r.counterfactual.last_step, 8);  // the whole window
  ASSERT_FALSE(r.breakage.empty());
  EXPECT_EQ(r.breakage.front().step, 5);
  EXPECT_FALSE(r.breakage.front().counts);
  EXPECT_EQ(r.breakage.front().without_fault_step, 6);
  EXPECT_TRUE(has_reason(r, "got it broke too, 1 step later: parameters non-finite from step 6 on (with the fault: "
                            "parameters non-finite from step 5 on); the configuration breaks it within the run, the "
                            "fault only brought that forward"))
      << why(r);

  r = run_scenario(sgd50(5, nan));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "broke");
  EXPECT_EQ(r.counterfactual.last_step, 5);
  EXPECT_TRUE(r.counterfactual.params_finite);
  EXPECT_TRUE(r.counterfactual.breakage.empty());
}

// A fault that only nudges the final loss across a threshold the run without it sits on proves
// nothing: an LR lowered by 0.1% for one step moves the tiny GPT's final loss in its fifth digit, and
// a threshold between the two losses would make it a control that "broke". A fault that moves the
// final loss less than kFinalLossEdge of the threshold only nudged it across: the run without it
// counts as breaking too. Control: an LR spiked x50, which moves it far past the same threshold,
// passes.
TEST(Verdict, AFaultThatOnlyNudgesTheFinalLossAcrossItsThresholdDoesNotPass) {
  const std::string run = "model: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, vocab: 64, seq_len: 16}\n"
                          "data: {batch: 8, seed: 1}\ntraining: {steps: 8, optimizer: adamw, lr: 0.003, segments: 2}\n";
  auto scenario = [&](const std::string& extra) { return parse_scenario_text(run + extra, "edge.yaml"); };
  RunOptions plain;
  plain.counterfactual = false;
  const double clean = run_scenario(scenario("expect: {final_loss_below: 100}\n"), plain).final_loss;
  const std::string nudge = "injections: [{type: lr_spike, step: 2, factor: 0.999}]\n";
  const double nudged = run_scenario(scenario(nudge + "expect: {final_loss_below: 100}\n"), plain).final_loss;
  ASSERT_NE(clean, nudged);
  const double low = std::min(clean, nudged), high = std::max(clean, nudged);
  ASSERT_LT(high - low, 1e-3 * low) << "the nudge moved the loss by more than 0.1%";
  // The run whose loss is the higher one is the control that "broke"; its fault is the nudge, or
  // the nudge's absence: a nudge that lowers the loss swaps the roles (the LR x1/0.999 then).
  const std::string fault = nudged > clean ? nudge : "injections: [{type: lr_spike, step: 2, factor: 1.001}]\n";
  const std::string threshold =
      "expect: {diverges: true, final_loss_below: " + std::to_string((low + high) / 2) + "}\n";
  ScenarioResult r = run_scenario(scenario(fault + threshold));
  if (nudged > clean) {
    EXPECT_FALSE(r.passed) << why(r);
    EXPECT_EQ(r.outcome_kind(), Outcome::kBrokeWithoutFault) << why(r);
    EXPECT_TRUE(has_reason(r, "from the run with the fault: the fault only nudged it across (with the fault: final "
                              "loss "))
        << why(r);
  }
  r = run_scenario(scenario("injections: [{type: lr_spike, step: 2, factor: 50}]\n" + threshold));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "broke");
}

// A final-loss bound the run without the fault misses by a little, and the fault misses by far (an
// LR spike x20 under SGD that a clip at 1e6 does not touch: 96.5 against 3.46, a bound of 3.4): the
// breakage is the fault's, not the configuration's (red-team finding: 'broke without the fault ...
// the configuration breaks it, not the fault'). A control with the same fault passes. Control: a
// spike of 1.01, which moves the final loss less than the run without it misses by, broke without
// the fault.
TEST(Verdict, AFinalLossTheFaultMadeFarWorseIsTheFaultsThoughTheBoundIsOutOfReachWithoutIt) {
  const std::string run = "model: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, vocab: 64, seq_len: 16}\n"
                          "data: {batch: 8, seed: 1}\ntraining: {steps: 14, optimizer: sgd, lr: 1.0, segments: 2}\n"
                          "defenses: {clip: {mode: global, max_norm: 1.0e6}}\n";
  auto scenario = [&](const std::string& extra) { return parse_scenario_text(run + extra, "worse.yaml"); };
  RunOptions plain;
  plain.counterfactual = false;
  const double clean = run_scenario(scenario("expect: {final_loss_below: 100}\n"), plain).final_loss;
  const std::string bound = std::to_string(clean * 0.99);
  const std::string spike = "injections: [{type: lr_spike, step: 3, duration: 2, factor: 20}]\n";
  ScenarioResult r = run_scenario(scenario(spike + "expect: {params_finite: true, final_loss_below: " + bound + "}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_GT(r.final_loss, 2 * clean) << why(r);
  const ExpectationCheck* caused = find_check(r, "fault_caused");
  ASSERT_NE(caused, nullptr) << why(r);
  EXPECT_TRUE(caused->passed) << why(r);
  EXPECT_NE(caused->observed.find("it broke too, but not so: final loss "), std::string::npos) << why(r);
  EXPECT_NE(caused->observed.find(" with it: the fault made it worse by more than the run without it misses "),
            std::string::npos)
      << why(r);
  r = run_scenario(
      scenario(spike + "expect: {params_finite: true, final_loss_below: " + bound + ", diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.evidence()->kind, BreakKind::kFinalLoss) << why(r);
  r = run_scenario(scenario("injections: [{type: lr_spike, step: 3, factor: 1.01}]\n"
                            "expect: {params_finite: true, final_loss_below: " +
                            bound + "}\n"));
  EXPECT_EQ(r.outcome_kind(), Outcome::kBrokeWithoutFault) << why(r);
  EXPECT_LT(std::abs(r.final_loss - clean), clean * 0.01) << why(r);
}

// The same for a run that held: clipping and skip_nonfinite hold SGD at LR 20 and a NaN gradient at
// step 5, but without them the run breaks at step 8 by itself -- within an eight-step window the
// fault's own bite is not shown (not exercised); within seven steps it is (held).
TEST(Verdict, AHeldScenarioWhoseFaultOnlyBringsTheUndefendedBreakageForwardIsNotExercised) {
  auto spec = [](int steps) {
    ScenarioSpec s = sgd50(steps, "defenses: {skip_nonfinite: true, clip: {mode: global, max_norm: 1}}\n"
                                  "injections: [{type: grad_nonfinite, step: 5}]\nexpect: {params_finite: true}\n");
    s.training.lr = 20;
    return s;
  };
  ScenarioResult r = run_scenario(spec(8));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << why(r);
  EXPECT_FALSE(r.counterfactual.broke);
  ASSERT_FALSE(r.counterfactual.breakage.empty());
  EXPECT_EQ(r.counterfactual.breakage.front().without_fault_step, 8);
  EXPECT_TRUE(has_reason(r, "got broke, but so does it without the fault, 3 steps later: parameters non-finite from "
                            "step 8 on (with the fault: parameters non-finite from step 5 on)"))
      << why(r);

  r = run_scenario(spec(7));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
  EXPECT_TRUE(r.counterfactual.broke);
}

// "held" needs a fault that bites: a low mantissa flip that the undefended run shrugs off gave
// skip_nonfinite nothing to hold -- not exercised, not held. Control: a NaN gradient breaks the
// undefended run (which stops there), and the defended run's "held" stands.
TEST(Verdict, AHeldScenarioWhoseFaultDoesNotBreakTheUndefendedRunIsNotExercised) {
  const std::string skip = "defenses: {skip_nonfinite: true}\n";
  ScenarioResult r = run_scenario(
      with(skip + "injections: [{type: bit_flip, step: 3, target: weights, bit: 2}]\nexpect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_FALSE(r.broke) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kUndefended);
  EXPECT_FALSE(r.counterfactual.broke);
  EXPECT_TRUE(has_reason(r, "fault_bites: expected the run without its defenses (skip_nonfinite) breaks, and not "
                            "without the fault, got held too (steps 1..4"))
      << why(r);
  EXPECT_TRUE(has_reason(r, "would say what breaking means here")) << why(r);
  EXPECT_EQ(ScenarioResult::from_json(r.to_json()).outcome(), "not exercised");

  r = run_scenario(with(skip + "injections: [{type: grad_nonfinite, step: 3}]\nexpect: {params_finite: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
  const ExpectationCheck* bites = find_check(r, "fault_bites");
  ASSERT_NE(bites, nullptr) << why(r);
  EXPECT_TRUE(bites->passed);
  EXPECT_EQ(bites->observed, "broke: parameters non-finite from step 3 on");
  EXPECT_TRUE(r.counterfactual.broke);
  EXPECT_EQ(r.counterfactual.last_step, 3);  // it stopped once the parameters went non-finite
}

// "held" credits the defense with holding the fault: when the run without the defenses breaks
// just as much without the fault, the fault's own bite is not shown. lr-too-high-warmup (Adam at
// LR 0.1, a 10-step warmup) holds its configuration; a harmless flip added to it (the lowest
// mantissa bit of a weight) is not exercised. Control: the scenario without the flip, whose fault
// is its configuration, holds, and its undefended run breaks (fault_bites).
TEST(Verdict, AHeldScenarioWhoseUndefendedRunBreaksWithoutTheFaultTooIsNotExercised) {
  ScenarioSpec spec = load_scenario("builtin:lr-too-high-warmup");
  ScenarioResult r = run_scenario(spec);
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
  const ExpectationCheck* bites = find_check(r, "fault_bites");
  ASSERT_NE(bites, nullptr) << why(r);
  EXPECT_TRUE(bites->passed) << bites->observed;
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kUndefended);

  spec.injections = parse_scenario_text(std::string(kGpt) + "injections: [{type: bit_flip, step: 3, target: weights, "
                                                            "bit: 0}]\n",
                                        "flip.yaml")
                        .injections;
  r = run_scenario(spec);
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << why(r);
  EXPECT_FALSE(r.counterfactual.broke);
  ASSERT_FALSE(r.counterfactual.breakage.empty());
  EXPECT_EQ(r.counterfactual.breakage.front().kind, BreakKind::kFinalLoss);
  EXPECT_FALSE(r.counterfactual.breakage.front().counts);
  EXPECT_GT(r.counterfactual.breakage.front().without_fault_step, 0);
  EXPECT_TRUE(has_reason(r, "got broke, but so does it without the fault: final loss ")) << why(r);
  EXPECT_TRUE(has_reason(r, "the defenses hold the configuration, and this fault's own bite is not shown")) << why(r);
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.outcome(), "not exercised");
  EXPECT_EQ(back.counterfactual.breakage.front().without_fault_step,
            r.counterfactual.breakage.front().without_fault_step);
}

// An undefended run that broke only before the fault fired shows nothing of the fault's bite:
// without preserve_rng_state every recompute with dropout differs from step 1 on, so an
// rng_desync at step 3 (or at step 1, where the run with neither the fault nor the defenses breaks
// the same) is not exercised. Control: the scenario without the injection claims what
// preserve_rng_state holds -- checkpointed dropout, its configuration -- and held, earned.
TEST(Verdict, AnUndefendedRunThatBreaksOnlyBeforeTheFaultShowsNoBite) {
  const std::string expect = "expect: {recompute_bitwise: true}\n";
  ScenarioResult r = run_scenario(with("injections: [{type: rng_desync, step: 3, segment: block0}]\n" + expect));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << why(r);
  EXPECT_TRUE(has_reason(r, "got broke only before the fault at step 3: step 1 applied gradients from a recompute "
                            "that was not bitwise; the defenses hold the configuration"))
      << why(r);

  r = run_scenario(with("injections: [{type: rng_desync, step: 1, segment: block0}]\n" + expect));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << why(r);
  EXPECT_TRUE(has_reason(r, "got broke, but so does it without the fault: step 1 applied gradients")) << why(r);

  r = run_scenario(with(expect));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
  const ExpectationCheck* bites = find_check(r, "fault_bites");
  ASSERT_NE(bites, nullptr) << why(r);
  EXPECT_EQ(bites->observed, "broke: step 1 applied gradients from a recompute that was not bitwise");
}

// Defenses that hold by freezing training held nothing: skip_nonfinite holds a NaN gradient, but
// with the LR scaled by 1e-12 the parameters barely move -- trained fails, against the run with
// neither the fault nor the defenses, and the run broke (training did not go on). Control: the LR
// scaled by 0.1 moves them about a tenth as far, and the run held; and clipping that holds a run
// whose undefended twin runs away (SGD at LR 20, parameters 1e9 times further) trained, having moved
// them far more than 1e-4 of their norm (AHeldScenarioWhoseFaultOnlyBrings... below).
TEST(Verdict, DefensesThatHoldByFreezingTrainingBroke) {
  const std::string rest = "injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true}\n";
  ScenarioResult r = run_scenario(with("defenses: {skip_nonfinite: true, lr_scale: 1.0e-12}\n" + rest));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed);
  EXPECT_TRUE(has_reason(r, "trained: expected after the fault (steps 3..4), the parameters move at least "
                            "0.01 as far as in the run with neither the fault nor the defenses"))
      << why(r);
  EXPECT_EQ(r.param_movement_from, 3);
  ASSERT_FALSE(r.breakage.empty());
  EXPECT_EQ(r.breakage.back().kind, BreakKind::kNoProgress);
  EXPECT_LT(r.param_movement, 1e-9) << why(r);
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.outcome(), "broke");
  EXPECT_EQ(back.param_movement, r.param_movement);
  EXPECT_EQ(back.param_movement_from, 3);

  r = run_scenario(with("defenses: {skip_nonfinite: true, lr_scale: 0.1}\n" + rest));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_TRUE(trained->passed) << trained->observed;
}

// An SGD model of its own for the rules below: what a step moves is all the update there is (no
// momentum, no weight decay), so a step that applies zero gradients moves nothing.
std::string sgd(const std::string& training, const std::string& rest) {
  return "name: t\nmodel: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8, dropout: 0.1}\n"
         "data: {batch: 4}\ntraining: {optimizer: sgd, segments: 2, " +
         training + "}\n" + rest;
}

// Training must go on after the fault (red-team findings), and what moved before it or on its own
// steps says nothing of that. Clipping a gradient whose norm overflows multiplies it by 0: a loss x
// 1e30 on every step from 3 on leaves SGD applying zero gradients (momentum or Adam's moments carry
// the parameters on a while: 'held, ok' on the movement), and such steps are not applied for the
// progress rule. trained measures from the step after the fault's last: an LR scaled by 1e-3 moved
// them 0.007 as far as the run without it; the 1e-4-of-their-norm floor applies only where that run
// runs away. Controls: the same spike on step 3 alone, after which clipping lets training go on,
// held; an LR scaled by 0.1 held.
TEST(Verdict, TrainedIsMeasuredAfterTheFaultAndZeroGradientsTrainNothing) {
  const std::string clip = "defenses: {clip: {mode: global, max_norm: 1.0}}\nexpect: {params_finite: true}\n";
  // Steps 3..8 of 9 zeroed, step 9 applied: 1 of 7 applied.
  for (const char* training : {"steps: 9, lr: 0.1", "steps: 9, lr: 0.1, momentum: 0.9"}) {
    const ScenarioResult r = run_scenario(parse_scenario_text(
        sgd(training, clip + "injections: [{type: loss_spike, step: 3, duration: 6, factor: 1.0e30}]\n"),
        "zeroed.yaml"));
    EXPECT_EQ(r.outcome(), "broke") << training << "\n" << why(r);
    EXPECT_EQ(r.zero_gradient_steps, 6) << why(r);
    EXPECT_TRUE(has_reason(r, "min_applied_steps: expected >= 4 applied of steps 3..9, the last among them, got 1 "
                              "applied (and 6 with a gradient of norm 0, which train nothing)"))
        << why(r);
  }
  ScenarioResult r;
  r = run_scenario(parse_scenario_text(
      sgd("steps: 8, lr: 0.1", clip + "injections: [{type: loss_spike, step: 3, factor: 1.0e30}]\n"), "once.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  EXPECT_EQ(r.zero_gradient_steps, 1);
  EXPECT_EQ(r.param_movement_from, 4);
  ASSERT_NE(find_check(r, "trained"), nullptr) << why(r);

  const std::string spike = "injections: [{type: lr_spike, step: 3, duration: 2, factor: 20}]\n"
                            "expect: {final_loss_below: 4.0, params_finite: true}\n";
  r = run_scenario(parse_scenario_text(sgd("steps: 20, lr: 1.0", "defenses: {lr_scale: 1.0e-3}\n" + spike), "s.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed) << trained->observed;
  EXPECT_GT(r.param_movement, kMovedAtAll) << why(r);  // the floor alone would have passed it
  // (An LR scaled by 0.1 had been this control: the run with it and without the spike falls 4% of
  // its level, and the loss bar's verdict is "could not tell".)
  r = run_scenario(parse_scenario_text(sgd("steps: 20, lr: 1.0", "defenses: {lr_scale: 0.5}\n" + spike), "s.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_TRUE(trained->passed) << trained->observed;
}

// A final window the defenses skipped whole has no final loss: final_loss_below and loss_finite fail
// there, but nothing broke (red-team finding: a NaN gradient on the last step, skipped as it should
// be, made the run "broke"); the run is not exercised, no step after the fault showing training go
// on. Control: a final window with an applied step above final_loss_below is breakage.
TEST(Verdict, AFinalWindowTheDefensesSkippedWholeBrokeNothing) {
  const std::string skip = "defenses: {skip_nonfinite: true}\n";
  ScenarioResult r = run_scenario(with(
      skip + "injections: [{type: grad_nonfinite, step: 4}]\nexpect: {final_loss_below: 10, loss_finite: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_FALSE(r.broke) << why(r);
  EXPECT_EQ(r.outcome(), "not exercised") << why(r);
  EXPECT_TRUE(has_reason(r, "final_loss_below: expected < 10 (steps 4..4), got no applied step in steps 4..4"))
      << why(r);
  EXPECT_TRUE(has_reason(r, "step_after_fault")) << why(r);

  r = run_scenario(with(skip + "injections: [{type: grad_nonfinite, step: 3}]\nexpect: {final_loss_below: 0.01}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(r.broke || r.outcome_kind() == Outcome::kBrokeWithoutFault) << why(r);
  EXPECT_NE(r.outcome(), "not exercised") << why(r);
}

// A loss the fault left above twice the untrained model's held nothing, however few steps follow it
// (red-team finding: SGD at lr 1, a loss x 1e10 clipped at 1e6, 1e10 over the last five of eight
// steps, too few for the loss bar: "held, ok" on the parameters' movement alone). Controls: clipping
// at 1.0 holds (the loss comes back under the bar), and the rule is said where it held.
TEST(Verdict, ALossLeftAboveTwiceTheUntrainedModelsHeldNothingInAShortRun) {
  const std::string sgd =
      "name: t\nmodel: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16}\n"
      "data: {batch: 8, seed: 1}\ntraining: {steps: 8, optimizer: sgd, lr: 1.0, segments: 2}\n"
      "injections: [{type: loss_spike, step: 3, factor: 1.0e10}]\nexpect: {params_finite: true, loss_finite: true}\n";
  ScenarioResult r =
      run_scenario(parse_scenario_text(sgd + "defenses: {clip: {mode: global, max_norm: 1.0e6}}\n", "clip1e6.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed) << why(r);
  EXPECT_NE(trained->observed.find("2 times the untrained model's"), std::string::npos) << trained->observed;
  EXPECT_NE(trained->observed.find("its loss not weighed: 5 step(s) after the fault"), std::string::npos)
      << trained->observed;
  ASSERT_FALSE(r.breakage.empty()) << why(r);
  EXPECT_EQ(r.breakage.back().kind, BreakKind::kNoProgress);
  EXPECT_NE(r.breakage.back().detail.find("its loss ran away: its loss ends at"), std::string::npos)
      << r.breakage.back().detail;

  r = run_scenario(parse_scenario_text(sgd + "defenses: {clip: {mode: global, max_norm: 1.0}}\n", "clip1.yaml"));
  EXPECT_EQ(r.outcome(), "held") << why(r);
  EXPECT_TRUE(r.passed) << why(r);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_NE(trained->expected.find("its loss ends at most 2 times that run's on its first step"), std::string::npos)
      << trained->expected;
  EXPECT_EQ(trained->observed.find("untrained"), std::string::npos) << trained->observed;
}

// The runaway bar against outsider attacks on it (red15): the configuration as the fault, and an
// untrained loss that one easy batch made tiny.
TEST(Verdict, TheRunawayBarHoldsWhereTheConfigurationIsTheFaultAndAgainstANoisyFirstBatch) {
  // SGD at LR 50 without injections, clipped at 10: the loss ends at 3e4 from 4.3. The run without
  // the defenses is the fault itself (non-finite early): it had exempted the run, "held, ok".
  const std::string gpt = "model: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16}\n"
                          "data: {batch: 8, seed: 1}\n";
  ScenarioResult r = run_scenario(parse_scenario_text(
      "name: lr50\n" + gpt +
          "training: {steps: 12, optimizer: sgd, lr: 50, segments: 1}\ndefenses: {clip: {mode: global, "
          "max_norm: 10.0}}\nexpect: {params_finite: true}\n",
      "lr50.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_NE(trained->observed.find("(step 1 of the run without the defenses): the fault's damage stands"),
            std::string::npos)
      << trained->observed;
  // Adam at LR 1 with a warmup of 2, no injections: the run without the defenses ends at 61 from 4.4.
  // It held by its own rules and fault_bites had said "held too": it ran away, and broke.
  r = run_scenario(parse_scenario_text(
      "name: adam1\nmodel: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: "
      "0.1}\ndata: {batch: 8, seed: 1}\ntraining: {steps: 20, optimizer: adam, lr: 1.0, segments: 2}\n"
      "defenses: {warmup_steps: 2}\nexpect: {params_finite: true}\n",
      "adam1.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* bites = find_check(r, "fault_bites");
  ASSERT_NE(bites, nullptr) << why(r);
  EXPECT_TRUE(bites->passed) << why(r);
  EXPECT_NE(bites->observed.find("broke: training did not go on: its loss ran away"), std::string::npos)
      << bites->observed;
  // An MLP on batches of 2 whose first batch is easy (L0 0.0057; the run without the fault ends at
  // 0.6 on the same batches): a loss x 1e10 clipped at 100 ends at 9e4. That run ending above twice
  // L0 had exempted it as "the configuration running away"; now it must also end within twice
  // where that run ends.
  const std::string mlp = "name: mlp\nmodel: {type: mlp, layers: 2, hidden: 32, in_features: 4, out_features: 1, "
                          "dropout: 0.0}\ndata: {batch: 2, seed: 30}\ntraining: {steps: 8, optimizer: sgd, lr: 0.1, "
                          "segments: 1}\ninjections: [{type: loss_spike, step: 3, factor: 1.0e10}]\n"
                          "expect: {params_finite: true, loss_finite: true}\n";
  r = run_scenario(parse_scenario_text(mlp + "defenses: {clip: {mode: global, max_norm: 100}}\n", "mlp.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_NE(trained->observed.find("times where that run ends over the same steps"), std::string::npos)
      << trained->observed;
  // Control: clipped at 1.0 the same run holds (its end within twice that run's, though above 2 L0).
  r = run_scenario(parse_scenario_text(mlp + "defenses: {clip: {mode: global, max_norm: 1.0}}\n", "mlp1.yaml"));
  EXPECT_EQ(r.outcome(), "held") << why(r);
  EXPECT_TRUE(r.passed) << why(r);
}

// A defended run whose loss ends behind the run with neither the fault nor the defenses, though
// neither rule of the loss bar says stalled, is weighed against the run with its defenses and
// without the fault (red-team finding: a clip at 1e-6 beside a weight decay drifted the loss to
// chance, 4.16 = ln 64, while the run with neither reached 3.88 from 4.18 -- 7% of its level, "not
// learning" by the loss bar -- and it "held, ok"): there the defenses alone stop training, and the
// verdict is not earned. Control: a clip that lets the model learn held.
TEST(Verdict, ARunBehindTheRunWithNeitherIsWeighedAgainstItsDefensesWithoutTheFault) {
  const std::string sgd =
      "name: t\nmodel: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1}\n"
      "data: {batch: 8, seed: 1}\ntraining: {steps: 30, optimizer: sgd, lr: 1.0, weight_decay: 0.05, segments: 2}\n"
      "injections: [{type: loss_spike, step: 3, factor: 1.0e10}]\nexpect: {params_finite: true, loss_finite: true}\n";
  ScenarioResult r =
      run_scenario(parse_scenario_text(sgd + "defenses: {clip: {mode: global, max_norm: 1.0e-6}}\n", "clip1e-6.yaml"));
  EXPECT_FALSE(r.passed) << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed) << why(r);
  EXPECT_NE(trained->observed.find("where without the fault it ends at"), std::string::npos) << trained->observed;
  EXPECT_NE(trained->observed.find("could not tell: with its defenses and without the fault"), std::string::npos)
      << trained->observed;
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kUndefended);

  r = run_scenario(parse_scenario_text(sgd + "defenses: {clip: {mode: global, max_norm: 1.0}}\n", "clip1.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
}

// A fault whose numbers stay in the optimizer's state holds nothing, though the parameters stay
// finite and move (red-team finding: "held, ok"): a loss x 1e18 at step 3, unclipped, leaves
// AdamW's second moment 1e32 times the run's without it, its updates scaled down for ~1000 steps,
// while the spike's momentum and the weight decay still move the parameters about half as far.
// Measured per tensor, on its median magnitude against the same tensor's: one flipped element of
// 2048 stalls that element only (EveryInjectionEntryMustFireNotJustOneOfItsType's control).
// Controls: clipping the same spike holds it, and the undefended run it is weighed against breaks
// by the same rule (fault_bites); a spike of x10 leaves the state as it was and held.
TEST(Verdict, AFaultThatSaturatesTheOptimizersStateHeldNothing) {
  const std::string gpt =
      "name: t\nmodel: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8}\n"
      "data: {batch: 4}\nexpect: {params_finite: true}\ntraining: {steps: 40, optimizer: adamw, lr: 0.003, "
      "segments: 2";
  const std::string spike = "injections: [{type: loss_spike, step: 3, factor: 1.0e18}]\n";
  ScenarioResult r = run_scenario(parse_scenario_text(gpt + "}\n" + spike, "saturated.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_FALSE(r.passed) << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed) << trained->observed;
  EXPECT_NE(trained->observed.find("exp_avg_sq' ends with a median magnitude of "), std::string::npos)
      << trained->observed;
  EXPECT_FALSE(r.optimizer_state_scale.empty());
  EXPECT_GT(r.param_movement, 0.1 * r.counterfactual.param_movement) << why(r);  // movement alone passes it
  ASSERT_FALSE(r.breakage.empty()) << why(r);
  EXPECT_EQ(r.breakage.back().kind, BreakKind::kNoProgress);
  EXPECT_EQ(ScenarioResult::from_json(r.to_json()).to_json(), r.to_json());

  r = run_scenario(parse_scenario_text(gpt + ", clip_grad_norm: 1.0}\n" + spike, "clipped.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kUndefended);
  EXPECT_TRUE(r.counterfactual.broke) << why(r);
  ASSERT_NE(find_check(r, "fault_bites"), nullptr) << why(r);
  EXPECT_NE(find_check(r, "fault_bites")->observed.find("broke: training did not go on: its optimizer's state"),
            std::string::npos)
      << why(r);

  // Outsider findings: the default spike of x1e4 leaves the second moment ~1e6 times larger (its
  // largest element was measured against the other run's largest, a first moment: 5e3 times, "held");
  // a model initialised small moves more than its norm training as it should, which exempted it
  // ("held", beside fault_bites' "broke" of the same run).
  r = run_scenario(parse_scenario_text(
      "name: t\nmodel: {type: tiny_gpt, layers: 1, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.0}\n"
      "data: {batch: 8, seed: 1}\ntraining: {steps: 60, optimizer: adamw, lr: 0.003}\n"
      "injections: [{type: loss_spike, step: 3, factor: 1.0e4}]\nexpect: {params_finite: true}\n",
      "x1e4.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  r = run_scenario(parse_scenario_text(
      "name: t\nmodel: {type: mlp, layers: 2, hidden: 32, in_features: 16, out_features: 4, dropout: 0.0, "
      "init_gain: 0.001}\ndata: {batch: 64, seed: 1}\ntraining: {steps: 40, optimizer: adamw, lr: 0.02}\n"
      "defenses: {skip_nonfinite: true}\ninjections: [{type: loss_spike, step: 2, factor: 1.0e18}]\n"
      "expect: {params_finite: true}\n",
      "small-init.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_GT(r.counterfactual.param_movement, kRunsAway) << why(r);

  r = run_scenario(
      parse_scenario_text(gpt + "}\ninjections: [{type: loss_spike, step: 3, factor: 10.0}]\n", "small.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  ASSERT_NE(find_check(r, "trained"), nullptr) << why(r);
}

// A configuration that does not train shows no defense holding, whatever the run without the fault
// and the defenses did: an LR of 0 moved the parameters 0 in both runs (the check was skipped), a
// loss weighted 1e-30 moved them 4e-34 against 5e-34 (it passed, a ratio of 0.88). Both are below
// float32's relative precision. Control: the same at LR 0.003 held.
TEST(Verdict, AConfigurationThatDoesNotTrainHeldNothing) {
  const std::string rest = "defenses: {skip_nonfinite: true}\ninjections: [{type: grad_nonfinite, step: 2}]\n"
                           "expect: {params_finite: true}\n";
  ScenarioResult f = run_scenario(parse_scenario_text(sgd("steps: 5, lr: 0.0", rest), "frozen.yaml"));
  EXPECT_EQ(f.outcome(), "broke") << why(f);
  const ExpectationCheck* trained = find_check(f, "trained");
  ASSERT_NE(trained, nullptr) << why(f);
  EXPECT_FALSE(trained->passed) << trained->observed;
  EXPECT_EQ(f.param_movement, 0.0);
  // A loss weighted 1e-30: its gradients underflow to norm 0, steps that train nothing.
  f = run_scenario(parse_scenario_text(sgd("steps: 5, lr: 0.1, loss_weight: 1.0e-30", rest), "frozen.yaml"));
  EXPECT_EQ(f.outcome(), "broke") << why(f);
  EXPECT_EQ(f.applied_from_fault, 0) << why(f);
  const ScenarioResult r = run_scenario(parse_scenario_text(sgd("steps: 5, lr: 0.1", rest), "trains.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
}

// A model that holds its fault without defenses must train on after it, and keep its optimizer's
// state finite: a loss x 1e30 leaves AdamW's second moments infinite, every later update of their
// parameters 0 (red-team finding: 'held, ok', no check). The run without the fault is its
// counterfactual (bare). Control: a mantissa flip of a weight, which the model holds, passes with
// trained weighed; a scenario with neither fault nor defenses runs none and says why.
TEST(Verdict, AModelThatHoldsWithoutDefensesMustTrainOnAndKeepItsOptimizerStateFinite) {
  ScenarioResult r =
      run_scenario(with("injections: [{type: loss_spike, step: 2, factor: 1.0e30}]\nexpect: {params_finite: true}\n"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_EQ(r.nonfinite_state_kind, TensorKind::kOptimizerState);
  EXPECT_NE(r.nonfinite_state.find("exp_avg_sq"), std::string::npos) << r.nonfinite_state;
  EXPECT_TRUE(has_reason(r, "optimizer state non-finite at the end")) << why(r);
  EXPECT_TRUE(r.params_finite);
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.nonfinite_state_kind, TensorKind::kOptimizerState);
  EXPECT_EQ(back.nonfinite_state, r.nonfinite_state);

  r = run_scenario(with("injections: [{type: bit_flip, step: 2, target: weights, bit: 2}]\n"
                        "expect: {params_finite: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.nonfinite_state, "");
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kBare);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_TRUE(trained->passed) << trained->observed;
  r = run_scenario(with("expect: {params_finite: true}\n"));
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kNone);
  EXPECT_NE(r.counterfactual.why_not.find("no defenses to take away and no fault"), std::string::npos);
}

// A control whose final window its defenses skipped whole has no final loss: that is the defense
// refusing the fault's batches, not the fault raising the loss (red-team finding: validated
// corrupt batches on the last steps passed as 'broke, ok: final loss nan'). Control: expecting to
// hold, the same run with final_loss_below broke (training did not go on to the end).
// A model that holds its fault without defenses must also learn on after it (red-team finding): an
// unclipped loss x 300 at step 3 under Adam leaves its second moment ~100 times larger, below the
// saturation bar; the parameters still move 0.36 as far as without the fault, but the loss falls
// 4.11 -> 3.85 over steps 4..60 against 3.99 -> 2.23 without it, 0.15 as far: "held, ok". The
// run without the fault is the same configuration, so the slowing is the fault's. Controls: x 3
// learns on (0.95 as far) and held; a window shorter than kLossFallSteps is not weighed by the loss.
TEST(Verdict, AModelWhoseLossStallsAfterItsFaultHeldNothing) {
  const auto spiked = [](double factor, int steps) {
    return run_scenario(parse_scenario_text(
        "name: t\nmodel: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.0}\n"
        "data: {batch: 8, seed: 1}\ntraining: {steps: " +
            std::to_string(steps) +
            ", optimizer: adam, lr: 0.003, segments: 0}\n"
            "injections: [{type: loss_spike, step: 3, factor: " +
            std::to_string(factor) + "}]\nexpect: {params_finite: true, loss_finite: true}\n",
        "t.yaml"));
  };
  ScenarioResult r = spiked(300, 60);
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed);
  EXPECT_NE(trained->observed.find("; over steps 4..60 its loss fell "), std::string::npos) << trained->observed;
  EXPECT_GT(r.param_movement, kTrainedFraction * r.counterfactual.param_movement) << why(r);  // moved enough
  ASSERT_FALSE(r.breakage.empty());
  EXPECT_EQ(r.breakage.back().kind, BreakKind::kNoProgress);
  EXPECT_EQ(r.breakage.back().detail.rfind("training did not go on: its loss stalled: over steps 4..60", 0), 0u)
      << r.breakage.back().detail;

  r = spiked(3, 60);
  EXPECT_TRUE(r.passed) << why(r);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_TRUE(trained->passed) << trained->observed;
  // Steps 4..12: nine steps, too few to weigh a loss by.
  r = spiked(300, 12);
  EXPECT_TRUE(r.passed) << why(r);

  // A second, harmless injection late in the run moves trained's movement window to its last five
  // steps, but not the loss bar's (red-team finding: "held"); the step it fired on is left out.
  r = run_scenario(parse_scenario_text(
      "name: t\nmodel: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.0}\n"
      "data: {batch: 8, seed: 1}\ntraining: {steps: 60, optimizer: adam, lr: 0.003, segments: 0}\n"
      "injections: [{type: loss_spike, step: 4, factor: 300}, {type: loss_spike, step: 55, factor: 1.5}]\n"
      "expect: {params_finite: true, loss_finite: true}\n",
      "t.yaml"));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_EQ(r.param_movement_from, 56);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_NE(trained->observed.find("; over steps 5..60 its loss fell "), std::string::npos) << trained->observed;
  EXPECT_NE(trained->observed.find("injected steps left out"), std::string::npos) << trained->observed;

  // A fault that trains faster (an LR x 10 on an MLP's steps 2..25) leaves the run ahead, with less
  // to fall after it: 0.12 as far, but below the run without it all along (red-team finding:
  // "broke"). Not a stall.
  r = run_scenario(parse_scenario_text(
      "name: t\nmodel: {type: mlp, layers: 2, hidden: 32, in_features: 16, out_features: 4, dropout: 0.0}\n"
      "data: {batch: 16, seed: 1}\ntraining: {steps: 60, optimizer: adam, lr: 0.001, segments: 0}\n"
      "injections: [{type: lr_spike, step: 2, duration: 24, factor: 10}]\n"
      "expect: {params_finite: true, loss_finite: true}\n",
      "t.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_LT(r.final_loss, r.counterfactual.final_loss) << why(r);
}

// The same stall behind a defense: a clip at 1e6 lets the x 300 spike through, and the loss stalls
// as without defenses. Against the run with neither the fault nor the defenses the loss fell 0.15
// as far; a defense may slow training by design, so the run with its defenses and without the
// fault decides: here it learns, and the fault stalled the run (broke). Controls: clipping at 1.0
// holds it (and the undefended run's stall is the fault's bite: held, earned); an LR scaled by 0.15
// beside that clip over 100 steps falls less far than the run with neither, as far as the run with
// its defenses and without the fault does: held. But an LR scaled by 0.1 over 60 steps all but
// stops training without the fault too (its loss falls 5% of its level against 44% without the
// defenses), and the fault changing nothing beside it shows nothing held: the verdict is not earned
// (it had been "held, ok" -- red-team finding: a clip at 1e-6 with weight decay, which stops
// training, held a loss spike).
TEST(Verdict, ADefenseThatLetsTheFaultStallTheLossHeldNothing) {
  const auto defended = [](const std::string& defenses, int steps = 60) {
    return run_scenario(parse_scenario_text(
        "name: t\nmodel: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.0}\n"
        "data: {batch: 8, seed: 1}\ntraining: {steps: " +
            std::to_string(steps) +
            ", optimizer: adam, lr: 0.003, segments: 0}\n"
            "injections: [{type: loss_spike, step: 3, factor: 300}]\nexpect: {params_finite: true, loss_finite: true}\n"
            "defenses: " +
            defenses + "\n",
        "t.yaml"));
  };
  ScenarioResult r = defended("{clip: {mode: global, max_norm: 1.0e6}}");
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed);
  EXPECT_NE(trained->observed.find("; over steps 4..60 its loss fell "), std::string::npos) << trained->observed;
  EXPECT_NE(trained->observed.find(" (with its defenses)"), std::string::npos) << trained->observed;
  ASSERT_FALSE(r.breakage.empty());
  EXPECT_EQ(r.breakage.back().kind, BreakKind::kNoProgress);
  const ExpectationCheck* bites = find_check(r, "fault_bites");
  ASSERT_NE(bites, nullptr) << why(r);
  EXPECT_TRUE(bites->passed);
  EXPECT_EQ(bites->observed.rfind("broke: training did not go on: its loss stalled: over steps 4..60", 0), 0u)
      << bites->observed;

  r = defended("{clip: {mode: global, max_norm: 1.0}}");
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_EQ(trained->observed.find("its loss"), std::string::npos) << trained->observed;  // no third run

  r = defended("{clip: {mode: global, max_norm: 1.0}, lr_scale: 0.15}", 100);
  EXPECT_TRUE(r.passed) << why(r);
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_NE(trained->observed.find("; against that run over steps 4..100 its loss fell "), std::string::npos)
      << trained->observed;  // the bare run's numbers, in the evidence
  EXPECT_NE(
      trained->observed.find("; its loss fell at least 0.25 as far as the run's with its defenses and without the "
                             "fault"),
      std::string::npos)
      << trained->observed;

  r = defended("{clip: {mode: global, max_norm: 1.0}, lr_scale: 0.1}");
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);  // nothing shown broken either
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed);
  EXPECT_NE(trained->observed.find("; could not tell: with its defenses and without the fault its loss fell 0.22"),
            std::string::npos)
      << trained->observed;
  EXPECT_TRUE(has_reason(r, "the defenses alone (all but) stop training")) << why(r);
}

// The level reached, where the window's fall cannot tell: the run with neither the fault nor the
// defenses has come down from 0.38 to ~0.05 by the late fault (step 30 of 60) and falls little
// more, while an LR scaled by 0.01 keeps the defended run at ~0.42 from step 1 on, its noise
// falling about as far over steps 31..60 (red-team finding: "held, ok" for a classifier kept at
// chance). Against that run it stalled by its level; the run with its defenses and without the
// fault sits there too: not earned. Control: the same skip without the LR scale holds, earned.
TEST(Verdict, ARunKeptAtItsStartingLossBesideAConvergedRunHeldNothing) {
  const auto run = [](const std::string& lr_scale) {
    return run_scenario(parse_scenario_text(
        "name: lv\nmodel: {type: mlp, layers: 2, hidden: 32, in_features: 16, out_features: 4, dropout: 0.0}\n"
        "data: {batch: 16, seed: 1}\ntraining: {steps: 60, optimizer: adam, lr: 0.01, segments: 0}\n"
        "injections: [{type: grad_nonfinite, step: 30}]\ndefenses: {skip_nonfinite: true, lr_scale: " +
            lr_scale + "}\nexpect: {params_finite: true, loss_finite: true}\n",
        "lv.yaml"));
  };
  ScenarioResult r = run("0.01");
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_NE(trained->observed.find("; against that run over steps 31..60 its loss ends at 0.41"), std::string::npos)
      << trained->observed;
  EXPECT_NE(trained->observed.find(", where without the fault it ends at 0.05"), std::string::npos)
      << trained->observed;
  EXPECT_NE(trained->observed.find("less than 0.25 of that way down; could not tell: "), std::string::npos)
      << trained->observed;
  r = run("1");
  EXPECT_TRUE(r.passed) << why(r);
}

TEST(Verdict, AControlWhoseDefensesSkippedTheWholeFinalWindowHasNoFinalLossBreakage) {
  const std::string rest =
      "defenses: {validate_batch: true}\ninjections: [{type: corrupt_batch, step: 2, duration: 3}]\n";
  ScenarioResult r = run_scenario(with(rest + "expect: {final_loss_below: 10.0, diverges: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  ASSERT_FALSE(r.breakage.empty()) << why(r);
  EXPECT_FALSE(r.breakage.front().counts);
  EXPECT_NE(r.breakage.front().detail.find("no applied step in steps 2..4 to take a final loss from"),
            std::string::npos)
      << r.breakage.front().detail;
  // A scenario expecting to hold: no breakage either (it had been "broke"): the fault lasts to the
  // end, and no step after it shows anything.
  r = run_scenario(with(rest + "expect: {final_loss_below: 10.0, min_applied_steps: 0}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "not exercised") << why(r);
  EXPECT_TRUE(has_reason(r, "step_after_fault")) << why(r);
}

// A run that expected to hold and broke is weighed against the run without its injections (its
// defenses kept): a final_loss_below out of reach without the fault too is the configuration's, not
// a defense failing (outsider finding: "broke", with no counterfactual run and without_fault_step 0
// reading as "not without the fault"). Control: a NaN gradient that clipping cannot stop broke by
// the fault, and fault_caused says the run without it did not break.
TEST(Verdict, AHeldScenarioThatBrokeIsWeighedAgainstTheRunWithoutItsFault) {
  const std::string clip = "defenses: {clip: {mode: global, max_norm: 1.0}}\n";
  ScenarioResult r = run_scenario(with(clip + "injections: [{type: loss_spike, step: 2, factor: 10}]\n"
                                              "expect: {final_loss_below: 0.5, params_finite: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kBrokeWithoutFault) << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kFaultFree);
  EXPECT_TRUE(has_reason(r, "fault_caused: expected the run without its injections does not break so within the "
                            "run, got it broke too: final loss"))
      << why(r);
  ASSERT_FALSE(r.breakage.empty());
  EXPECT_GT(r.breakage.front().without_fault_step, 0);

  r = run_scenario(with(clip + "injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true}\n"));
  EXPECT_EQ(r.outcome_kind(), Outcome::kBroke) << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kFaultFree);
  const ExpectationCheck* caused = find_check(r, "fault_caused");
  ASSERT_NE(caused, nullptr) << why(r);
  EXPECT_TRUE(caused->passed) << caused->observed;
}

// Holding by raising is a defense refusing to go on (DefenseRefusal: clip.error_if_nonfinite), and
// a control never breaks by one. An out-of-range token makes the embedding raise with or without
// skip_nonfinite, or without any defense: the fault crashed the run (red-team finding: with no
// defense that was 'held, ok'). grad-inf-clip-error's raise is its clipping's: held; claimed as a
// control, it fails (red-team finding: 'broke, ok' on the defense's own refusal).
TEST(Verdict, AHeldRaiseMustBeADefensesRefusalAndAControlsMustNot) {
  for (const std::string defenses : {"defenses: {skip_nonfinite: true}\n", ""}) {
    const ScenarioResult r = run_scenario(
        with(defenses + "injections: [{type: corrupt_batch, step: 2}]\nexpect: {params_finite: true, raises: true}\n"));
    EXPECT_FALSE(r.passed) << why(r);
    EXPECT_TRUE(r.raised);
    EXPECT_FALSE(r.raised_by_defense);
    EXPECT_EQ(r.outcome(), "broke") << defenses << why(r);
    EXPECT_TRUE(has_reason(r, "raises: expected true, got raised: index out of range in self -- not a defense's "
                              "refusal (retrace::DefenseRefusal): the fault crashed the run"))
        << why(r);
  }
  ScenarioSpec clip = load_scenario("builtin:grad-inf-clip-error");
  ScenarioResult r = run_scenario(clip);
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held");
  EXPECT_TRUE(r.raised_by_defense);
  EXPECT_TRUE(ScenarioResult::from_json(r.to_json()).raised_by_defense);
  const ExpectationCheck* bites = find_check(r, "fault_bites");
  ASSERT_NE(bites, nullptr) << why(r);
  EXPECT_TRUE(bites->passed) << bites->observed;
  clip.expect.diverges = true;
  r = run_scenario(clip);
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_NE(r.outcome(), "broke") << why(r);
  EXPECT_TRUE(has_reason(r, "a defense's refusal (DefenseRefusal): the defense held the fault, which a control "
                            "must break through"))
      << why(r);
}

TEST(Verdict, AScenarioWithoutDefensesOrWithTheCounterfactualOffRunsNone) {
  const std::string flip = "injections: [{type: bit_flip, step: 3, target: weights, bit: 2}]\n";
  ScenarioResult r = run_scenario(with(flip + "expect: {params_finite: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kBare);  // for trained only
  EXPECT_EQ(find_check(r, "fault_bites"), nullptr);
  RunOptions off;
  off.counterfactual = false;
  r = run_scenario(with("defenses: {skip_nonfinite: true}\n" + flip + "expect: {params_finite: true}\n"), off);
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.counterfactual.kind, CounterfactualKind::kNone);
  EXPECT_EQ(find_check(r, "fault_bites"), nullptr);
}

// --- the outcome says what the run did, the verdict what that proves ---------------------------

// A scenario expecting to hold whose fault or defense never acted did not break: its outcome is
// "not exercised" (and the verdict FAILED), not "broke". Controls: the same fault acting on an
// undefended run broke; a defense that acted more than allowed (max_skipped_steps) held and failed.
TEST(Verdict, AHeldScenarioWhoseFaultOrDefenseNeverActedIsNotExercised) {
  const std::string skip = "defenses: {skip_nonfinite: true}\n";
  const struct {
    std::string text;
    std::string failed_check;
  } idle[] = {
      // the learning-rate spike is due on a step the defense skipped (the NaN gradient's)
      {skip + "injections: [{type: grad_nonfinite, step: 3}, {type: lr_spike, step: 3, factor: 1.0e6}]\n"
              "expect: {params_finite: true}\n",
       "injection_fired"},
      // no fault, and the defense was expected to skip
      {skip + "expect: {params_finite: true, min_skipped_steps: 1}\n", "min_skipped_steps"},
      // a raise expected (clipping refusing an infinite norm) that never came: no fault
      {"defenses: {clip: {max_norm: 1.0, error_if_nonfinite: true}}\nexpect: {raises: true}\n", "raises"},
  };
  for (const auto& c : idle) {
    const ScenarioResult r = run_scenario(with(c.text));
    EXPECT_FALSE(r.passed) << c.text << why(r);
    EXPECT_FALSE(r.broke) << c.text << why(r);
    EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << c.text << why(r);
    EXPECT_EQ(r.outcome(), "not exercised");
    EXPECT_EQ(ScenarioResult::from_json(r.to_json()).outcome(), "not exercised");
    const ExpectationCheck* failed = find_check(r, c.failed_check);
    ASSERT_NE(failed, nullptr) << c.text << why(r);
    EXPECT_FALSE(failed->passed);
  }
  // Control: the fault acts and nothing defends: broke.
  ScenarioResult r =
      run_scenario(with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true}\n"));
  EXPECT_TRUE(r.broke) << why(r);
  EXPECT_EQ(r.outcome(), "broke");
  EXPECT_EQ(ScenarioResult::from_json(r.to_json()).outcome(), "broke");
  // Control: a defense that skipped more than allowed held the run, and failed its expectation.
  r = run_scenario(with(
      skip + "injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true, max_skipped_steps: 0}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "max_skipped_steps: expected <= 0, got 1")) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  // Control: the raise it asked for, with another message: broke.
  r = run_scenario(with("defenses: {clip: {max_norm: 1.0, error_if_nonfinite: true}}\n"
                        "injections: [{type: grad_nonfinite, step: 2, mode: inf}]\n"
                        "expect: {raises: true, raises_match: 'no such message'}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(r.raised);
  EXPECT_EQ(r.outcome(), "broke") << why(r);
}

// --- "held" means training went on -----------------------------------------------------------

TEST(Verdict, HeldNeedsTrainingToGoOnAfterTheFault) {
  // Recompute verification without preserved RNG state skips every step: nothing wrong is
  // applied, and nothing at all is.
  const std::string run = "defenses: {preserve_rng_state: false, verify_recompute: true}\n";
  ScenarioResult r = run_scenario(with(run + "expect: {recompute_bitwise: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  const ExpectationCheck* c = find_check(r, "min_applied_steps");
  ASSERT_NE(c, nullptr) << why(r);
  EXPECT_FALSE(c->passed);
  EXPECT_EQ(c->observed, "0 applied, the last skipped");
  // An explicit min_applied_steps replaces the default rule (here: asks for none).
  r = run_scenario(with(run + "expect: {recompute_bitwise: true, min_applied_steps: 0}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  // As a control, stopping training is evidence when the control asks for progress.
  r = run_scenario(with(run + "expect: {min_applied_steps: 2, diverges: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.evidence()->kind, BreakKind::kNoProgress);
}

TEST(Verdict, TheLastStepMustBeApplied) {
  // An exponent flip of a weight at step 3 leaves it huge: skip_nonfinite skips step 3 and every
  // step after it (skipping does not mend the weight). None of steps 3..4 applied, the last skipped.
  ScenarioResult r = run_scenario(with("defenses: {skip_nonfinite: true}\n"
                                       "injections: [{type: bit_flip, target: weights, bit: 30, step: 3}]\n"
                                       "expect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(r.broke) << why(r);
  EXPECT_EQ(r.applied_from_fault, 0);
  EXPECT_FALSE(r.last_step_applied);
  const ExpectationCheck* c = find_check(r, "min_applied_steps");
  ASSERT_NE(c, nullptr) << why(r);
  EXPECT_EQ(c->observed, "0 applied, the last skipped") << why(r);
  // Control: one NaN gradient skipped at step 3, step 4 applied: held.
  r = run_scenario(with("defenses: {skip_nonfinite: true}\n"
                        "injections: [{type: grad_nonfinite, step: 3}]\nexpect: {params_finite: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.applied_from_fault, 1);
}

TEST(Verdict, AFaultDueOnTheLastStepLeavesNoStepToShowTrainingGoingOn) {
  // A NaN gradient at step 4 of 4, skipped: the defense did what it should on that step, but a
  // defense that skips it and every later step for good would look the same. Neither held nor
  // broke (the progress rule, "the last applied", does not speak): not exercised.
  for (const std::string fault : {"{type: grad_nonfinite, step: 4}", "{type: grad_nonfinite, step: 3, duration: 2}"}) {
    const ScenarioResult r = run_scenario(
        with("defenses: {skip_nonfinite: true}\ninjections: [" + fault + "]\nexpect: {params_finite: true}\n"));
    EXPECT_FALSE(r.passed) << fault << why(r);
    EXPECT_FALSE(r.broke) << fault << why(r);
    EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << fault << why(r);
    EXPECT_EQ(r.fault_last_step, 4);
    EXPECT_EQ(find_check(r, "min_applied_steps"), nullptr) << fault << why(r);
    const ExpectationCheck* c = find_check(r, "step_after_fault");
    ASSERT_NE(c, nullptr) << fault << why(r);
    EXPECT_FALSE(c->passed);
    EXPECT_EQ(c->observed,
              "none: the run ends on step 4, which an injection is due on; make training.steps larger than 4, or "
              "end the injection before the run's last step");
    EXPECT_EQ(ScenarioResult::from_json(r.to_json()).fault_last_step, 4);
  }
  // Control: one more step, and the same fault held, earned.
  ScenarioSpec five = with("defenses: {skip_nonfinite: true}\ninjections: [{type: grad_nonfinite, step: 4}]\n"
                           "expect: {params_finite: true}\n");
  five.training.steps = 5;
  const ScenarioResult r = run_scenario(five);
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(find_check(r, "step_after_fault"), nullptr) << why(r);
  EXPECT_EQ(r.param_movement_from, 5);
  // A control (diverges) is judged by its breakage, which a fault on its last step can show.
  const ScenarioResult control = run_scenario(
      with("injections: [{type: grad_nonfinite, step: 4}]\nexpect: {params_finite: true, diverges: true}\n"));
  EXPECT_TRUE(control.passed) << why(control);
  EXPECT_EQ(find_check(control, "step_after_fault"), nullptr) << why(control);
}

// A rollback after the fault's last step puts back a state from before the fault's numbers grew:
// that jump back is no training (red-team finding: an Adam moment's exponent bit flipped at step 3
// blew the weights up at step 4, a rollback at step 5 put them back, and "moved 1.0 of their norm"
// passed trained under an LR scaled by 1e-12: "held, ok"). trained measures from the state the last
// rollback restored, the run it is weighed against from the same step. Controls: rollback alone
// trains on and held, its movement a few hundredths, not the jump; ending the run on the rollback
// leaves no step to show training going on: not exercised (where the progress rule does not call it
// broke already).
TEST(Verdict, ARollbacksJumpBackIsNoTraining) {
  const std::string scenario =
      "name: t\nmodel: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1}\n"
      "data: {batch: 8, seed: 1}\ntraining: {steps: STEPS, optimizer: adam, lr: 0.003, segments: 2}\n"
      "injections: [{type: bit_flip, step: 3, target: optimizer, bit: 30, seed: 3}]\n"
      "expect: {params_finite: true, min_rollbacks: 1EXPECT}\n";
  const auto run = [&](const std::string& defenses, int steps, const std::string& expect = "") {
    std::string text = scenario;
    text.replace(text.find("STEPS"), 5, std::to_string(steps));
    text.replace(text.find("EXPECT"), 6, expect);
    return run_scenario(parse_scenario_text(text + "defenses: " + defenses + "\n", "t.yaml"));
  };
  ScenarioResult r = run("{rollback: true, lr_scale: 1.0e-12}", 10);
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_EQ(r.param_movement_from, 6) << why(r);  // the rollback on step 5
  EXPECT_LT(r.param_movement, 1e-9) << why(r);
  const ExpectationCheck* trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_FALSE(trained->passed);
  EXPECT_EQ(trained->expected.rfind("after the fault and the rollback on step 5 (steps 6..10), ", 0), 0u)
      << trained->expected;

  r = run("{rollback: true}", 10);
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "held") << why(r);
  EXPECT_EQ(r.param_movement_from, 6) << why(r);
  EXPECT_GT(r.param_movement, 1e-3) << why(r);
  EXPECT_LT(r.param_movement, 0.5) << why(r);  // the jump back read 1.0
  trained = find_check(r, "trained");
  ASSERT_NE(trained, nullptr) << why(r);
  EXPECT_TRUE(trained->passed) << trained->observed;

  // (The progress rule, 1 of steps 3..5 applied, would call it broke: turned off here.)
  r = run("{rollback: true}", 5, ", min_applied_steps: 0");
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome_kind(), Outcome::kNotExercised) << why(r);
  const ExpectationCheck* after = find_check(r, "step_after_fault");
  ASSERT_NE(after, nullptr) << why(r);
  EXPECT_EQ(after->observed,
            "none: step 5, the run's last, rolled back; make training.steps larger than 5 to show training going on "
            "after the recovery");
}

TEST(Verdict, FinalLossAndLossFiniteLookAtAppliedStepsAtTheEndOnly) {
  // Steps 3 and 4 skipped: the old rule averaged steps 1 and 2 (before the fault) and passed.
  const std::string skipped_end =
      "defenses: {skip_nonfinite: true}\ninjections: [{type: grad_nonfinite, step: 3, duration: 2}]\n";
  ScenarioResult r =
      run_scenario(with(skipped_end + "expect: {final_loss_below: 100, loss_finite: true, min_applied_steps: 0}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(std::isnan(r.final_loss));
  EXPECT_EQ(find_check(r, "final_loss_below")->observed, "no applied step in steps 3..4");
  EXPECT_EQ(find_check(r, "loss_finite")->observed, "no applied step in steps 3..4");
  // Control: step 4 applied -- its loss alone is the final loss (step 3 was skipped).
  r = run_scenario(with("defenses: {skip_nonfinite: true}\ninjections: [{type: grad_nonfinite, step: 3}]\n"
                        "expect: {final_loss_below: 100, loss_finite: true}\n"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(r.final_window_first, 3);
  EXPECT_EQ(r.final_loss, r.losses[3]);
  // Steps at the end applied with a NaN loss (no defense): the final loss is NaN because of them,
  // not for want of an applied step (found by an outsider test: it said "no applied step").
  r = run_scenario(with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {final_loss_below: 100}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(std::isnan(r.final_loss));
  EXPECT_EQ(find_check(r, "final_loss_below")->observed, "nan") << why(r);
  // A bound just below the final loss prints with the digits that tell them apart.
  const ScenarioResult healthy = run_scenario(with("expect: {final_loss_below: 100}\n"));
  ScenarioSpec at_bound = with("");
  at_bound.expect.final_loss_below = std::nextafter(healthy.final_loss, 0.0);
  r = run_scenario(at_bound);
  EXPECT_FALSE(r.passed) << why(r);
  const ExpectationCheck* c = find_check(r, "final_loss_below");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->expected.find("< " + c->observed + " "), std::string::npos) << c->expected << " / " << c->observed;
}

// --- every injection entry fires --------------------------------------------------------------

TEST(Verdict, EveryInjectionEntryMustFireNotJustOneOfItsType) {
  // Two optimizer flips: the one at step 1 has no state to flip; the one at step 3 fires. A check
  // per type saw "bit_flip fired" and passed.
  ScenarioResult r = run_scenario(with("defenses: {rollback: true}\n"
                                       "injections: [{type: bit_flip, step: 1, target: optimizer, bit: 30}, "
                                       "{type: bit_flip, step: 3, target: optimizer, bit: 30}]\n"
                                       "expect: {params_finite: true, min_applied_steps: 0}\n"));
  EXPECT_FALSE(r.passed) << why(r);
  ASSERT_EQ(r.injections.size(), 2u);
  EXPECT_EQ(r.injections[0].due, std::vector<std::int64_t>{1});
  EXPECT_TRUE(r.injections[0].fired.empty());
  EXPECT_EQ(r.injections[1].fired, std::vector<std::int64_t>{3});
  EXPECT_TRUE(has_reason(r, "injections[0] bit_flip fires (due at step 1)")) << why(r);
  EXPECT_FALSE(has_reason(r, "injections[1]")) << why(r);
  // Control: both at steps with optimizer state.
  r = run_scenario(with("defenses: {rollback: true}\n"
                        "injections: [{type: bit_flip, step: 2, target: optimizer, bit: 30}, "
                        "{type: bit_flip, step: 3, target: optimizer, bit: 30}]\n"
                        "expect: {params_finite: true, min_applied_steps: 0}\n"));
  EXPECT_FALSE(has_reason(r, "injections[")) << why(r);
  EXPECT_EQ(r.injections[0].fired, std::vector<std::int64_t>{2});
  // (Neither flip breaks this model even without rollback -- one element of Adam's first moment at
  // 2e35 stalls that element only, and trained's saturation rule, on each tensor's median, leaves
  // it out -- and the verdict says so -- fault_bites -- which is not what this test is about.)
  EXPECT_TRUE(has_reason(r, "fault_bites")) << why(r);
}

TEST(Verdict, AnInjectionDueOnNoStepFails) {
  // probability 0 over two steps: due on neither (a draw that never comes up acts the same).
  ScenarioResult r = run_scenario(with("defenses: {skip_nonfinite: true}\n"
                                       "injections: [{type: grad_nonfinite, step: 2, duration: 2, probability: 0}]\n"));
  ASSERT_TRUE(r.injections[0].due.empty());
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_TRUE(has_reason(r, "due on no step (probability 0)")) << why(r);
  // Control: probability 1 is due on both steps and fires on both.
  r = run_scenario(
      with("defenses: {skip_nonfinite: true}\n"
           "injections: [{type: grad_nonfinite, step: 2, duration: 2}]\nexpect: {min_applied_steps: 0}\n"));
  EXPECT_EQ(r.injections[0].fired, (std::vector<std::int64_t>{2, 3}));
  EXPECT_TRUE(r.passed) << why(r);
}

TEST(Verdict, ARunThatRaisedIsReplayedToTheSameRaise) {
  // grad-inf-clip-error raises at step 3 by design; its replay must raise the same there.
  ScenarioSpec spec = load_scenario("builtin:grad-inf-clip-error");
  ASSERT_TRUE(spec.expect.replay_bitwise.value_or(false));
  ScenarioResult r = run_scenario(spec);
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_TRUE(r.replayed);
  EXPECT_TRUE(r.replay_bitwise) << r.replay_report;
  EXPECT_EQ(r.last_step, 3);
  // Control: expecting the replay to differ fails.
  spec.expect.replay_bitwise = false;
  r = run_scenario(spec);
  EXPECT_FALSE(r.passed) << why(r);
}

TEST(Verdict, ResultsWithEvidenceRoundTripThroughJson) {
  const ScenarioResult r = run_scenario(
      with("injections: [{type: grad_nonfinite, step: 2}]\nexpect: {params_finite: true, diverges: true}\n"));
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.to_json(), r.to_json());
  EXPECT_EQ(back.verdict(), r.verdict());
}

// --- small truths --------------------------------------------------------------------------

TEST(SmallTruths, TheMlpTaskIsLearnable) {
  const std::string mlp =
      "model: {type: mlp, layers: 2, hidden: 32}\ndata: {batch: 32}\ntraining: {steps: 60, lr: LR}\n";
  auto run = [&](const std::string& lr) {
    std::string text = mlp;
    text.replace(text.find("LR"), 2, lr);
    return run_scenario(parse_scenario_text(text + "expect: {final_loss_below: 1.0e6}\n", "mlp.yaml"));
  };
  const ScenarioResult learns = run("0.003");
  ASSERT_TRUE(learns.passed) << why(learns);
  EXPECT_LT(learns.final_loss, 0.4 * learns.losses.front()) << learns.losses.front() << " -> " << learns.final_loss;
  // Control: with LR 0 the same run does not learn, so the drop above is learning, not noise.
  const ScenarioResult frozen = run("0.0");
  EXPECT_GT(frozen.final_loss, 0.8 * frozen.losses.front()) << frozen.losses.front() << " -> " << frozen.final_loss;
}

TEST(SmallTruths, StepsCarryTheScaleAfterTheUpdateAndTheClipCoefficient) {
  const ScenarioResult scaled = run_scenario(load_scenario("builtin:fp16-overflow-loss-scaling"));
  ASSERT_TRUE(scaled.passed) << why(scaled);
  int backoffs = 0;
  for (std::size_t i = 0; i + 1 < scaled.steps.size(); ++i) {
    EXPECT_EQ(scaled.steps[i].loss_scale_after, scaled.steps[i + 1].loss_scale) << "step " << i + 1;
    backoffs += scaled.steps[i].loss_scale_after < scaled.steps[i].loss_scale ? 1 : 0;
  }
  EXPECT_EQ(backoffs, 1);  // not vacuous: the overflow step's scale after is halved

  // PyTorch's clip_grad_norm_: coefficient min(1, max_norm / (norm + 1e-6)), norm after = min(norm, max_norm).
  const ScenarioResult clipped = run_scenario(load_scenario("builtin:loss-spike-clipping"));
  ASSERT_TRUE(clipped.passed) << why(clipped);
  int clipped_steps = 0;
  for (const StepPoint& p : clipped.steps) {
    EXPECT_EQ(p.clip_coef, std::min(1.0, 1.0 / (p.grad_norm + 1e-6))) << "step " << p.step;
    EXPECT_NEAR(p.clipped_grad_norm, std::min(p.grad_norm, 1.0), 1e-5 * std::max(1.0, p.grad_norm))
        << "step " << p.step;
    clipped_steps += p.clip_coef < 1.0 ? 1 : 0;
  }
  EXPECT_GT(clipped_steps, 0);                                       // not vacuous: some step was clipped
  EXPECT_LT(clipped_steps, static_cast<int>(clipped.steps.size()));  // and some was not
  const std::string json = clipped.to_json().dump();
  EXPECT_NE(json.find("\"clip_coef\""), std::string::npos);
  EXPECT_NE(json.find("\"loss_scale_after\""), std::string::npos);
  EXPECT_EQ(ScenarioResult::from_json(nlohmann::json::parse(json)).to_json().dump(), json);
}

// --- diagnose: the scenario and its trace tell the same story --------------------------------

// Records a built-in scenario as `retrace record` does (stopping at the first unhandled
// non-finite step; a raise is noted in the trace).
std::string record_builtin(const std::string& name) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("retrace_verdict_" + std::to_string(::getpid()) + "_" + name + ".trace"))
                               .string();
  const ScenarioSpec spec = load_scenario("builtin:" + name);
  ScenarioProgram program(spec);
  Recorder recorder(path, program);
  try {
    record_run(program, recorder, spec.training.steps, /*stop_on_nonfinite=*/true);
    recorder.close();
  } catch (const std::exception&) {
    // the trace holds the exception (record_run closed it)
  }
  return path;
}

DiagnoseOptions quick() {
  DiagnoseOptions o;
  o.repeats = 1;  // the costs are not what these tests look at
  return o;
}

TEST(Diagnose, TheScenarioAndItsTraceAgreeOnStepKindAndClassification) {
  // Four kinds of failure, so that agreement is not agreement on "none".
  const std::vector<std::pair<std::string, std::string>> cases = {{"fp16-overflow-loss-scaling-off", "loss"},
                                                                  {"grad-nan-skip-off", "gradient norm"},
                                                                  {"lr-spike-clipping-off", "expectation"},
                                                                  {"grad-inf-clip-error", "raised"}};
  for (const auto& [name, kind] : cases) {
    const Diagnosis from_yaml = diagnose_scenario(load_scenario("builtin:" + name), quick());
    const std::string path = record_builtin(name);
    const Diagnosis from_trace = diagnose_trace(path, quick());
    std::filesystem::remove(path);
    EXPECT_EQ(from_yaml.failure_kind, kind) << name << ": " << from_yaml.failure;
    EXPECT_EQ(from_trace.failure_kind, from_yaml.failure_kind) << name << ": " << from_trace.failure;
    EXPECT_EQ(from_trace.failing_step, from_yaml.failing_step) << name;
    EXPECT_EQ(from_trace.classification.kind, from_yaml.classification.kind) << name;
    EXPECT_FALSE(from_trace.variants.empty()) << name << ": a failure with nothing re-run";
    EXPECT_EQ(from_trace.from_step, from_yaml.from_step) << name;
  }
}

TEST(Diagnose, AFiniteFailureInATraceIsDiagnosedAndAHealthyOneIsNot) {
  const std::string spike = record_builtin("lr-spike-clipping-off");
  const Diagnosis d = diagnose_trace(spike, quick());
  std::filesystem::remove(spike);
  EXPECT_EQ(d.failure_kind, "expectation");
  EXPECT_NE(d.failure.find("final loss"), std::string::npos) << d.failure;
  EXPECT_TRUE(std::any_of(d.variants.begin(), d.variants.end(), [](const VariantResult& v) { return v.fixes; }))
      << d.report();
  // Control: a run that meets its expectations has nothing to diagnose.
  const std::string clean = record_builtin("bf16-clean");
  const Diagnosis ok = diagnose_trace(clean, quick());
  std::filesystem::remove(clean);
  EXPECT_EQ(ok.failure_kind, "none");
  EXPECT_TRUE(ok.variants.empty());
}

TEST(Diagnose, StepsThatStopBeforeTheFailureAreAnErrorAndRollbackIsAVariant) {
  const ScenarioSpec spec = load_scenario("builtin:grad-nan-skip-off");  // fails at step 3
  DiagnoseOptions o = quick();
  o.steps = 1;  // from step 2 (lookback 1): step 2 only
  try {
    diagnose_scenario(spec, o);
    ADD_FAILURE() << "--steps 1 ran without reaching the failing step";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stop before the failing step 3; use 2 or more (retrace diagnose --steps)"),
              std::string::npos)
        << e.what();
  }
  // Control: two steps reach it; rollback is among the variants, and it fixes a NaN gradient.
  o.steps = 2;
  const Diagnosis d = diagnose_scenario(spec, o);
  const auto rollback =
      std::find_if(d.variants.begin(), d.variants.end(), [](const VariantResult& v) { return v.name == "rollback"; });
  ASSERT_NE(rollback, d.variants.end()) << d.report();
  EXPECT_TRUE(rollback->fixes) << d.report();
  EXPECT_EQ(rollback->seconds_per_step_runs.size(), 1u);
}

// --- the scenario file: no silent surprises ----------------------------------------------------

void expect_error(const std::string& text, const std::string& message) {
  try {
    parse_scenario_text(text, "s.yaml");
    ADD_FAILURE() << "parsed without error:\n" << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(ScenarioFile, DuplicateKeysAndSectionsAreErrors) {
  expect_error("model: {type: mlp}\nmodel: {type: lstm}\n",
               "s.yaml:2: key 'model': appears twice in one mapping (first on line 1); keep one");
  expect_error("model: {type: mlp}\ntraining:\n  steps: 2\n  steps: 3\n",
               "s.yaml:4: key 'training.steps': appears twice");
  expect_error("model: {type: mlp}\ninjections:\n  - {type: lr_spike, step: 1, step: 2}\n",
               "key 'injections[0].step': appears twice");
  // Control: the same keys once each parse.
  EXPECT_EQ(parse_scenario_text("model: {type: mlp}\ntraining:\n  steps: 3\n", "s.yaml").training.steps, 3);
}

TEST(ScenarioFile, ASecondDocumentIsAnError) {
  expect_error("model: {type: mlp}\n---\ninjections: [{type: lr_spike}]\n",
               "s.yaml:2: a second YAML document starts here");
  // Control: a leading document marker and a document end marker are one document.
  EXPECT_EQ(parse_scenario_text("---\nmodel: {type: mlp}\n...\n", "s.yaml").model.type, "mlp");
}

TEST(ScenarioFile, InjectionsAfterTheLastStepAndClampedBitsAreErrors) {
  expect_error("model: {type: mlp}\ntraining: {steps: 4}\ninjections:\n  - {type: lr_spike, step: 5}\n",
               "s.yaml:4: key 'injections[0].step': is 5, after the run's last step 4, so it could never fire");
  expect_error("model: {type: mlp}\ninjections: [{type: bit_flip, bit_class: exponent, bits: 9}]\n",
               "key 'injections[0].bits': is 9, but bit_class exponent has 8 bits in an fp32 element; use 1 .. 8");
  expect_error("model: {type: mlp}\ninjections: [{type: bit_flip, bit_class: sign, bits: 2}]\n", "use 1 .. 1");
  // Controls: the last step, and the class's full width.
  EXPECT_EQ(parse_scenario_text("model: {type: mlp}\ntraining: {steps: 4}\ninjections: [{type: lr_spike, step: 4}]\n",
                                "s.yaml")
                .injections[0]
                .step,
            4);
  EXPECT_EQ(parse_scenario_text("model: {type: mlp}\ninjections: [{type: bit_flip, bit_class: mantissa, bits: 23}]\n",
                                "s.yaml")
                .injections[0]
                .bits,
            23);
}

TEST(ScenarioFile, AnLstmUnderFp16OnTheCpuIsRejectedBeforeItRuns) {
  expect_error("model: {type: lstm}\ntraining: {precision: fp16}\n",
               "s.yaml:2: key 'training.precision': fp16 autocast cannot run an lstm on the CPU");
  // bf16 depends on the CPU: where the probe says it runs, a run passes; where it does not (an
  // AVX2-only CPU), the file is refused with the reason instead of raising at every step.
  const std::string bf16 =
      "model: {type: lstm, layers: 1, hidden: 8, vocab: 16, seq_len: 4}\ntraining: {steps: 2, precision: bf16}\n";
  if (cpu_runs_lstm_at("bf16")) {
    const ScenarioResult r = run_scenario(parse_scenario_text(bf16, "s.yaml"));
    EXPECT_TRUE(r.passed) << why(r);
  } else {
    expect_error(bf16, "s.yaml:2: key 'training.precision': bf16 autocast cannot run an lstm on this machine's CPU");
  }
  EXPECT_TRUE(cpu_runs_lstm_at("fp32"));  // the probe's yes
  // Controls: fp32 on the CPU runs (and fp16 on CUDA, which this check leaves alone, parses).
  const ScenarioResult r = run_scenario(parse_scenario_text(
      "model: {type: lstm, layers: 1, hidden: 8, vocab: 16, seq_len: 4}\ntraining: {steps: 2, precision: fp32}\n",
      "s.yaml"));
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_EQ(
      parse_scenario_text("model: {type: lstm}\ntraining: {precision: fp16, device: cuda}\n", "s.yaml").training.device,
      "cuda");
}

TEST(ScenarioFile, DeepNestingNamesALineThatExists) {
  std::string deep = "model:\n";
  for (int i = 1; i <= 600; ++i) deep += std::string(2 * static_cast<std::size_t>(i), ' ') + "a:\n";
  try {
    parse_scenario_text(deep, "s.yaml");
    ADD_FAILURE() << "600 levels parsed";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("levels deep, which the YAML reader refuses"), std::string::npos) << what;
    const int line = std::stoi(what.substr(what.find(':') + 1));
    EXPECT_GE(line, 1);
    EXPECT_LE(line, 601);
  }
  // Control: a few levels are no problem for the reader (the schema then names the unknown key).
  expect_error("model:\n  a:\n    b: 1\n", "key 'model.a': unknown key");
}

}  // namespace
}  // namespace retrace
