// The defense pipeline on the built-in program: a skipped step leaves the state bitwise as it was;
// clipping never turns an Inf into 0 or NaN; rollback walks back; the plateau rule round-trips.
#include "../support/scenario_text.h"
#include "../support/state_compare.h"

#include <retrace/defenses.h>
#include <retrace/error.h>
#include <retrace/gtest.h>
#include <retrace/runner.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>

namespace retrace {
namespace {

using test::with;

std::vector<NamedTensor> copy(const std::vector<NamedTensor>& state) {
  std::vector<NamedTensor> out;
  for (const NamedTensor& n : state) out.push_back({n.name, n.tensor.detach().clone()});
  return out;
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

// load_optimizer_state from tensors given up (Program::adopt_state) keeps them as the moments;
// from a const state it clones, so that a caller's snapshot (rollback's) is never updated in
// place. A moment that does not own its memory (a view into a larger tensor) or that something
// else still holds (another optimizer's live moment) is cloned either way. Both ways train on to the same bits. Controls: the clones' memory differs from the
// given tensors', and the larger tensor a view was taken from is unchanged by the next step.
TEST(Defenses, LoadOptimizerStateKeepsMomentsGivenUpAndClonesTheRest) {
  torch::manual_seed(7);
  torch::nn::Linear model(4, 3);
  const std::vector<NamedTensor> params = named_parameters(*model);
  const auto train = [&](torch::optim::Optimizer& opt) {
    opt.zero_grad();
    model->forward(torch::ones({2, 4})).square().sum().backward();
    opt.step();
  };
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.01));
  train(opt);
  const std::vector<NamedTensor> params_then = copy(params);
  const std::vector<NamedTensor> moments = copy(optimizer_state(opt, params));
  ASSERT_GE(moments.size(), 6u);  // step, exp_avg, exp_avg_sq of weight and bias

  const auto memory_of = [&](const std::string& name) {
    for (const NamedTensor& n : optimizer_state(opt, params)) {
      if (n.name == name) return n.tensor.const_data_ptr();
    }
    ADD_FAILURE() << "no " << name;
    return static_cast<const void*>(nullptr);
  };
  const std::string weight_avg = "optim.weight.exp_avg";
  const auto given = [&](const std::string& name, const std::vector<NamedTensor>& state) {
    for (const NamedTensor& n : state) {
      if (n.name == name) return n.tensor.const_data_ptr();
    }
    return static_cast<const void*>(nullptr);
  };

  // Const: cloned. Then one more step: the reference bits.
  load_optimizer_state(opt, params, moments);
  EXPECT_NE(memory_of(weight_avg), given(weight_avg, moments));
  train(opt);
  const std::vector<NamedTensor> reference = copy(params);
  const std::vector<NamedTensor> reference_moments = copy(optimizer_state(opt, params));

  // Given up: kept.
  copy_state_into(params, params_then);
  std::vector<NamedTensor> owned = copy(moments);
  const void* owned_avg = given(weight_avg, owned);
  load_optimizer_state(opt, params, std::move(owned));
  EXPECT_EQ(memory_of(weight_avg), owned_avg);
  train(opt);
  EXPECT_EQ(differing(reference, params), 0);
  EXPECT_EQ(differing(reference_moments, optimizer_state(opt, params)), 0);

  // Given up, but a view of a larger tensor: cloned, the larger tensor untouched.
  copy_state_into(params, params_then);
  std::vector<NamedTensor> viewed = copy(moments);
  at::Tensor larger;
  for (NamedTensor& n : viewed) {
    if (n.name != weight_avg) continue;
    larger = torch::cat({n.tensor.reshape(-1), torch::full({5}, 42.0f)});
    n.tensor = larger.narrow(0, 0, n.tensor.numel()).view(n.tensor.sizes());
  }
  ASSERT_TRUE(larger.defined());
  const at::Tensor larger_before = larger.clone();
  load_optimizer_state(opt, params, std::move(viewed));
  EXPECT_NE(memory_of(weight_avg), larger.const_data_ptr());
  train(opt);
  EXPECT_BITWISE_EQ(larger_before, larger);
  EXPECT_EQ(differing(reference, params), 0);

  // Given up, but still another optimizer's live moments (a temporary of handles to them):
  // cloned, and the other optimizer's moments are untouched by this one's step.
  torch::optim::AdamW other(model->parameters(), torch::optim::AdamWOptions(0.01));
  load_optimizer_state(other, params, copy(moments));
  const std::vector<NamedTensor> other_before = copy(optimizer_state(other, params));
  const void* other_avg = given(weight_avg, optimizer_state(other, params));
  copy_state_into(params, params_then);
  load_optimizer_state(opt, params, optimizer_state(other, params));
  EXPECT_NE(memory_of(weight_avg), other_avg);
  train(opt);
  EXPECT_EQ(differing(other_before, optimizer_state(other, params)), 0);
  EXPECT_EQ(differing(reference, params), 0);
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

TEST(Defenses, PlateauCutsTheLrAfterPatienceAndRoundTripsThroughState) {
  // LR 1e-6 and no dropout: the loss improves by far less than the threshold, so after
  // `patience` flat steps the factor halves (each cut moves the LR by more than eps, 1e-8).
  ScenarioSpec spec = parse_scenario_text(R"(
model: {type: mlp, layers: 2, hidden: 8, dropout: 0}
data: {batch: 4}
training: {steps: 8, optimizer: sgd, lr: 1.0e-6, segments: 0}
defenses: {plateau: {factor: 0.5, patience: 2}}
)",
                                          "plateau.yaml");
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
