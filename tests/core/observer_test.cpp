// Observers: one attached with ObserverOrder::kFirst runs before those attached earlier.
#include <retrace/checkpoint.h>
#include <retrace/observer.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

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
  ObserverScope watch(watching);                       // attached first, ordinary order
  ObserverScope zero(zeroing, ObserverOrder::kFirst);  // attached later, runs first
  const at::Tensor x = torch::ones({2, 3}, torch::requires_grad());
  const at::Tensor y = checkpoint(
      "seg", [](const at::Tensor& t) { return t * 3; }, x);
  EXPECT_TRUE(watching.saw_zeros);
  EXPECT_EQ(y.abs().sum().item<float>(), 0.0f);
}

}  // namespace
}  // namespace retrace
