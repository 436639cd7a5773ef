// The live recompute verifier: silent on a correct recompute, and it catches every way a
// recompute can go wrong (RNG, autocast, a perturbed value) naming the segment.
#include "../support/perturb.h"

#include <retrace/checkpoint.h>
#include <retrace/gtest.h>
#include <retrace/models.h>
#include <retrace/verify.h>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <memory>
#include <set>

namespace retrace {
namespace {

using test::PerturbRecompute;

models::TinyGpt make_gpt() {
  torch::manual_seed(0);
  models::GptConfig c;
  c.layers = 4;
  models::TinyGpt model(c);
  model.train();
  return model;
}

TEST(RecomputeVerifier, CorrectRecomputeIsVerifiedWithoutMismatch) {
  auto model = make_gpt();
  RecomputeVerifier verifier({VerifyPolicy::kThrow, false});
  ObserverScope scope(verifier);
  model.loss(model.make_batch(1), {4, {}}).backward();
  EXPECT_EQ(verifier.verified_outputs(), 4u);
  EXPECT_TRUE(verifier.mismatches().empty());
  EXPECT_EQ(verifier.pending_segments(), 0u);
}

TEST(RecomputeVerifier, RngPreservationOffIsReportedNamingTheSegment) {
  auto model = make_gpt();
  RecomputeVerifier verifier({VerifyPolicy::kWarn, /*keep_values=*/true});
  ObserverScope scope(verifier);
  models::CheckpointPlan plan{2, {}};
  plan.options.preserve_rng_state = false;
  model.loss(model.make_batch(1), plan).backward();
  const auto mismatches = verifier.mismatches();
  ASSERT_FALSE(mismatches.empty());
  std::vector<std::string> segments;
  for (const auto& m : mismatches) segments.push_back(m.segment);
  EXPECT_NE(std::find(segments.begin(), segments.end(), "block0..block1"), segments.end());
  const RecomputeMismatch& m = mismatches.front();
  EXPECT_EQ(m.output_index, 0u);
  EXPECT_NE(m.forward, m.recompute);
  ASSERT_TRUE(m.diff.has_value());
  EXPECT_GT(m.diff->differing, 0);
  EXPECT_NE(m.message().find("is not bitwise equal"), std::string::npos);
}

// The recompute of every selectively recomputed region -- attention cores, the norms and gelu
// feeding linear layers, dropout masks -- is verified like any segment's. Control: without RNG
// preservation exactly the regions that draw random numbers mismatch (the attention cores and the
// dropout masks), and the norms and gelus, which draw none, still verify.
TEST(RecomputeVerifier, SelectiveRecomputeIsVerifiedAndItsRngControlNamesTheRandomRegions) {
  auto model = make_gpt();
  {
    RecomputeVerifier verifier({VerifyPolicy::kThrow, false});
    ObserverScope scope(verifier);
    model.loss(model.make_batch(1), {0, {}, /*selective=*/true}).backward();
    EXPECT_EQ(verifier.verified_outputs(), 4u * 6);  // ln1, attention core and dropout, ln2, gelu, dropout
    EXPECT_TRUE(verifier.mismatches().empty());
  }
  RecomputeVerifier verifier({VerifyPolicy::kWarn, false});
  ObserverScope scope(verifier);
  models::CheckpointPlan plan{0, {}, true};
  plan.options.preserve_rng_state = false;
  model.loss(model.make_batch(1), plan).backward();
  std::set<std::string> mismatching;
  for (const auto& m : verifier.mismatches()) mismatching.insert(m.segment);
  std::set<std::string> random;
  for (int b = 0; b < 4; ++b) {
    for (const char* region : {".attention_core", ".attention_dropout", ".mlp_dropout"}) {
      random.insert("block" + std::to_string(b) + region);
    }
  }
  EXPECT_EQ(mismatching, random);
}

// A norm region feeding a linear layer whose recompute is perturbed is named, and only it: the
// other 23 regions of the step verify.
TEST(RecomputeVerifier, PerturbedNormRegionIsNamed) {
  auto model = make_gpt();
  PerturbRecompute perturb("block1.ln2");
  RecomputeVerifier verifier({VerifyPolicy::kRecord, false});
  ObserverScope first(perturb);
  ObserverScope second(verifier);
  model.loss(model.make_batch(1), {0, {}, true}).backward();
  EXPECT_EQ(verifier.verified_outputs(), 24u);
  const auto mismatches = verifier.mismatches();
  ASSERT_EQ(mismatches.size(), 1u);
  EXPECT_EQ(mismatches[0].segment, "block1.ln2");
  EXPECT_NE(mismatches[0].message().find("block1.ln2"), std::string::npos) << mismatches[0].message();
}

TEST(RecomputeVerifier, PerturbedRecomputeThrowsInThrowMode) {
  auto model = make_gpt();
  PerturbRecompute perturb("block2..block3");
  RecomputeVerifier verifier({VerifyPolicy::kThrow, /*keep_values=*/true});
  ObserverScope first(perturb);  // observers run in attach order: perturb, then verify
  ObserverScope second(verifier);
  at::Tensor loss = model.loss(model.make_batch(1), {2, {}});
  std::string msg;
  try {
    loss.backward();
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("segment 'block2..block3'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("output 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1 of 2048 elements differ"), std::string::npos) << msg;
}

TEST(RecomputeVerifier, WarnModeLetsTheStepFinish) {
  auto model = make_gpt();
  PerturbRecompute perturb("block0..block1");
  RecomputeVerifier verifier({VerifyPolicy::kWarn, false});
  ObserverScope first(perturb);
  ObserverScope second(verifier);
  EXPECT_NO_THROW(model.loss(model.make_batch(1), {2, {}}).backward());
  ASSERT_EQ(verifier.mismatches().size(), 1u);
  EXPECT_EQ(verifier.mismatches()[0].segment, "block0..block1");
  EXPECT_FALSE(verifier.mismatches()[0].diff.has_value());  // values not kept
}

TEST(RecomputeVerifier, OffPolicyChecksNothing) {
  auto model = make_gpt();
  PerturbRecompute perturb("block0..block1");
  RecomputeVerifier verifier({VerifyPolicy::kOff, false});
  ObserverScope first(perturb);
  ObserverScope second(verifier);
  model.loss(model.make_batch(1), {2, {}}).backward();
  EXPECT_EQ(verifier.verified_outputs(), 0u);
  EXPECT_TRUE(verifier.mismatches().empty());
}

// A recompute that runs in another precision: forward under bf16 autocast, recompute without.
TEST(RecomputeVerifier, AutocastNotRestoredIsCaught) {
  torch::manual_seed(0);
  torch::nn::Linear linear(8, 8);
  const at::Tensor x = torch::randn({4, 8}, torch::requires_grad());
  for (bool restore : {true, false}) {
    SCOPED_TRACE(restore ? "restore_autocast on" : "restore_autocast off");
    RecomputeVerifier verifier({VerifyPolicy::kWarn, false});
    ObserverScope scope(verifier);
    CheckpointOptions options;
    options.restore_autocast = restore;
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::Tensor y = checkpoint(
        "amp_seg", [&](const at::Tensor& in) { return linear(in); }, x, options);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    if (restore) {
      y.to(at::kFloat).sum().backward();
      EXPECT_TRUE(verifier.mismatches().empty());
    } else {
      try {
        y.to(at::kFloat).sum().backward();  // whatever autograd makes of the dtype change...
      } catch (const std::exception&) {
      }
      ASSERT_EQ(verifier.mismatches().size(), 1u);  // ...the verifier has said what happened
      EXPECT_EQ(verifier.mismatches()[0].forward_meta, "BFloat16[4, 8]");
      EXPECT_EQ(verifier.mismatches()[0].recompute_meta, "Float[4, 8]");
    }
  }
}

// Digests that behave like the device's: not ready when taken, finished (and counted) on get().
// They digest the values as they were when taken, as the device kernel does.
struct DeferredDigests {
  std::shared_ptr<std::atomic<int>> finished = std::make_shared<std::atomic<int>>(0);
  std::function<PendingDigest(const at::Tensor&)> function() const {
    return [finished = finished](const at::Tensor& t) {
      return PendingDigest([finished, value = t.detach().clone()] {
        ++*finished;
        return digest(value);
      });
    };
  }
};

// Notes, at each recompute, how many digests the verifier attached before it has waited for.
class WaitProbe : public SegmentObserver {
 public:
  explicit WaitProbe(std::shared_ptr<std::atomic<int>> finished) : finished_(std::move(finished)) {}
  void on_recompute(SegmentEvent&) override { seen.push_back(finished_->load()); }
  std::vector<int> seen;

 private:
  std::shared_ptr<std::atomic<int>> finished_;
};

// The device path, on the CPU: no wait per segment during backward; everything compared once
// backward's work is done.
TEST(RecomputeVerifier, DeviceDigestsAreComparedOnceAtTheEndOfBackward) {
  auto model = make_gpt();
  const DeferredDigests digests;
  RecomputeVerifier verifier({VerifyPolicy::kThrow, false, digests.function()});
  WaitProbe probe(digests.finished);
  ObserverScope first(verifier);
  ObserverScope second(probe);
  model.loss(model.make_batch(1), {4, {}}).backward();
  EXPECT_EQ(probe.seen, (std::vector<int>{0, 0, 0, 0}));  // nothing waited for while recomputing
  EXPECT_EQ(digests.finished->load(), 8);                 // 4 forward + 4 recompute, by backward's end
  EXPECT_EQ(verifier.verified_outputs(), 4u);
  EXPECT_TRUE(verifier.mismatches().empty());
  EXPECT_EQ(verifier.pending_segments(), 0u);
}

// kThrow on the device path: backward() throws, after every segment was recomputed, naming the
// perturbed one. Control: the same step without the perturbation passes (test above).
TEST(RecomputeVerifier, DeviceDigestMismatchThrowsFromBackwardNamingTheSegment) {
  auto model = make_gpt();
  const DeferredDigests digests;
  PerturbRecompute perturb("block2..block3");
  RecomputeVerifier verifier({VerifyPolicy::kThrow, /*keep_values=*/true, digests.function()});
  WaitProbe probe(digests.finished);
  ObserverScope first(perturb);
  ObserverScope second(verifier);
  ObserverScope third(probe);
  at::Tensor loss = model.loss(model.make_batch(1), {2, {}});
  std::string msg;
  try {
    loss.backward();
    ADD_FAILURE() << "backward did not throw";
  } catch (const RecomputeMismatchError& e) {
    msg = e.what();
    EXPECT_EQ(e.mismatch().segment, "block2..block3");
  }
  EXPECT_EQ(probe.seen.size(), 2u);  // both segments were recomputed before the comparison
  EXPECT_NE(msg.find("segment 'block2..block3'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1 of 2048 elements differ"), std::string::npos) << msg;
  ASSERT_EQ(verifier.mismatches().size(), 1u);
}

// kWarn and kRecord on the device path record the mismatch and let backward finish.
TEST(RecomputeVerifier, DeviceDigestMismatchIsRecordedInRecordMode) {
  auto model = make_gpt();
  const DeferredDigests digests;
  PerturbRecompute perturb("block0..block1");
  RecomputeVerifier verifier({VerifyPolicy::kRecord, false, digests.function()});
  ObserverScope first(perturb);
  ObserverScope second(verifier);
  EXPECT_NO_THROW(model.loss(model.make_batch(1), {2, {}}).backward());
  ASSERT_EQ(verifier.mismatches().size(), 1u);
  EXPECT_EQ(verifier.mismatches()[0].segment, "block0..block1");
  EXPECT_EQ(verifier.verified_outputs(), 2u);
}

// Outside a backward pass there is no end to wait for: the comparison is made at once.
TEST(RecomputeVerifier, DeviceDigestsOutsideBackwardAreComparedAtOnce) {
  const DeferredDigests digests;
  RecomputeVerifier verifier({VerifyPolicy::kRecord, false, digests.function()});
  const std::string name = "direct";
  const std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> forward_out{torch::ones({4})};
  SegmentEvent forward{name, 1, SegmentPhase::kForward, inputs, forward_out, true};
  verifier.on_forward(forward);
  EXPECT_EQ(digests.finished->load(), 0);
  std::vector<at::Tensor> recompute_out{torch::full({4}, 2.0f)};  // differs: the check can fail
  SegmentEvent recompute{name, 1, SegmentPhase::kRecompute, inputs, recompute_out, false};
  verifier.on_recompute(recompute);
  EXPECT_EQ(digests.finished->load(), 2);
  ASSERT_EQ(verifier.mismatches().size(), 1u);
  EXPECT_EQ(verifier.mismatches()[0].segment, "direct");
}

TEST(RecomputeVerifier, ParsesPolicies) {
  EXPECT_EQ(parse_verify_policy("warn"), VerifyPolicy::kWarn);
  EXPECT_EQ(parse_verify_policy("off"), VerifyPolicy::kOff);
  EXPECT_EQ(parse_verify_policy("throw"), VerifyPolicy::kThrow);
  EXPECT_THROW(parse_verify_policy("loud"), Error);
}

// Observers see every phase, in order, and may replace forward outputs.
class Recorder : public SegmentObserver {
 public:
  void on_forward(SegmentEvent& e) override { log.push_back("forward " + e.segment); }
  void on_recompute(SegmentEvent& e) override { log.push_back("recompute " + e.segment); }
  void on_backward(SegmentEvent& e) override {
    log.push_back("backward " + e.segment);
    grads_defined = e.outputs.size() == 1 && e.outputs[0].defined();
  }
  std::vector<std::string> log;
  bool grads_defined = false;
};

TEST(Observers, SeeForwardRecomputeBackwardInOrder) {
  auto model = make_gpt();
  Recorder rec;
  ObserverScope scope(rec);
  model.loss(model.make_batch(1), {2, {}}).backward();
  EXPECT_EQ(rec.log, (std::vector<std::string>{"forward block0..block1", "forward block2..block3",
                                               "recompute block2..block3", "backward block2..block3",
                                               "recompute block0..block1", "backward block0..block1"}));
  EXPECT_TRUE(rec.grads_defined);
}

class Doubler : public SegmentObserver {
 public:
  void on_forward(SegmentEvent& e) override { e.outputs[0] = e.outputs[0] * 2; }
};

TEST(Observers, MayReplaceForwardOutputs) {
  const at::Tensor x = torch::ones({3});
  Doubler d;
  ObserverScope scope(d);
  EXPECT_BITWISE_EQ(torch::full({3}, 2.0f), checkpoint(
                                                "d", [](const at::Tensor& in) { return in.clone(); }, x));
}

TEST(Observers, DetachedObserversAreNotCalled) {
  Recorder rec;
  { ObserverScope scope(rec); }
  EXPECT_FALSE(detail::observers_attached());
  const at::Tensor x = torch::ones({3}, torch::requires_grad());
  checkpoint(
      "quiet", [](const at::Tensor& in) { return in * 2; }, x)
      .sum()
      .backward();
  EXPECT_TRUE(rec.log.empty());
}

}  // namespace
}  // namespace retrace
