// The loss scaler: its scale trajectory equals torch.amp.GradScaler's documented update rule on
// a scripted overflow sequence, and a skipped step changes nothing.
#include <retrace/error.h>
#include <retrace/gtest.h>
#include <retrace/loss_scaler.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace retrace {
namespace {

// GradScaler's rule, written out independently of the implementation under test.
struct ReferenceRule {
  double scale;
  std::int64_t tracker = 0;
  void update(bool found_inf, double growth, double backoff, std::int64_t interval) {
    if (found_inf) {
      scale *= backoff;
      tracker = 0;
    } else if (++tracker == interval) {
      scale *= growth;
      tracker = 0;
    }
  }
};

TEST(LossScaler, ScaleTrajectoryFollowsGradScalersRule) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 1);
  torch::optim::SGD optimizer(linear->parameters(), torch::optim::SGDOptions(0.01));
  LossScalerOptions options;
  options.init_scale = 1024;
  options.growth_interval = 3;
  LossScaler scaler(options);
  ReferenceRule reference{options.init_scale};
  // 1 = the step overflows (an Inf gradient is injected), 0 = it does not.
  const std::vector<int> overflow = {0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0};
  std::int64_t skipped = 0, growths = 0;
  for (std::size_t s = 0; s < overflow.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    optimizer.zero_grad();
    scaler.scale(linear(torch::ones({2, 4})).sum()).backward();
    if (overflow[s]) linear->weight.grad()[0][1] = std::numeric_limits<float>::infinity();
    const double before = reference.scale;
    const bool skip = scaler.step(optimizer);
    reference.update(overflow[s], options.growth_factor, options.backoff_factor, options.growth_interval);
    EXPECT_EQ(skip, overflow[s] == 1);
    EXPECT_EQ(scaler.current_scale(), reference.scale);
    EXPECT_EQ(scaler.growth_tracker(), reference.tracker);
    skipped += skip;
    growths += reference.scale > before;
  }
  EXPECT_EQ(scaler.skipped_steps(), skipped);
  EXPECT_EQ(scaler.backoffs(), 4);
  EXPECT_EQ(scaler.growths(), growths);
  EXPECT_GT(growths, 0);  // it regrows after backing off
}

// DeepSpeed's DynamicLossScaler rule (delayed_shift = hysteresis, consecutive_hysteresis off, and
// min_scale), written out independently: an overflow while more than one hysteresis is left only
// spends one; otherwise it backs off (never below min_scale); a growth restores the hysteresis.
struct DeepSpeedRule {
  double scale;
  std::int64_t hysteresis, left, tracker = 0;
  double min_scale;
  void update(bool overflow, double growth, double backoff, std::int64_t interval) {
    if (overflow) {
      if (left > 1) {
        --left;
      } else {
        scale = std::max(scale * backoff, min_scale);
      }
      tracker = 0;
    } else if (++tracker == interval) {
      scale *= growth;
      tracker = 0;
      left = hysteresis;
    }
  }
};

TEST(LossScaler, HysteresisAndMinimumScaleFollowDeepSpeedsRule) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 1);
  torch::optim::SGD optimizer(linear->parameters(), torch::optim::SGDOptions(0.01));
  LossScalerOptions options;
  options.init_scale = 64;
  options.growth_interval = 2;
  options.hysteresis = 2;
  options.min_scale = 8;
  LossScaler scaler(options);
  DeepSpeedRule reference{options.init_scale, options.hysteresis, options.hysteresis, 0, options.min_scale};
  // Runs of overflows long enough to exhaust the hysteresis and to hit the floor, then regrowth.
  const std::vector<int> overflow = {1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0};
  std::int64_t backoffs = 0, tolerated = 0;
  for (std::size_t s = 0; s < overflow.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    optimizer.zero_grad();
    scaler.scale(linear(torch::ones({2, 4})).sum()).backward();
    if (overflow[s]) linear->weight.grad()[0][0] = std::numeric_limits<float>::quiet_NaN();
    const double before = reference.scale;
    const std::int64_t left_before = reference.left;
    EXPECT_EQ(scaler.step(optimizer), overflow[s] == 1);
    reference.update(overflow[s], options.growth_factor, options.backoff_factor, options.growth_interval);
    EXPECT_EQ(scaler.current_scale(), reference.scale);
    EXPECT_EQ(scaler.hysteresis_left(), reference.left);
    backoffs += reference.scale < before;
    tolerated += overflow[s] && left_before > 1;
  }
  EXPECT_EQ(scaler.backoffs(), backoffs);
  EXPECT_EQ(scaler.tolerated_overflows(), tolerated);
  EXPECT_GT(tolerated, 1);
  EXPECT_EQ(reference.min_scale, 8);
  EXPECT_GE(scaler.current_scale(), options.min_scale);
}

TEST(LossScaler, HysteresisRoundTripsThroughState) {
  LossScalerOptions options;
  options.hysteresis = 3;
  LossScaler a(options);
  torch::nn::Linear linear(2, 1);
  torch::optim::SGD optimizer(linear->parameters(), torch::optim::SGDOptions(0.01));
  a.scale(linear(torch::ones({1, 2})).sum()).backward();
  linear->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
  a.step(optimizer);
  EXPECT_EQ(a.hysteresis_left(), 2);
  LossScaler b(options);
  b.load_state(a.state());
  EXPECT_EQ(b.hysteresis_left(), 2);
  EXPECT_EQ(b.current_scale(), a.current_scale());
}

TEST(LossScaler, SkippedStepLeavesParametersAndOptimizerStateBitwiseUntouched) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 3);
  torch::optim::Adam optimizer(linear->parameters(), torch::optim::AdamOptions(0.01));
  LossScaler scaler;
  auto run = [&](bool overflow) {
    optimizer.zero_grad();
    scaler.scale(linear(torch::randn({5, 4})).pow(2).mean()).backward();
    if (overflow) linear->bias.grad()[0] = std::numeric_limits<float>::quiet_NaN();
    return scaler.step(optimizer);
  };
  ASSERT_FALSE(run(false));  // Adam state exists from here on
  const at::Tensor w = linear->weight.detach().clone(), b = linear->bias.detach().clone();
  auto& st = static_cast<torch::optim::AdamParamState&>(*optimizer.state().at(linear->weight.unsafeGetTensorImpl()));
  const at::Tensor m = st.exp_avg().clone(), v = st.exp_avg_sq().clone();
  const std::int64_t adam_step = st.step();
  EXPECT_TRUE(run(true));
  EXPECT_BITWISE_EQ(w, linear->weight.detach());
  EXPECT_BITWISE_EQ(b, linear->bias.detach());
  EXPECT_BITWISE_EQ(m, st.exp_avg());
  EXPECT_BITWISE_EQ(v, st.exp_avg_sq());
  EXPECT_EQ(adam_step, st.step());
  EXPECT_EQ(scaler.current_scale(), 65536.0 * 0.5);
  // Negative control: the same NaN without the scaler reaches the parameters.
  optimizer.zero_grad();
  linear(torch::randn({5, 4})).pow(2).mean().backward();
  linear->bias.grad()[0] = std::numeric_limits<float>::quiet_NaN();
  optimizer.step();
  EXPECT_TRUE(std::isnan(linear->bias[0].item<float>()));
}

TEST(LossScaler, UnscaleBeforeClippingGivesTheTrueGradients) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 1);
  torch::optim::SGD optimizer(linear->parameters(), torch::optim::SGDOptions(0.01));
  const at::Tensor x = torch::randn({3, 4});
  linear(x).sum().backward();
  const at::Tensor true_grad = linear->weight.grad().clone();
  optimizer.zero_grad();
  LossScaler scaler;  // 2^16: scaling and unscaling by a power of two is exact
  scaler.scale(linear(x).sum()).backward();
  EXPECT_TRUE(scaler.unscale(optimizer));
  EXPECT_BITWISE_EQ(true_grad, linear->weight.grad());
  EXPECT_THROW(scaler.unscale(optimizer), Error);
  EXPECT_FALSE(scaler.step(optimizer));
}

TEST(LossScaler, StateRoundTripsAndBadOptionsAreRejected) {
  LossScaler a;
  LossScaler b({8.0, 2.0, 0.5, 10});
  b.load_state(a.state());
  EXPECT_EQ(b.current_scale(), 65536.0);
  EXPECT_THROW(LossScaler({0.0, 2.0, 0.5, 10}), Error);
  EXPECT_THROW(LossScaler({1.0, 2.0, 1.5, 10}), Error);
}

}  // namespace
}  // namespace retrace
