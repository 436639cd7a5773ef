// Injectors fire on their seeded schedule, deterministically, and bite; defenses hold what they
// promise bitwise (a skipped step changes nothing, the schedule does not advance); clipping never
// silently turns an Inf into 0 or NaN; the scenario schema rejects bad input with file:line:key.
#include "../support/scenario_text.h"

#include <retrace/diagnose.h>
#include <retrace/error.h>
#include <retrace/gtest.h>
#include <retrace/gtest_scenario.h>
#include <retrace/injectors.h>
#include <retrace/reporter.h>
#include <retrace/runner.h>
#include <retrace/trainer.h>

#include <nlohmann/json.hpp>
#include <torch/nn/utils/clip_grad.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>

namespace retrace {
namespace {

using test::kGpt;
using test::with;

std::vector<NamedTensor> copy(const std::vector<NamedTensor>& state) {
  std::vector<NamedTensor> out;
  for (const NamedTensor& n : state) out.push_back({n.name, n.tensor.detach().clone()});
  return out;
}

// Every tensor of `a` bitwise equal to its namesake in `b`; returns how many differ.
int differing(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  int n = 0;
  for (const NamedTensor& x : a) {
    for (const NamedTensor& y : b) {
      if (x.name == y.name && !bitwise_diff(x.tensor, y.tensor).bitwise_equal()) ++n;
    }
  }
  return n;
}

TEST(FlipBit, FlipsExactlyTheNamedBit) {
  at::Tensor t = torch::tensor({1.5f, -2.0f, 0.25f});
  flip_bit(t, 0, 31);  // sign
  EXPECT_EQ(t[0].item<float>(), -1.5f);
  flip_bit(t, 2, 0);  // lowest mantissa bit: one ULP
  EXPECT_EQ(t[2].item<float>(), std::nextafter(0.25f, 1.0f));
  flip_bit(t, 1, 30);  // top exponent bit of -2.0 (exponent 128 -> 0): a tiny denormal-range value
  EXPECT_LT(std::abs(t[1].item<float>()), 1e-37f);
  at::Tensor strided = torch::zeros({4, 4}).t();  // non-contiguous
  flip_bit(strided, 5, 23);
  EXPECT_EQ(strided.reshape({-1})[5].item<float>(), std::ldexp(1.0f, -126));
  // Out of range: a retrace::Error saying the valid range (a user's argument, not our bug).
  try {
    flip_bit(t, 3, 0);
    ADD_FAILURE() << "flipped element 3 of 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use 0 .. 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(flip_bit(t, 0, 32), Error);
  EXPECT_THROW(flip_bit(t, -1, 0), Error);
}

TEST(Injector, FiresOnItsScheduleAndNeverTouchesLibTorchsGenerator) {
  InjectionSpec spike;
  spike.type = InjectionType::kLrSpike;
  spike.step = 3;
  spike.duration = 2;
  spike.factor = 10;
  Injector injector({spike});
  torch::manual_seed(7);
  const at::Tensor before = torch::rand({4});
  torch::manual_seed(7);
  std::vector<double> factors;
  for (std::int64_t s = 1; s <= 5; ++s) {
    injector.begin_step(s);
    factors.push_back(injector.lr_factor());
    EXPECT_EQ(injector.fired().size(), (s == 3 || s == 4) ? 1u : 0u) << "step " << s;
  }
  EXPECT_EQ(factors, (std::vector<double>{1, 1, 10, 10, 1}));
  EXPECT_BITWISE_EQ(torch::rand({4}), before);  // the injector drew nothing from it
}

TEST(Injector, ProbabilityIsSeededAndReproducible) {
  InjectionSpec loss;
  loss.type = InjectionType::kLossSpike;
  loss.step = 1;
  loss.duration = 200;
  loss.probability = 0.3;
  loss.seed = 11;
  auto fired_steps = [&](std::uint64_t seed) {
    InjectionSpec s = loss;
    s.seed = seed;
    Injector injector({s});
    std::vector<std::int64_t> out;
    for (std::int64_t step = 1; step <= 200; ++step) {
      injector.begin_step(step);
      (void)injector.on_loss(torch::ones({}));
      if (!injector.fired().empty()) out.push_back(step);
    }
    return out;
  };
  const auto a = fired_steps(11), b = fired_steps(11), c = fired_steps(12);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_GT(a.size(), 30u);  // about 60 of 200
  EXPECT_LT(a.size(), 95u);
}

TEST(Injector, BitFlipChoosesTheSameElementAndBitForTheSameSeed) {
  Injector a(with("injections: [{type: bit_flip, step: 1, target: weights, seed: 5}]\n").injections);
  Injector b(with("injections: [{type: bit_flip, step: 1, target: weights, seed: 5}]\n").injections);
  ScenarioProgram p1(with("")), p2(with(""));
  a.begin_step(1);
  b.begin_step(1);
  a.flip_state(p1.state());
  b.flip_state(p2.state());
  ASSERT_EQ(a.fired().size(), 1u);
  EXPECT_EQ(a.fired()[0].where, b.fired()[0].where);
  EXPECT_EQ(a.fired()[0].detail, b.fired()[0].detail);
  EXPECT_EQ(differing(p1.state(), p2.state()), 0);
  ScenarioProgram clean(with(""));
  EXPECT_EQ(differing(p1.state(), clean.state()), 1);  // exactly one tensor changed
}

TEST(Injector, SegmentFaultIsAppliedIdenticallyInForwardAndRecompute) {
  // An activation overflow in fp16: the recompute sees the same fault, so the gradients are the
  // faulted forward's (the verifier observes no mismatch after the injector).
  ScenarioSpec spec = with("injections: [{type: activation_overflow, step: 1, factor: 10}]\n"
                           "defenses: {verify_recompute: true}\n");
  ScenarioProgram program(spec);
  const StepOutcome o = program.step(1, program.batch(1), nullptr);
  EXPECT_FALSE(o.skipped) << o.skip_reason;
  EXPECT_EQ(program.defenses()->caught_recompute_mismatches(), 0);
  ASSERT_EQ(o.injected.size(), 1u);
  EXPECT_NE(o.injected[0].find("activation_overflow block0: outputs x10"), std::string::npos) << o.injected[0];
}

TEST(Defenses, SkippedStepLeavesStateBitwiseUntouchedAndTheScheduleStill) {
  // skip_nonfinite against a NaN gradient at step 2, with warmup: parameters, Adam moments and
  // the schedule's counter are bitwise what they were before the step, and step 3 gets the LR
  // step 2 would have had.
  ScenarioProgram program(with("defenses: {skip_nonfinite: true, warmup_steps: 4}\n"
                               "injections: [{type: grad_nonfinite, step: 2}]\n"));
  program.step(1, program.batch(1), nullptr);
  const auto before = copy(program.state());
  const double lr_before = program.lr();
  const StepOutcome o = program.step(2, program.batch(2), nullptr);
  EXPECT_TRUE(o.skipped);
  EXPECT_EQ(o.skip_reason, "non-finite gradients");
  EXPECT_EQ(differing(program.state(), before), 0);
  EXPECT_EQ(program.defenses()->schedule().applied_steps(), 1);
  EXPECT_EQ(program.lr(), lr_before);
  // Negative control: without the defense, the same step changes (and poisons) the state.
  ScenarioProgram off(with("injections: [{type: grad_nonfinite, step: 2}]\n"));
  off.step(1, off.batch(1), nullptr);
  const auto off_before = copy(off.state());
  EXPECT_FALSE(off.step(2, off.batch(2), nullptr).skipped);
  EXPECT_GT(differing(off.state(), off_before), 0);
}

TEST(Defenses, ClippingNeverTurnsAnInfGradientIntoZeroOrNaN) {
  // What LibTorch's clip_grad_norm_ does with an Inf gradient (error_if_nonfinite off): every
  // gradient is scaled by max_norm / Inf -- finite ones silently become 0, the Inf becomes NaN.
  torch::nn::Linear a(3, 2), b(3, 2);
  for (auto* l : {&a, &b}) {
    (*l)(torch::ones({1, 3})).sum().backward();
    (*l)->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
  }
  torch::nn::utils::clip_grad_norm_(a->parameters(), 1.0);
  EXPECT_EQ(a->bias.grad()[0].item<float>(), 0.0f);
  EXPECT_TRUE(std::isnan(a->weight.grad()[0][0].item<float>()));
  // retrace's clipping refuses to scale by a non-finite norm: the gradients stay as they were,
  // and the step is skipped (skip_nonfinite) or raises (error_if_nonfinite).
  ScenarioProgram skip(with("defenses: {clip: {mode: global, max_norm: 1.0}, skip_nonfinite: true}\n"
                            "injections: [{type: grad_nonfinite, step: 1, mode: inf}]\n"));
  const auto before = copy(skip.state());
  const StepOutcome o = skip.step(1, skip.batch(1), nullptr);
  EXPECT_TRUE(o.skipped);
  EXPECT_TRUE(std::isinf(o.grad_norm));
  int infs = 0, zeros = 0;
  for (const at::Tensor& p : skip.model().parameters()) {
    if (!p.grad().defined()) continue;
    infs += at::isinf(p.grad()).sum().item<int>();
    zeros += (p.grad() == 0).all().item<bool>();
    EXPECT_EQ(at::isnan(p.grad()).sum().item<int>(), 0);
  }
  EXPECT_EQ(infs, 1);
  EXPECT_EQ(zeros, 0);
  EXPECT_EQ(differing(skip.state(), before), 0);
  ScenarioProgram raise(with("defenses: {clip: {mode: global, max_norm: 1.0, error_if_nonfinite: true}}\n"
                             "injections: [{type: grad_nonfinite, step: 1, mode: inf}]\n"));
  EXPECT_THROW(raise.step(1, raise.batch(1), nullptr), Error);
}

TEST(Defenses, RollbackWalksBackThroughConsecutiveFailures) {
  // An Adam moment flipped to ~1e35 at step 3 poisons the update; the loss goes non-finite at
  // step 4, so rollback first restores step 4's start (already poisoned), then step 3's.
  ScenarioSpec spec = load_scenario("builtin:bitflip-optimizer-rollback");
  const ScenarioResult r = run_scenario(spec);
  EXPECT_TRUE(r.passed);
  const std::vector<StepNote> skips = r.notes_of(StepNoteKind::kSkipped);
  ASSERT_EQ(skips.size(), 2u);
  EXPECT_NE(skips[0].text.find("restored the state from the start of step 4"), std::string::npos) << skips[0].text;
  EXPECT_NE(skips[1].text.find("restored the state from the start of step 3"), std::string::npos) << skips[1].text;
  EXPECT_TRUE(r.params_finite);
}

TEST(Runner, ResultsRoundTripThroughJson) {
  const ScenarioResult r = run_scenario(load_scenario("builtin:grad-nan-skip"));
  EXPECT_TRUE(r.passed);
  EXPECT_TRUE(r.replay_bitwise);  // recorded with the injection and the defense, replayed bitwise
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.to_json(), r.to_json());
  EXPECT_EQ(back.checks.size(), r.checks.size());
  EXPECT_EQ(back.notes, r.notes);
  EXPECT_EQ(back.notes_of(StepNoteKind::kSkipped), (std::vector<StepNote>{{3, StepNoteKind::kSkipped, "non-finite gradients"}}));
  ASSERT_EQ(back.notes_of(StepNoteKind::kInjected).size(), 1u);
  EXPECT_EQ(back.notes_of(StepNoteKind::kInjected)[0].step, 3);
  // --json's readers also get the notes as lines.
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j.at("skip_reasons"), nlohmann::json::array({"step 3: non-finite gradients"}));
  EXPECT_EQ(j.at("notes").at(1), (nlohmann::json{{"step", 3}, {"kind", "skipped"}, {"text", "non-finite gradients"}}));
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
  EXPECT_NE(outcome_matrix({r}).find("grad_nonfinite:nan  none     broke    broke     ok"), std::string::npos) << outcome_matrix({r});
}

TEST(Schema, FullSpecRoundTripsThroughCanonicalYaml) {
  const ScenarioSpec a = load_scenario("builtin:fp16-overflow-hysteresis");
  const ScenarioSpec b = parse_scenario_text(to_yaml(a), "again");
  EXPECT_EQ(to_yaml(a), to_yaml(b));
  ASSERT_EQ(b.injections.size(), 1u);
  EXPECT_TRUE(a.injections[0] == b.injections[0]);
  EXPECT_EQ(b.defenses.loss_scaling.hysteresis, 2);
  EXPECT_TRUE(b.expect.replay_bitwise.value_or(false));
}

void expect_error(const std::string& extra, const std::string& needle) {
  try {
    with(extra);
    ADD_FAILURE() << "no error for: " << extra;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Schema, BadDefensesInjectionsAndExpectationsNameFileLineAndKey) {
  // kGpt is 5 lines (the first empty), so the extra text starts on line 6.
  expect_error("defenses: {clipping: 1}\n", "test.yaml:6: key 'defenses.clipping': unknown key; known keys here: loss_scaling");
  expect_error("defenses:\n  skip_nonfinite: maybe\n", "test.yaml:7: key 'defenses.skip_nonfinite': must be true or false, got 'maybe'");
  expect_error("defenses: {clip: {mode: hard}}\n", "key 'defenses.clip.mode': must be one of off, global, per_tensor, adaptive, got 'hard'");
  expect_error("injections: {type: loss_spike}\n", "test.yaml:6: key 'injections': must be a list");
  expect_error("injections:\n  - step: 2\n", "test.yaml:7: key 'injections[0].type': is required");
  expect_error("injections:\n  - {type: loss_spike, probability: 2}\n", "key 'injections[0].probability': must be between 0 and 1, got 2");
  expect_error("injections:\n  - {type: corrupt_batch, mode: nan_features}\n", "nan_features does not fit model type tiny_gpt (token ids); use token_out_of_range");
  expect_error("injections:\n  - {type: loss_spike, mode: nan}\n", "key 'injections[0].mode': is not used by injection type loss_spike");
  expect_error("expect: {max_skipped_steps: -1}\n", "key 'expect.max_skipped_steps': must be between 0 and");
  expect_error("expect: {replay: true}\n", "key 'expect.replay': unknown key");
  EXPECT_THROW(parse_scenario_text("model: {type: mlp, layers: 2}\ntraining: {segments: 0}\ninjections: [{type: activation_overflow}]\n", "x.yaml"), Error);
  try {
    parse_scenario_text("model: {type: mlp, layers: 2}\ntraining: {segments: 0}\ninjections: [{type: activation_overflow}]\n", "x.yaml");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.yaml:3: key 'injections[0].type': activation_overflow hits a checkpointed segment, but training.segments is 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace retrace

namespace retrace {
namespace {

std::vector<std::string> fixing(const Diagnosis& d) {
  std::vector<std::string> out;
  for (const VariantResult& v : d.variants) {
    if (v.fixes) out.push_back(v.name);
  }
  return out;
}

bool has(const std::vector<std::string>& v, const std::string& x) { return std::find(v.begin(), v.end(), x) != v.end(); }

DiagnoseOptions untimed() {
  DiagnoseOptions o;
  o.repeats = 1;  // which variants fix it, not what they cost
  return o;
}

TEST(Diagnose, NamesTheFixForFp16OverflowLrSpikeAndRngDesync) {
  const Diagnosis overflow = diagnose_scenario(load_scenario("builtin:fp16-overflow-loss-scaling-off"), untimed());
  EXPECT_EQ(overflow.failing_step, 4);
  EXPECT_EQ(overflow.classification.kind, "persistent");
  EXPECT_FALSE(overflow.baseline.fixes);  // the failure comes back from the snapshot
  const auto f1 = fixing(overflow);
  EXPECT_TRUE(has(f1, "loss scaling")) << overflow.report();
  EXPECT_TRUE(has(f1, "fp32")) << overflow.report();
  EXPECT_FALSE(has(f1, "clip 1.0")) << overflow.report();  // clipping cannot fix an Inf forward
  EXPECT_TRUE(overflow.variants.front().fixes);              // ranked: fixing variants first

  const Diagnosis spike = diagnose_scenario(load_scenario("builtin:lr-spike-clipping-off"), untimed());
  EXPECT_EQ(spike.failing_step, -1);  // no step goes non-finite; the final loss is the failure
  EXPECT_EQ(spike.classification.kind, "none");
  const auto f2 = fixing(spike);
  EXPECT_TRUE(has(f2, "clip 1.0")) << spike.report();
  EXPECT_TRUE(has(f2, "lr / 10 + warmup")) << spike.report();
  EXPECT_FALSE(has(f2, "loss scaling")) << spike.report();

  const Diagnosis desync = diagnose_scenario(load_scenario("builtin:rng-desync-not-preserved"), untimed());
  EXPECT_NE(desync.failure.find("non-bitwise recompute"), std::string::npos) << desync.failure;
  EXPECT_EQ(fixing(desync), std::vector<std::string>{"checkpointing off"}) << desync.report();
}

TEST(Diagnose, NothingToDiagnoseInAHealthyRun) {
  const Diagnosis d = diagnose_scenario(load_scenario("builtin:bf16-clean"));
  EXPECT_TRUE(d.variants.empty());
  EXPECT_NE(d.failure.find("none"), std::string::npos);
}

}  // namespace
}  // namespace retrace

namespace retrace {
namespace {

TEST(Defenses, PlateauCutsTheLrAfterPatienceAndRoundTripsThroughState) {
  // LR 1e-6 and no dropout: the loss improves by far less than the threshold, so after
  // `patience` flat steps the factor halves (each cut moves the LR by more than eps, 1e-8).
  ScenarioSpec spec = parse_scenario_text(R"(
model: {type: mlp, layers: 2, hidden: 8, dropout: 0}
data: {batch: 4}
training: {steps: 8, optimizer: sgd, lr: 1.0e-6, segments: 0}
defenses: {plateau: {factor: 0.5, patience: 2}}
)", "plateau.yaml");
  ScenarioProgram zero(spec);
  for (std::int64_t s = 1; s <= 8; ++s) zero.step(s, zero.batch(1), nullptr);  // the same loss every step
  // The base LR is 0, so read the plateau factor through the state.
  auto plateau = [](ScenarioProgram& p) {
    for (const NamedTensor& n : p.state()) {
      if (n.name == "schedule.plateau") return n.tensor.clone();
    }
    return at::Tensor();
  };
  const at::Tensor before = plateau(zero);
  ASSERT_TRUE(before.defined());
  EXPECT_EQ(before[0].item<double>(), 0.25);  // steps 1: best; 2, 3: flat; 4: cut; 5, 6: flat; 7: cut
  EXPECT_TRUE(at::isfinite(before).all().item<bool>());
  ScenarioProgram restored(spec);
  restored.load_state(zero.state());
  const at::Tensor after = plateau(restored);
  ASSERT_TRUE(after.defined());
  EXPECT_BITWISE_EQ(after, before);
  // PyTorch's eps: with LR 0 a cut would change the LR by nothing, so none is made.
  spec.training.lr = 0.0;
  ScenarioProgram still(spec);
  for (std::int64_t s = 1; s <= 8; ++s) still.step(s, still.batch(1), nullptr);
  EXPECT_EQ(plateau(still)[0].item<double>(), 1.0);
}

}  // namespace
}  // namespace retrace

namespace retrace {
namespace {

TEST(Injector, SegmentFaultsKeepEveryGradientFlowing) {
  // A fault in both forward and recompute (or the recompute only) replaces a segment's output
  // inside the autograd graph: every parameter upstream still gets its gradient.
  for (const char* phase : {"both", "recompute"}) {
    SCOPED_TRACE(phase);
    ScenarioProgram program(with(std::string("injections: [{type: activation_overflow, step: 1, factor: 2, segment: block1, phase: ") +
                                 phase + "}]\n"));
    const StepOutcome o = program.step(1, program.batch(1), nullptr);
    ASSERT_TRUE(std::isfinite(o.loss));
    for (const auto& p : program.model().named_parameters()) {
      EXPECT_TRUE(p.value().grad().defined()) << p.key() << " got no gradient";
    }
  }
  // Negative control: the checkpoint refuses an observer that cuts the recompute out of the graph.
  struct Detaching : SegmentObserver {
    void on_recompute(SegmentEvent& e) override { e.outputs[0] = e.outputs[0].detach(); }
  } detaching;
  ScenarioProgram program(with(""));
  ObserverScope scope(detaching);
  EXPECT_THROW(program.step(1, program.batch(1), nullptr), std::exception);
}

TEST(Runner, AnInjectionThatNeverFiresFailsTheScenario) {
  // Adam has no state before its first step: an optimizer flip at step 1 has nothing to flip.
  ScenarioResult r = run_scenario(with("injections: [{type: bit_flip, step: 1, target: optimizer, bit: 30}]\n"
                                       "expect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed);
  bool named = false;
  for (const ExpectationCheck& c : r.checks) named = named || (c.name == "injection_fired" && !c.passed);
  EXPECT_TRUE(named);
  r = run_scenario(with("injections: [{type: bit_flip, step: 2, target: optimizer, bit: 30}]\n"
                        "expect: {params_finite: true, diverges: true}\n"));
  for (const ExpectationCheck& c : r.checks) EXPECT_NE(c.name, "injection_fired");  // it fired at step 2
}

TEST(Schema, KeysAndSegmentsThatCannotWorkAreErrors) {
  // (kGpt has model, data and training already: the extra text uses other sections.)
  expect_error("defenses: {[a]: 1}\n", "test.yaml:6: key 'defenses.?': a key must be a plain name");
  ScenarioSpec four = parse_scenario_text(
      "model: {type: tiny_gpt, layers: 4, d_model: 16, heads: 2}\ntraining: {segments: 2}\n"
      "injections: [{type: activation_overflow, segment: block0..block1}]\n", "ok.yaml");
  EXPECT_EQ(four.injections[0].segment, "block0..block1");
  try {
    parse_scenario_text("model: {type: tiny_gpt, layers: 4, d_model: 16, heads: 2}\ntraining: {segments: 2}\n"
                        "injections: [{type: activation_overflow, segment: block1..block2}]\n", "bad.yaml");
    ADD_FAILURE() << "a range that is not a segment parsed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.yaml:3: key 'injections[0].segment': 'block1..block2' is not one of this run's segments (block0..block1, block2..block3)"), std::string::npos) << e.what();
  }
  expect_error("injections: [{type: bit_flip, target: weights, bit: 40}]\n", "key 'injections[0].bit': must be between 0 and 31");
  expect_error("injections: [{type: bit_flip, target: weights, segment: block0}]\n", "is only for target activations");
  expect_error("expect:\n  max_skipped_steps: |\n    1\n    x\n", "must be an integer, got '1 x");
}

}  // namespace
}  // namespace retrace

namespace retrace {
namespace {

TEST(Runner, RaisesMatchesTheErrorAndAHarnessErrorNeverPasses) {
  const std::string fault = "injections: [{type: grad_nonfinite, step: 2, mode: inf}]\n"
                            "defenses: {clip: {mode: global, max_norm: 1.0, error_if_nonfinite: true}}\n";
  EXPECT_TRUE(run_scenario(with(fault + "expect: {raises: true, raises_match: \"clipping refuses it\"}\n")).passed);
  EXPECT_FALSE(run_scenario(with(fault + "expect: {raises: true, raises_match: \"out of memory\"}\n")).passed);
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

namespace retrace {
namespace {

TEST(Observers, FirstOrderObserversRunBeforeEarlierAttachedOnes) {
  // The recorder (attached first, kLast) must see what an injector (attached later, kFirst) put
  // in place, so that a trace holds the values that flowed on.
  struct Zeroing : SegmentObserver {
    void on_forward(SegmentEvent& e) override { e.outputs[0] = at::zeros_like(e.outputs[0]); }
  } zeroing;
  struct Watching : SegmentObserver {
    bool saw_zeros = false;
    void on_forward(SegmentEvent& e) override { saw_zeros = (e.outputs[0] == 0).all().item<bool>(); }
  } watching;
  ObserverScope watch(watching);                      // attached first, ordinary order
  ObserverScope zero(zeroing, ObserverOrder::kFirst);  // attached later, runs first
  const at::Tensor x = torch::ones({2, 3}, torch::requires_grad());
  const at::Tensor y = checkpoint("seg", [](const at::Tensor& t) { return t * 3; }, x);
  EXPECT_TRUE(watching.saw_zeros);
  EXPECT_EQ(y.abs().sum().item<float>(), 0.0f);
}

}  // namespace
}  // namespace retrace

namespace retrace {
namespace {

// A scenario registered as a test, and the helper's failure message on one that fails.
RETRACE_SCENARIO_TEST(ScenarioTest, BuiltinGradNanSkip, "builtin:grad-nan-skip")

TEST(ScenarioTest, FailureMessageNamesTheUnmetExpectations) {
  const ::testing::AssertionResult r = testing::ScenarioPasses("x", "builtin:grad-nan-skip-off");
  // A negative control run as if it were a defense: it passes (it broke, as it should)...
  EXPECT_TRUE(r);
  const std::string path = (std::filesystem::temp_directory_path() / "retrace_gtest_scenario.yaml").string();
  {
    std::ofstream f(path);
    f << "name: t\nmodel: {type: mlp, layers: 2}\ninjections: [{type: grad_nonfinite, step: 2}]\n"
         "training: {steps: 3}\nexpect: {params_finite: true}\n";
  }
  const ::testing::AssertionResult bad = testing::ScenarioPasses("t", path);
  EXPECT_FALSE(bad);
  EXPECT_NE(std::string(bad.message()).find("! params_finite: expected true, observed false"), std::string::npos) << bad.message();
  // As `retrace run` prints it (failure_details): the reasons, then every check, two spaces in.
  EXPECT_NE(std::string(bad.message()).find("\n  - params_finite: expected true, got false\n"), std::string::npos) << bad.message();
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace retrace
