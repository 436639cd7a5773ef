#pragma once
// Test support: an observer that makes a segment's recompute differ from its forward, the
// negative control of every recompute-verification test.

#include <retrace/observer.h>

#include <torch/torch.h>

#include <string>
#include <utility>

namespace retrace::test {

// Adds `delta` to element 3 of the named segment's first output at recompute.
class PerturbRecompute : public SegmentObserver {
 public:
  explicit PerturbRecompute(std::string segment, double delta = 1e-3) : segment_(std::move(segment)), delta_(delta) {}
  void on_recompute(SegmentEvent& e) override {
    if (e.segment != segment_) return;
    at::Tensor changed = e.outputs[0].clone();
    {
      torch::NoGradGuard no_grad;
      changed.view(-1)[3].add_(delta_);
    }
    e.outputs[0] = changed;
  }

 private:
  std::string segment_;
  double delta_;
};

}  // namespace retrace::test
