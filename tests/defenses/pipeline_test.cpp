#include "../support/regressor.h"
#include "../support/scenario_text.h"

#include <retrace/checkpoint.h>
#include <retrace/defenses.h>
#include <retrace/diagnose.h>
#include <retrace/error.h>
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/runner.h>
#include <retrace/scenario.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace retrace {
namespace {

using test::Regressor;


// --- the pipeline's pieces --------------------------------------------------------------------

TEST(Pipeline, TheProgramsOwnLrComesBackAfterEachStepAndScheduleMultipliesIt) {
  Regressor p("lr: 0.2");
  DefenseOptions o;
  o.warmup_steps = 4;
  p.defenses()->configure(o, {});
  p.optimizer().param_groups()[0].options().set_lr(0.1);  // the program's own scheduler moved it
  const StepOutcome s1 = p.step(1, p.batch(1), nullptr);
  EXPECT_DOUBLE_EQ(s1.lr, 0.1 * 0.25);  // warmup step 1 of 4, on the program's LR
  EXPECT_DOUBLE_EQ(p.optimizer().param_groups()[0].options().get_lr(), 0.1);
  const StepOutcome s2 = p.step(2, p.batch(2), nullptr);
  EXPECT_DOUBLE_EQ(s2.lr, 0.1 * 0.5);
}

// Gradient accumulation: forward() and backward() once per micro-batch. The step's loss is the sum
// of the losses passed (each half's / 2: the batch's mean), not the last one's (outsider finding:
// half of it, feeding loss_finite, final_loss_below and the trace); the gradients accumulate as the
// whole batch's. A loss spike scales every micro-batch's loss and is noted once. Control: the same
// program on the whole batch at once.
TEST(Pipeline, GradientAccumulationReportsTheStepsWholeLoss) {
  Regressor whole(""), halves("micro_batches: 2");
  const StepOutcome a = whole.step(1, whole.batch(1), nullptr);
  const StepOutcome b = halves.step(1, halves.batch(1), nullptr);
  EXPECT_NEAR(b.loss, a.loss, 1e-6 * a.loss);
  EXPECT_NEAR(b.grad_norm, a.grad_norm, 1e-5 * a.grad_norm);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::allclose(whole.state()[i].tensor, halves.state()[i].tensor, 1e-5, 1e-7)) << i;
  }

  Regressor spiked("micro_batches: 2"), plain("micro_batches: 2");
  InjectionSpec spike;
  spike.type = InjectionType::kLossSpike;
  spike.step = 1;
  spike.factor = 1000;
  spiked.defenses()->configure({}, {spike});
  const StepOutcome s = spiked.step(1, spiked.batch(1), nullptr);
  const StepOutcome p = plain.step(1, plain.batch(1), nullptr);
  EXPECT_EQ(s.injected.size(), 1u);
  EXPECT_NEAR(s.grad_norm, 1000 * p.grad_norm, 1e-3 * p.grad_norm);
  EXPECT_NEAR(s.loss, p.loss, 1e-6 * p.loss);  // the loss as the program reports it
}

TEST(Pipeline, PlateauCutsOnlyWhenTheChangeExceedsEps) {
  PlateauOptions plateau;
  plateau.enabled = true;
  plateau.patience = 0;
  plateau.factor = 0.5;
  LrSchedule cut(0, 1.0, plateau);
  cut.on_applied(1.0, 1e-3);
  cut.on_applied(1.0, 1e-3);  // no improvement, patience 0: cut
  EXPECT_DOUBLE_EQ(cut.lr(1e-3), 0.5e-3);
  plateau.eps = 1e-3;  // PyTorch's rule: a cut of 0.5e-3 is not more than eps, so none is made
  LrSchedule kept(0, 1.0, plateau);
  kept.on_applied(1.0, 1e-3);
  kept.on_applied(1.0, 1e-3);
  EXPECT_DOUBLE_EQ(kept.lr(1e-3), 1e-3);
}

TEST(Pipeline, GlobalClippingMatchesTorchsClipGradNorm) {
  torch::manual_seed(1);
  const at::Tensor a = torch::randn({5, 7}) * 3, b = torch::randn({11}) * 3;
  std::vector<at::Tensor> ours = {a.clone(), b.clone()},
                          theirs = {a.clone().requires_grad_(), b.clone().requires_grad_()};
  for (at::Tensor& t : theirs) t.mutable_grad() = t.detach().clone();
  torch::nn::utils::clip_grad_norm_(theirs, 1.0);
  std::vector<NamedTensor> grads = {{"a", ours[0], TensorKind::kGradient}, {"b", ours[1], TensorKind::kGradient}};
  std::vector<at::Tensor> norms = {ours[0].norm(), ours[1].norm()};
  const double total = at::stack(norms).norm().item<double>();
  ClipOptions o;
  o.mode = ClipMode::kGlobal;
  GradClipper clipper(o);
  const ClipResult r = clipper.clip(grads, norms, total, 1, false);
  EXPECT_TRUE(torch::equal(ours[0], theirs[0].grad())) << "not bitwise";
  EXPECT_TRUE(torch::equal(ours[1], theirs[1].grad())) << "not bitwise";
  EXPECT_LT(r.coef, 1.0);
  // Control: max_norm above the norm leaves the gradients as they were.
  o.max_norm = total * 2;
  std::vector<NamedTensor> same = {{"a", a.clone(), TensorKind::kGradient}};
  GradClipper loose(o);
  loose.clip(same, {same[0].tensor.norm()}, same[0].tensor.norm().item<double>(), 1, false);
  EXPECT_TRUE(torch::equal(same[0].tensor, a));
}

// Gradients whose every element is finite but whose fp32 norm overflows (an exponent flip to
// -4.4e35): PyTorch's clip_grad_norm_ scales them by max_norm / inf, to zero, and so does global
// clipping here (as do per_tensor and adaptive clipping, by the same factor). Control: an Inf
// element is left as it is (ANonFiniteNormIsNeverClipped...).
TEST(Pipeline, AFiniteGradientWhoseNormOverflowsIsClippedToZeroAsTorchDoes) {
  const at::Tensor a = torch::tensor({-4.4e35f, 0.1f}), b = torch::tensor({0.5f, -0.25f, 2.0f});
  std::vector<at::Tensor> theirs = {a.clone().requires_grad_(), b.clone().requires_grad_()};
  for (at::Tensor& t : theirs) t.mutable_grad() = t.detach().clone();
  const double torch_total = torch::nn::utils::clip_grad_norm_(theirs, 1.0);
  EXPECT_TRUE(std::isinf(torch_total));
  for (ClipMode mode : {ClipMode::kGlobal, ClipMode::kPerTensor, ClipMode::kAdaptive}) {
    std::vector<NamedTensor> grads = {{"a", a.clone(), TensorKind::kGradient}, {"b", b.clone(), TensorKind::kGradient}};
    std::vector<at::Tensor> norms = {grads[0].tensor.norm(), grads[1].tensor.norm()};
    const double total = at::stack(norms).norm().item<double>();
    ASSERT_TRUE(std::isinf(total));
    ClipOptions o;
    o.mode = mode;
    GradClipper clipper(o);
    const ClipResult r = clipper.clip(grads, norms, total, 1, false);
    EXPECT_TRUE(torch::equal(grads[0].tensor, theirs[0].grad())) << to_string(mode) << grads[0].tensor;
    if (mode != ClipMode::kPerTensor) {  // per tensor, b's own norm is under max_norm
      EXPECT_TRUE(torch::equal(grads[1].tensor, theirs[1].grad())) << to_string(mode) << grads[1].tensor;
      EXPECT_EQ(r.coef, 0.0) << to_string(mode);
    }
    EXPECT_TRUE(std::isfinite(r.clipped_norm)) << to_string(mode);
  }
  // Control: an Inf element is not an overflow of finite values; it is left for the defenses
  // that handle non-finite gradients.
  std::vector<NamedTensor> inf = {{"a", torch::tensor({INFINITY, 0.1f}), TensorKind::kGradient}};
  std::vector<at::Tensor> inf_norms = {inf[0].tensor.norm()};
  ClipOptions o;
  o.mode = ClipMode::kGlobal;
  GradClipper clipper(o);
  const ClipResult r = clipper.clip(inf, inf_norms, INFINITY, 1, false);
  EXPECT_TRUE(std::isnan(r.coef));
  EXPECT_TRUE(std::isinf(inf[0].tensor[0].item<float>()));
}

TEST(Pipeline, ANonFiniteNormIsNeverClippedAndErrorIfNonfiniteRaises) {
  ClipOptions o;
  o.mode = ClipMode::kGlobal;
  o.error_if_nonfinite = true;
  GradClipper clipper(o);
  std::vector<NamedTensor> grads = {{"a", torch::tensor({1.0f, INFINITY}), TensorKind::kGradient}};
  EXPECT_THROW(clipper.clip(grads, {grads[0].tensor.norm()}, INFINITY, 4, false), Error);
  const ClipResult r = clipper.clip(grads, {grads[0].tensor.norm()}, INFINITY, 4, /*overflow_is_handled=*/true);
  EXPECT_TRUE(std::isnan(r.coef));
  EXPECT_TRUE(std::isinf(grads[0].tensor[1].item<float>()));  // left as it was
}

TEST(Pipeline, AStepWithoutBackwardIsAnErrorAndLeavesTheLrAsItWas) {
  Regressor p("");
  {
    DefendedStep s = p.defenses()->begin(1);
    s.batch(p.batch(1));
    EXPECT_THROW(s.finish(), Error);
  }
  EXPECT_DOUBLE_EQ(p.optimizer().param_groups()[0].options().get_lr(), 0.05);
  // The pipeline is usable again after the abandoned step.
  const StepOutcome o = p.step(1, p.batch(1), nullptr);
  EXPECT_TRUE(o.finite());
  EXPECT_FALSE(o.skipped);
}

TEST(Pipeline, AForwardWithoutTheBatchStageIsRefused) {
  // Without batch() a step would run without its rollback snapshot and state injections.
  Regressor p("");
  DefenseOptions o;
  o.rollback = true;
  p.defenses()->configure(o, {});
  {
    DefendedStep s = p.defenses()->begin(1);
    EXPECT_THROW((void)s.forward(), Error);
  }
  // Control: in order, the step runs.
  DefendedStep s = p.defenses()->begin(1);
  s.batch(p.batch(1));
  EXPECT_NO_THROW((void)s.forward());
}

TEST(Pipeline, EachStepSaysWhatTheDefensesDid) {
  // Rollback: the step that went non-finite says whose start it restored; loss scaling: the
  // scale it started with and the one after its backoff; clipping: the coefficient.
  Regressor p("");
  DefenseOptions o;
  o.rollback = true;
  o.loss_scaling.enabled = true;
  o.loss_scaling.init_scale = 1024;
  o.clip.mode = ClipMode::kGlobal;
  o.clip.max_norm = 1e-3;
  InjectionSpec nan;
  nan.type = InjectionType::kGradNonFinite;
  nan.step = 2;
  nan.mode = "nan";
  p.defenses()->configure(o, {nan});
  const StepOutcome s1 = p.step(1, p.batch(1), nullptr);
  EXPECT_FALSE(s1.skipped);
  EXPECT_LT(s1.clip_coef, 1.0);  // clipped hard: a norm far above 1e-3
  EXPECT_NEAR(s1.clipped_grad_norm, 1e-3, 1e-6);
  const StepOutcome s2 = p.step(2, p.batch(2), nullptr);
  EXPECT_TRUE(s2.skipped);
  EXPECT_EQ(s2.loss_scale, 1024);
  EXPECT_EQ(s2.loss_scale_after, 512);  // backed off
  EXPECT_FALSE(s2.rolled_back);         // the scaler skipped it and the parameters are finite: nothing to undo
  EXPECT_EQ(s2.rolled_back_to, 0);
  // Control: without the scaler, the NaN is applied and rollback restores step 2's start.
  Regressor q("");
  DefenseOptions r;
  r.rollback = true;
  q.defenses()->configure(r, {nan});
  q.step(1, q.batch(1), nullptr);
  const StepOutcome t2 = q.step(2, q.batch(2), nullptr);
  EXPECT_TRUE(t2.rolled_back);
  EXPECT_EQ(t2.rolled_back_to, 2);
  EXPECT_NE(t2.skip_reason.find("restored the state from the start of step 2"), std::string::npos) << t2.skip_reason;
}

// skip_nonfinite beside a loss scaler: gradients whose every element is finite but whose fp32 norm
// overflows (a loss spiked 1e22 times) pass the scaler, which looks for Inf and NaN elements as
// GradScaler does; skip_nonfinite skips that step as it does without a scaler, and the scale
// stays. Controls: without skip_nonfinite the scaler applies it; without the scaler,
// skip_nonfinite skipped it already.
TEST(Pipeline, SkipNonfiniteSkipsAnOverflowingNormBesideALossScaler) {
  InjectionSpec spike;
  spike.type = InjectionType::kLossSpike;
  spike.step = 2;
  spike.factor = 1e22;
  auto second_step = [&](bool scaler, bool skip) {
    Regressor p("");
    DefenseOptions o;
    o.loss_scaling.enabled = scaler;
    o.loss_scaling.init_scale = 1;
    o.skip_nonfinite = skip;
    p.defenses()->configure(o, {spike});
    p.step(1, p.batch(1), nullptr);
    return p.step(2, p.batch(2), nullptr);
  };
  const StepOutcome both = second_step(true, true);
  EXPECT_FALSE(std::isfinite(both.grad_norm));
  EXPECT_TRUE(both.skipped);
  EXPECT_EQ(both.skip_reason, "non-finite gradient norm (every element finite, their fp32 norm overflows)");
  EXPECT_EQ(both.loss_scale_after, 1);
  const StepOutcome scaler_alone = second_step(true, false);
  EXPECT_FALSE(std::isfinite(scaler_alone.grad_norm));
  EXPECT_FALSE(scaler_alone.skipped);
  const StepOutcome skip_alone = second_step(false, true);
  EXPECT_TRUE(skip_alone.skipped);
  EXPECT_EQ(skip_alone.skip_reason, "non-finite gradients");
}

TEST(Pipeline, ClipModeNamesParseOnceAndATypoIsAnError) {
  for (const std::string& name : clip_mode_names()) EXPECT_EQ(to_string(parse_clip_mode(name)), name);
  EXPECT_THROW(parse_clip_mode("adaptiv"), Error);
}

}  // namespace
}  // namespace retrace
