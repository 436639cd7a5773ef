// The Injector: faults fire on their seeded schedule, deterministically, never drawing from
// LibTorch's generators; a segment fault lands identically in forward and recompute; flip_bit.
#include "../support/scenario_text.h"
#include "../support/state_compare.h"

#include <retrace/error.h>
#include <retrace/gtest.h>
#include <retrace/injectors.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>

namespace retrace {
namespace {

using test::with;

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
    EXPECT_TRUE(injector.fired().empty()) << "step " << s << ": a spike counts once the optimizer step applied it";
    if (s != 4) injector.lr_applied();  // step 4 skipped before its update: its spike did nothing
    EXPECT_EQ(injector.fired().size(), s == 3 ? 1u : 0u) << "step " << s;
  }
  EXPECT_EQ(factors, (std::vector<double>{1, 1, 10, 10, 1}));
  EXPECT_BITWISE_EQ(torch::rand({4}), before);  // the injector drew nothing from it
}

TEST(Injector, SegmentTargetedMatchesANameAndAStageInsideARange) {
  EXPECT_TRUE(segment_targeted("", "block3"));
  EXPECT_TRUE(segment_targeted("block1", "block1"));
  EXPECT_TRUE(segment_targeted("block0", "block0..block1"));
  EXPECT_TRUE(segment_targeted("block3", "block0..block3"));
  EXPECT_FALSE(segment_targeted("block4", "block0..block3"));
  EXPECT_FALSE(segment_targeted("block1", "block2"));
  EXPECT_FALSE(segment_targeted("layer1", "block0..block3"));
  EXPECT_FALSE(segment_targeted("block", "block0..block3"));
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

TEST(Injector, SegmentFaultsKeepEveryGradientFlowing) {
  // A fault in both forward and recompute (or the recompute only) replaces a segment's output
  // inside the autograd graph: every parameter upstream still gets its gradient.
  for (const char* phase : {"both", "recompute"}) {
    SCOPED_TRACE(phase);
    ScenarioProgram program(
        with(std::string("injections: [{type: activation_overflow, step: 1, factor: 2, segment: block1, phase: ") +
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

}  // namespace
}  // namespace retrace
