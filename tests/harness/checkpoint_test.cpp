// retrace::checkpoint: gradients bitwise equal to the plain model, and clear errors for misuse.
#include "../support/training.h"

#include <retrace/checkpoint.h>
#include <retrace/gtest.h>
#include <retrace/memory.h>
#include <retrace/models.h>
#include <retrace/observer.h>
#include <retrace/sequential.h>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <functional>
#include <optional>

namespace retrace {
namespace {

using models::CheckpointPlan;
using test::run_step;
using test::StepSnapshot;

void expect_same_step(const StepSnapshot& plain, const StepSnapshot& ckpt) {
  EXPECT_BITWISE_EQ(plain.loss, ckpt.loss);
  ASSERT_TRUE(plain.input_grad.defined());
  EXPECT_BITWISE_EQ(plain.input_grad, ckpt.input_grad);
  ASSERT_EQ(plain.grads.size(), ckpt.grads.size());
  for (std::size_t i = 0; i < plain.grads.size(); ++i) {
    SCOPED_TRACE(plain.grads[i].first);
    ASSERT_TRUE(plain.grads[i].second.defined());
    ASSERT_TRUE(ckpt.grads[i].second.defined());
    EXPECT_BITWISE_EQ(plain.grads[i].second, ckpt.grads[i].second);
  }
}

bool any_grad_differs(const StepSnapshot& a, const StepSnapshot& b) {
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    if (!bitwise_diff(a.grads[i].second, b.grads[i].second).bitwise_equal()) return true;
  }
  return false;
}

template <typename Model, typename Config>
void check_segments(Config config, int segments) {
  torch::manual_seed(0);
  Model model(config);
  model.train();  // dropout active
  const models::Batch batch = model.make_batch(7);
  const StepSnapshot plain = run_step(model, batch, CheckpointPlan{0, {}});
  const StepSnapshot ckpt = run_step(model, batch, CheckpointPlan{segments, {}});
  expect_same_step(plain, ckpt);
}

models::GptConfig gpt4() {
  models::GptConfig c;
  c.layers = 4;
  c.dropout = 0.2;
  return c;
}

models::LstmConfig lstm3() {
  models::LstmConfig c;
  c.layers = 3;
  c.dropout = 0.2;
  return c;
}

class TinyGptSegments : public ::testing::TestWithParam<int> {};
TEST_P(TinyGptSegments, LossAndEveryGradBitwiseEqualToPlain) { check_segments<models::TinyGpt>(gpt4(), GetParam()); }
INSTANTIATE_TEST_SUITE_P(Checkpoint, TinyGptSegments, ::testing::Values(1, 2, 4));

class LstmSegments : public ::testing::TestWithParam<int> {};
TEST_P(LstmSegments, LossAndEveryGradBitwiseEqualToPlain) { check_segments<models::LstmLm>(lstm3(), GetParam()); }
INSTANTIATE_TEST_SUITE_P(Checkpoint, LstmSegments, ::testing::Values(1, 2, 3));

class MlpSegments : public ::testing::TestWithParam<int> {};
TEST_P(MlpSegments, LossAndEveryGradBitwiseEqualToPlain) {
  check_segments<models::Mlp>(models::MlpConfig{}, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Checkpoint, MlpSegments, ::testing::Values(1, 2, 4));

// Negative control for the tests above: without RNG preservation the recompute draws other
// dropout masks, and the comparison must see it.
TEST(Checkpoint, WithoutRngPreservationDropoutGradsDiffer) {
  torch::manual_seed(0);
  models::TinyGpt model(gpt4());
  model.train();
  const models::Batch batch = model.make_batch(7);
  const StepSnapshot plain = run_step(model, batch, CheckpointPlan{0, {}});
  CheckpointPlan broken{2, {}};
  broken.options.preserve_rng_state = false;
  const StepSnapshot ckpt = run_step(model, batch, broken);
  EXPECT_BITWISE_EQ(plain.loss, ckpt.loss);    // the forward is the same...
  EXPECT_TRUE(any_grad_differs(plain, ckpt));  // ...the gradients are not
}

// Selective recompute (CheckpointPlan::selective: each block's attention core recomputed, the
// rest kept) trains the same bits as the plain model, dropout in the attention core included.
// Control: without RNG preservation the attention cores' dropout draws other masks and the
// gradients differ.
TEST(Checkpoint, SelectiveRecomputeIsBitwiseEqualToPlainAndItsRngControlIsNot) {
  torch::manual_seed(0);
  models::TinyGpt model(gpt4());
  model.train();
  const models::Batch batch = model.make_batch(7);
  const StepSnapshot plain = run_step(model, batch, CheckpointPlan{0, {}});
  const StepSnapshot selective = run_step(model, batch, CheckpointPlan{0, {}, /*selective=*/true});
  expect_same_step(plain, selective);
  CheckpointPlan broken{0, {}, true};
  broken.options.preserve_rng_state = false;
  const StepSnapshot off = run_step(model, batch, broken);
  EXPECT_BITWISE_EQ(plain.loss, off.loss);
  EXPECT_TRUE(any_grad_differs(plain, off));
  EXPECT_THROW(run_step(model, batch, CheckpointPlan{2, {}, true}), Error);  // segments and selective: one or the other
}

// A region recomputes only under a policy naming its kind, with grad mode on, outside any
// checkpointed segment; every other time it runs plainly and no observer sees it.
TEST(Checkpoint, RegionsRecomputeOnlyUnderAPolicyAndOutsideSegments) {
  struct Names : SegmentObserver {
    std::vector<std::string> forwards, recomputes;
    void on_forward(SegmentEvent& e) override { forwards.push_back(e.segment); }
    void on_recompute(SegmentEvent& e) override { recomputes.push_back(e.segment); }
  };
  const at::Tensor x = torch::randn({3}, torch::requires_grad());
  const SegmentFn square = [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0] * in[0]}; };
  const auto run = [&](Names& names) {
    x.mutable_grad() = at::Tensor();
    ObserverScope scope(names);
    recompute_region("r", RegionKind::kAttentionCore, square, {x})[0].sum().backward();
  };
  Names none;
  run(none);
  EXPECT_TRUE(none.forwards.empty());
  {
    RecomputePolicyScope other(RecomputePolicy{{}, {}});  // a policy naming no kind
    Names names;
    run(names);
    EXPECT_TRUE(names.forwards.empty());
  }
  {
    RecomputePolicyScope policy(RecomputePolicy::selective());
    Names names;
    run(names);
    EXPECT_EQ(names.forwards, std::vector<std::string>{"r"});
    EXPECT_EQ(names.recomputes, std::vector<std::string>{"r"});
    EXPECT_BITWISE_EQ(x.grad(), 2 * x);
    Names inside;
    x.mutable_grad() = at::Tensor();
    {
      ObserverScope scope(inside);
      checkpoint(
          "outer",
          [&](const at::Tensor& in) { return recompute_region("r", RegionKind::kAttentionCore, square, {in})[0]; }, x)
          .sum()
          .backward();
    }
    EXPECT_EQ(inside.forwards, std::vector<std::string>{"outer"});  // the segment recomputes its region itself
    {
      torch::NoGradGuard no_grad;
      Names off;
      ObserverScope scope(off);
      recompute_region("r", RegionKind::kAttentionCore, square, {x});
      EXPECT_TRUE(off.forwards.empty());
    }
  }
}

// The parameters' and input's gradients of one forward + backward of f(x).sum().
struct Grads {
  at::Tensor out, x;
  std::vector<at::Tensor> params;
};
Grads grads_of(const std::function<at::Tensor(const at::Tensor&)>& f, const at::Tensor& x0,
               const std::vector<at::Tensor>& params, std::int64_t* held = nullptr) {
  for (const at::Tensor& p : params) p.mutable_grad() = at::Tensor();
  const at::Tensor x = x0.detach().requires_grad_(true);
  Grads g;
  {
    std::optional<CpuMemoryCounter> counter;
    if (held != nullptr) counter.emplace();
    g.out = f(x);
    if (held != nullptr) *held = counter->live_bytes() - g.out.nbytes();
  }
  (g.out * g.out).sum().backward();  // a non-uniform output gradient
  g.x = x.grad();
  for (const at::Tensor& p : params) g.params.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return g;
}

void expect_same(const Grads& a, const Grads& b) {
  EXPECT_BITWISE_EQ(a.out, b.out);
  EXPECT_BITWISE_EQ(a.x, b.x);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_EQ(a.params[i].defined(), b.params[i].defined());
    if (a.params[i].defined()) {
      EXPECT_BITWISE_EQ(a.params[i], b.params[i]);
    }
  }
}

bool any_differs(const Grads& a, const Grads& b) {
  if (!bitwise_diff(a.x, b.x).bitwise_equal()) return true;
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    if (a.params[i].defined() && !bitwise_diff(a.params[i], b.params[i]).bitwise_equal()) return true;
  }
  return false;
}

// recompute_linear_input(): linear(fn(x)) with fn's output recomputed in backward, not kept. The
// output and every gradient are the plain model's bits for 3-D and 2-D inputs, a norm with
// parameters and an activation, in float and double, with the weight contiguous and laid out
// transposed (the two branches of addmm's weight gradient); fn's output is not held between
// forward and backward; the 3-D output is a view that can be modified in place, as at::linear's.
// Controls: in double the two branches of the weight gradient give other bits, so the comparison
// would see the wrong one taken; a region drawing dropout recomputed without RNG preservation
// gets other gradients, so it sees the recompute.
TEST(Checkpoint, RecomputeLinearInputIsBitwisePlainAndKeepsOnlyItsInput) {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(3);
    torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({16}));
    torch::nn::Linear fc(16, 24);
    ln->to(dtype);
    fc->to(dtype);
    const at::Tensor transposed = torch::randn({16, 24}, dtype).t().detach().requires_grad_(true);  // strides (1, 24)
    const std::vector<at::Tensor> params = {ln->weight, ln->bias, fc->weight, fc->bias, transposed};
    const TensorFn norm = [ln](const at::Tensor& x) mutable { return ln(x); };
    const TensorFn act = [](const at::Tensor& x) { return at::gelu(x); };
    const auto run = [&](RegionKind kind, const TensorFn& fn, const at::Tensor& weight, const at::Tensor& x,
                         std::optional<RecomputePolicy> policy, std::int64_t* held = nullptr) {
      std::optional<RecomputePolicyScope> scope;
      if (policy) scope.emplace(*policy);
      return grads_of([&](const at::Tensor& in) { return recompute_linear_input("r", kind, fn, in, weight, fc->bias); },
                      x, params, held);
    };
    const at::Tensor x3 = torch::randn({4, 32, 16}, dtype), x2 = torch::randn({128, 16}, dtype);
    for (const at::Tensor& x : {x3, x2}) {
      for (const at::Tensor& w : {fc->weight, transposed}) {
        SCOPED_TRACE(std::to_string(x.dim()) + "-D, weight strides " + std::to_string(w.stride(0)));
        std::int64_t held_plain = 0, held_recomputed = 0;
        expect_same(run(RegionKind::kNorm, norm, w, x, std::nullopt, &held_plain),
                    run(RegionKind::kNorm, norm, w, x, RecomputePolicy::selective(), &held_recomputed));
        // Plain keeps ln's output and statistics; recomputed, the RNG state (5056 bytes, not a
        // tensor) and no tensor.
        EXPECT_GE(held_plain, x.nbytes());
        EXPECT_LT(held_recomputed, 6 * 1024);
        expect_same(run(RegionKind::kActivation, act, w, x, std::nullopt),
                    run(RegionKind::kActivation, act, w, x, RecomputePolicy::selective()));
      }
    }
    // The control of the branches: mm_mat2_backward's two ways of computing the same product.
    // Whether they give other bits is the BLAS's choice (they do in double with this machine's
    // MKL; on the H200 machine's 16-core CPU they agree in both dtypes). Where they agree the
    // branch taken cannot change a gradient's bits, so there is nothing for the control to show:
    // it is reported, not failed.
    const at::Tensor g = torch::randn({128, 24}, dtype), a = torch::randn({128, 16}, dtype);
    const bool branches_differ = !bitwise_diff(g.t().mm(a), a.t().mm(g).t()).bitwise_equal();
    RecordProperty(std::string("weight_grad_branches_differ_") + c10::toString(dtype), branches_differ ? 1 : 0);
    if (!branches_differ) {
      std::cout << "note: in " << c10::toString(dtype)
                << " this BLAS computes both weight-gradient branches alike; the branch control shows nothing here\n";
    }
    RecomputePolicyScope policy(RecomputePolicy::selective());
    at::Tensor y = recompute_linear_input("r", RegionKind::kNorm, norm, x3.requires_grad_(true), fc->weight, fc->bias);
    EXPECT_NO_THROW(y.add_(1));
  }
  torch::nn::Linear fc(16, 24);
  const std::vector<at::Tensor> params = {fc->weight, fc->bias};
  const at::Tensor x3 = torch::randn({4, 32, 16});
  const auto run = [&](std::optional<RecomputePolicy> policy) {
    std::optional<RecomputePolicyScope> scope;
    if (policy) scope.emplace(*policy);
    torch::manual_seed(5);
    return grads_of(
        [&](const at::Tensor& in) {
          return recompute_linear_input(
              "r", RegionKind::kActivation, [](const at::Tensor& t) { return at::dropout(t, 0.5, true); }, in,
              fc->weight, fc->bias);
        },
        x3, params);
  };
  const Grads plain = run(std::nullopt);
  expect_same(plain, run(RecomputePolicy::selective()));
  RecomputePolicy broken = RecomputePolicy::selective();
  broken.options.preserve_rng_state = false;
  const Grads off = run(broken);
  EXPECT_BITWISE_EQ(plain.out, off.out);  // the forward is the same...
  EXPECT_TRUE(any_differs(plain, off));   // ...the gradients are not
}

// recompute_dropout(): at::dropout's output and gradient bit for bit, holding the mask's bits
// between forward and backward instead of the float mask -- in every floating dtype, for sizes
// that fill the last byte of bits and sizes that do not, and for drop rates whose 1 / (1 - p) is
// not exact. Control: without RNG preservation the mask is drawn again in backward, and it is
// another one.
TEST(Checkpoint, RecomputeDropoutIsBitwisePlainAndKeepsNoMask) {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const std::vector<std::int64_t>& sizes : {std::vector<std::int64_t>{8, 32, 16}, {7, 13, 3}, {5}}) {
      for (const double p : {0.1, 0.3, 0.45, 0.9}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + c10::str(at::IntArrayRef(sizes)) +
                     " p=" + std::to_string(p));
        const at::Tensor x = torch::randn(sizes).to(dtype);
        const auto grads = [&](bool selective) {
          std::optional<RecomputePolicyScope> scope;
          if (selective) scope.emplace(RecomputePolicy::selective());
          torch::manual_seed(9);
          return grads_of([p](const at::Tensor& in) { return recompute_dropout("d", in * 1.0, p, true); }, x, {});
        };
        expect_same(grads(false), grads(true));
      }
    }
  }
  const at::Tensor x = torch::randn({8, 32, 16});
  const auto run = [&](std::optional<RecomputePolicy> policy, std::int64_t* held = nullptr) {
    std::optional<RecomputePolicyScope> scope;
    if (policy) scope.emplace(*policy);
    torch::manual_seed(9);
    return grads_of([](const at::Tensor& in) { return recompute_dropout("d", in * 1.0, 0.3, true); }, x, {}, held);
  };
  std::int64_t held_plain = 0, held_recomputed = 0;
  const Grads plain = run(std::nullopt, &held_plain);
  expect_same(plain, run(RecomputePolicy::selective(), &held_recomputed));
  EXPECT_GE(held_plain, x.nbytes());                 // the float mask
  EXPECT_LE(held_recomputed, x.numel() / 8 + 1024);  // its bits
  RecomputePolicy broken = RecomputePolicy::selective();
  broken.options.preserve_rng_state = false;
  const Grads off = run(broken);
  EXPECT_BITWISE_EQ(plain.out, off.out);
  EXPECT_FALSE(bitwise_diff(plain.x, off.x).bitwise_equal());
  // Plain where recomputing buys nothing: eval mode, p = 0, no grad required.
  struct Count : SegmentObserver {
    int forwards = 0;
    void on_forward(SegmentEvent&) override { ++forwards; }
  } count;
  ObserverScope observe(count);
  RecomputePolicyScope policy(RecomputePolicy::selective());
  EXPECT_BITWISE_EQ(recompute_dropout("d", x, 0.3, false), x);
  EXPECT_BITWISE_EQ(recompute_dropout("d", x.requires_grad_(true), 0.0, true), x);
  recompute_dropout("d", x.detach(), 0.3, true);
  EXPECT_EQ(count.forwards, 0);
}

// recompute_dropout() inside a checkpointed segment: the recompute rebuilds the forward's mask
// from its bits instead of drawing again, and moves the generator to where the forward's draw
// left it, so a plain dropout after it in the same segment draws the same mask too: the gradients
// are the plain model's bits (they would not be if the generator were left at the segment's
// start). Controls: without RNG preservation they differ; a recompute that runs its dropout on
// another shape is named as not deterministic (the mask came from the forward's record).
TEST(Checkpoint, DropoutInsideASegmentReplaysItsMaskAndLeavesTheGeneratorAsTheForwardDid) {
  torch::nn::Linear fc(16, 16);
  const std::vector<at::Tensor> params = {fc->weight, fc->bias};
  const TensorFn body = [fc](const at::Tensor& x) mutable {
    const at::Tensor h = recompute_dropout("d", fc(x), 0.3, true);
    return at::dropout(at::tanh(h), 0.2, true);  // draws after the replayed mask
  };
  const at::Tensor x = torch::randn({8, 16, 16});
  const auto run = [&](std::optional<CheckpointOptions> options) {
    torch::manual_seed(11);
    return grads_of([&](const at::Tensor& in) { return options ? checkpoint("seg", body, in, *options) : body(in); }, x,
                    params);
  };
  const Grads plain = run(std::nullopt);
  expect_same(plain, run(CheckpointOptions{}));
  CheckpointOptions off;
  off.preserve_rng_state = false;
  const Grads broken = run(off);
  EXPECT_BITWISE_EQ(plain.out, broken.out);
  EXPECT_TRUE(any_differs(plain, broken));
  int calls = 0;
  const TensorFn shifting = [&calls](const at::Tensor& in) {
    return recompute_dropout("d", ++calls == 1 ? in : in.narrow(0, 0, 4), 0.5, true).sum(0);
  };
  const at::Tensor leaf = torch::randn({8, 4}, torch::requires_grad());
  try {
    checkpoint("shifting", shifting, leaf).sum().backward();
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("retrace::checkpoint(\"shifting\"): dropout 0 of the recompute is "
                                         "p=0.500000 on Float[4, 4] but the forward's was p=0.500000 on Float[8, 4]"),
              std::string::npos)
        << e.what();
  }
}

// The regions feeding a linear layer, and dropout, are segments to observers (their recompute
// is what the verifier compares); misuse is a CheckpointError naming the region.
TEST(Checkpoint, LinearInputRegionsReportEventsAndNameTheirMisuse) {
  struct Names : SegmentObserver {
    std::vector<std::string> seen;
    void on_forward(SegmentEvent& e) override { seen.push_back("forward " + e.segment); }
    void on_recompute(SegmentEvent& e) override { seen.push_back("recompute " + e.segment); }
    void on_backward(SegmentEvent& e) override { seen.push_back("backward " + e.segment); }
  } names;
  torch::nn::Linear fc(6, 5);
  const at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
  {
    ObserverScope scope(names);
    RecomputePolicyScope policy(RecomputePolicy::selective());
    const at::Tensor h = recompute_linear_input(
        "act", RegionKind::kActivation, [](const at::Tensor& t) { return at::relu(t); }, x, fc->weight, fc->bias);
    recompute_dropout("drop", h, 0.5, true).sum().backward();
  }
  EXPECT_EQ(names.seen, (std::vector<std::string>{"forward act", "forward drop", "recompute drop", "backward drop",
                                                  "recompute act", "backward act"}));
  RecomputePolicyScope policy(RecomputePolicy::selective());
  const auto message = [&](RegionKind kind, TensorFn fn) {
    try {
      recompute_linear_input("block1.ln2", kind, std::move(fn), x, fc->weight, fc->bias).sum().backward();
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(RegionKind::kNorm, [](const at::Tensor& t) { return t.t().t().t(); })
                .find("retrace::checkpoint(\"block1.ln2\"): a region feeding a linear layer must return one contiguous "
                      "2-D or 3-D tensor; at forward it returned Float[6, 3] (strided)"),
            std::string::npos);
  EXPECT_NE(message(RegionKind::kAttentionCore, [](const at::Tensor& t) { return t; })
                .find("takes a norm or activation region, not attention_core"),
            std::string::npos);
  // Double backward has no graph through the recompute: refused, never silently first-order.
  {
    const at::Tensor h = recompute_linear_input(
        "block1.gelu", RegionKind::kActivation, [](const at::Tensor& t) { return at::gelu(t); }, x, fc->weight,
        fc->bias);
    try {
      torch::autograd::backward({h.sum()}, {}, /*retain_graph=*/true, /*create_graph=*/true);
      ADD_FAILURE() << "no error";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("retrace::checkpoint(\"block1.gelu\"): backward runs with "
                                           "create_graph=true (double backward)"),
                std::string::npos)
          << e.what();
    }
  }
  // Under autocast the linear layer casts its input: the region runs plainly.
  at::autocast::set_autocast_enabled(at::kCPU, true);
  Names none;
  {
    ObserverScope scope(none);
    recompute_linear_input(
        "act", RegionKind::kActivation, [](const at::Tensor& t) { return at::relu(t); }, x, fc->weight, fc->bias);
  }
  at::autocast::set_autocast_enabled(at::kCPU, false);
  EXPECT_TRUE(none.seen.empty());
}

// torch::nn::LSTM on CPU (oneDNN) computes other bits under no-grad than with grad. A forward
// under no-grad, as torch.utils.checkpoint runs it, therefore changes the model's numerics; the
// default ForwardMode::kLikeRecompute is what keeps the LSTM bitwise (LstmSegments above).
TEST(Checkpoint, NoGradForwardOfOneDnnLstmIsNotBitwise) {
  torch::manual_seed(0);
  models::LstmLm model(lstm3());
  model.train();
  const models::Batch batch = model.make_batch(7);
  const StepSnapshot plain = run_step(model, batch, CheckpointPlan{0, {}});
  CheckpointPlan nograd{3, {}};
  nograd.options.forward_mode = ForwardMode::kNoGrad;
  const StepSnapshot ckpt = run_step(model, batch, nograd);
  EXPECT_TRUE(any_grad_differs(plain, ckpt));
}

TEST(Checkpoint, AutocastBf16OnCpuBitwiseEqualToPlain) {
  torch::manual_seed(0);
  models::TinyGpt model(gpt4());
  model.train();
  const models::Batch batch = model.make_batch(3);
  auto step = [&](int segments) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    model.zero_grad();
    torch::manual_seed(5);
    at::Tensor loss = model.loss(batch, CheckpointPlan{segments, {}});
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    loss.backward();  // outside autocast, as recommended; the recompute re-enters it
    std::vector<at::Tensor> grads{loss.detach()};
    for (const auto& p : model.parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto plain = step(0);
  const auto ckpt = step(2);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (std::size_t i = 0; i < plain.size(); ++i) EXPECT_BITWISE_EQ(plain[i], ckpt[i]);
}

TEST(Checkpoint, ParameterGradsArriveWhenNoInputRequiresGrad) {
  torch::manual_seed(0);
  torch::nn::Linear linear(8, 8);
  const at::Tensor x = torch::randn({4, 8});  // requires_grad == false
  ASSERT_FALSE(x.requires_grad());
  at::Tensor y = checkpoint(
      "linear", [&](const at::Tensor& in) { return linear(in).tanh(); }, x);
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  ASSERT_TRUE(linear->weight.grad().defined());
  const at::Tensor ckpt_weight = linear->weight.grad().clone();
  const at::Tensor ckpt_bias = linear->bias.grad().clone();
  linear->zero_grad();
  linear(x).tanh().sum().backward();
  EXPECT_BITWISE_EQ(linear->weight.grad(), ckpt_weight);
  EXPECT_BITWISE_EQ(linear->bias.grad(), ckpt_bias);
}

TEST(Checkpoint, SeveralInputsAndOutputs) {
  torch::manual_seed(0);
  const at::Tensor a = torch::randn({3, 4}, torch::requires_grad());
  const at::Tensor b = torch::randn({3, 4}, torch::requires_grad());
  auto fn = [](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{in[0] * in[1], (in[0] + in[1]).sin(), in[1].exp()};
  };
  auto outs = checkpoint("multi", fn, {a, b});
  ASSERT_EQ(outs.size(), 3u);
  (outs[0].sum() + outs[1].pow(2).sum() + 3 * outs[2].mean()).backward();
  const at::Tensor ga = a.grad().clone(), gb = b.grad().clone();
  a.grad().zero_();
  b.grad().zero_();
  auto plain = fn({a, b});
  (plain[0].sum() + plain[1].pow(2).sum() + 3 * plain[2].mean()).backward();
  EXPECT_BITWISE_EQ(a.grad(), ga);
  EXPECT_BITWISE_EQ(b.grad(), gb);
}

TEST(Checkpoint, OutputWithoutIncomingGradIsFine) {
  const at::Tensor a = torch::randn({5}, torch::requires_grad());
  auto outs = checkpoint("two",
                         [](const std::vector<at::Tensor>& in) {
                           return std::vector<at::Tensor>{in[0] * 2, in[0] * 3};
                         },
                         {a});
  outs[1].sum().backward();  // outs[0] receives no gradient
  EXPECT_BITWISE_EQ(torch::full({5}, 3.0f), a.grad());
}

TEST(Checkpoint, NoGradModeRunsPlainAndKeepsNothing) {
  torch::NoGradGuard no_grad;
  const at::Tensor x = torch::randn({2, 2});
  at::Tensor y = checkpoint(
      "nograd", [](const at::Tensor& in) { return in * 2; }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_BITWISE_EQ(x * 2, y);
}

TEST(Checkpoint, NestedCheckpointsGiveSameGrads) {
  torch::manual_seed(1);
  torch::nn::Linear l1(6, 6), l2(6, 6);
  const at::Tensor x = torch::randn({2, 6}, torch::requires_grad());
  auto inner = [&](const at::Tensor& h) { return torch::dropout(l2(h).relu(), 0.3, true); };
  auto outer = [&](const at::Tensor& h) { return checkpoint("inner", inner, torch::dropout(l1(h).tanh(), 0.3, true)); };
  torch::manual_seed(9);
  checkpoint("outer", outer, x).sum().backward();
  const at::Tensor g = x.grad().clone(), gw = l1->weight.grad().clone();
  x.grad().zero_();
  l1->zero_grad();
  l2->zero_grad();
  torch::manual_seed(9);
  inner(torch::dropout(l1(x).tanh(), 0.3, true)).sum().backward();
  EXPECT_BITWISE_EQ(x.grad(), g);
  EXPECT_BITWISE_EQ(l1->weight.grad(), gw);
}

TEST(Checkpoint, SequentialModuleBitwiseEqualToPlainWithDropout) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 3; ++i) {
    seq->push_back(torch::nn::Linear(8, 8));
    seq->push_back(torch::nn::GELU());
    seq->push_back(torch::nn::Dropout(0.3));
  }
  const at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  torch::manual_seed(11);
  seq->forward(x).pow(2).sum().backward();
  std::vector<at::Tensor> plain{x.grad().clone()};
  for (const auto& p : seq->parameters()) plain.push_back(p.grad().clone());
  seq->zero_grad();
  x.grad().zero_();
  torch::manual_seed(11);
  checkpoint_sequential(seq, 3, x).pow(2).sum().backward();
  std::vector<at::Tensor> ckpt{x.grad().clone()};
  for (const auto& p : seq->parameters()) ckpt.push_back(p.grad().clone());
  ASSERT_EQ(plain.size(), ckpt.size());
  for (std::size_t i = 0; i < plain.size(); ++i) EXPECT_BITWISE_EQ(plain[i], ckpt[i]);
}

TEST(Checkpoint, SegmentNamesOfSequentialGroups) {
  std::vector<Stage> stages;
  for (int i = 0; i < 5; ++i) stages.push_back({"s" + std::to_string(i), [](const at::Tensor& x) { return x; }});
  EXPECT_EQ(segment_names(stages, 2), (std::vector<std::string>{"s0..s2", "s3..s4"}));
  EXPECT_EQ(segment_names(stages, 5)[4], "s4");
  EXPECT_THROW(segment_names(stages, 0), Error);
  EXPECT_THROW(segment_names(stages, 6), Error);
}

// --- misuse is a clear error naming the segment ---------------------------------------------

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

TEST(CheckpointErrors, NoTensorReturned) {
  const at::Tensor x = torch::randn({2}, torch::requires_grad());
  const std::string msg = error_of(
      [&] { checkpoint("empty_seg", [](const std::vector<at::Tensor>&) { return std::vector<at::Tensor>{}; }, {x}); });
  EXPECT_NE(msg.find("\"empty_seg\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("returned no tensor"), std::string::npos) << msg;
}

TEST(CheckpointErrors, UndefinedOutput) {
  const at::Tensor x = torch::randn({2}, torch::requires_grad());
  const std::string msg = error_of([&] {
    checkpoint(
        "undef_seg", [](const at::Tensor&) { return at::Tensor(); }, x);
  });
  EXPECT_NE(msg.find("undef_seg"), std::string::npos) << msg;
  EXPECT_NE(msg.find("undefined"), std::string::npos) << msg;
}

TEST(CheckpointErrors, NonFloatingOutput) {
  const at::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  const std::string msg = error_of([&] {
    checkpoint(
        "argmax_seg", [](const at::Tensor& in) { return in.argmax(1); }, x);
  });
  EXPECT_NE(msg.find("argmax_seg"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Long[2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not floating point"), std::string::npos) << msg;
}

TEST(CheckpointErrors, MixedInputDevices) {
  const at::Tensor cpu = torch::randn({2}, torch::requires_grad());
  const at::Tensor meta = torch::empty({2}, torch::TensorOptions().device(at::kMeta));
  const std::string msg = error_of([&] {
    checkpoint("mixed_seg", [](const std::vector<at::Tensor>& in) { return in; }, {cpu, meta});
  });
  EXPECT_NE(msg.find("mixed_seg"), std::string::npos) << msg;
  EXPECT_NE(msg.find("input 1 is on meta"), std::string::npos) << msg;
}

TEST(CheckpointErrors, OutputOnAnotherDevice) {
  const at::Tensor x = torch::randn({2}, torch::requires_grad());
  const std::string msg = error_of([&] {
    checkpoint(
        "move_seg", [](const at::Tensor& in) { return in.to(at::kMeta); }, x);
  });
  EXPECT_NE(msg.find("move_seg"), std::string::npos) << msg;
  EXPECT_NE(msg.find("output 0 is on meta but the inputs are on cpu"), std::string::npos) << msg;
}

TEST(CheckpointErrors, AutogradGradWithInputsIsRefused) {
  torch::nn::Linear linear(4, 4);
  const at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  at::Tensor y = checkpoint(
      "grad_seg", [&](const at::Tensor& in) { return linear(in); }, x);
  std::string msg;
  try {
    torch::autograd::grad({y.sum()}, {x});
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("grad_seg"), std::string::npos) << msg;
  EXPECT_NE(msg.find("torch::autograd::grad()"), std::string::npos) << msg;
}

TEST(CheckpointErrors, EmptyFunction) {
  const at::Tensor x = torch::randn({2});
  EXPECT_THROW(checkpoint("nofn", TensorFn(), x), CheckpointError);
}

}  // namespace
}  // namespace retrace
