#pragma once
// Dynamic loss scaling for mixed precision, on ATen's own AMP ops
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_): the C++ counterpart of
// torch.amp.GradScaler, which LibTorch lacks (pytorch issue 44710). Its step() *returns* whether
// it skipped, instead of skipping invisibly.
//
//   retrace::LossScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale(optimizer);          // optional: before clipping
//   clip_grad_norm_(params, 1.0);
//   bool skipped = scaler.step(optimizer);   // also updates the scale
//
// Update rule (GradScaler's): a step with non-finite gradients is skipped, the scale multiplied
// by backoff_factor (never below min_scale; not while hysteresis tolerates the overflow) and the
// growth counter reset; otherwise the counter grows, and when it reaches
// growth_interval the scale is multiplied by growth_factor and the counter reset.

#include <retrace/defense_options.h>
#include <retrace/error.h>
#include <retrace/program.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace retrace {

// Not thread-safe. The scale lives in a float32 tensor on `device`, as GradScaler keeps it.
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {}, c10::Device device = c10::kCPU);

  // loss * scale (in the loss's dtype for the product, as GradScaler does).
  at::Tensor scale(const at::Tensor& loss) const;
  // Divides the optimizer's gradients by the scale in place and records whether any is NaN/Inf.
  // At most once per step; step() calls it if it was not called. Returns true when all finite.
  bool unscale(torch::optim::Optimizer& optimizer);
  // Runs optimizer.step() unless the gradients were non-finite, then updates the scale. Returns
  // true when the step was skipped; a skipped step changes no parameter and no optimizer state.
  bool step(torch::optim::Optimizer& optimizer);

  // Forgets an unscale() whose step is not taken (the caller skips it for its own reason): the
  // scale and growth counter stay as they were, and the next step unscales afresh.
  void discard_unscale() { unscaled_ = false; }

  double current_scale() const;
  std::int64_t growth_tracker() const;
  std::int64_t skipped_steps() const { return skipped_; }
  std::int64_t backoffs() const { return backoffs_; }
  std::int64_t growths() const { return growths_; }
  std::int64_t tolerated_overflows() const { return tolerated_; }  // skips hysteresis absorbed
  std::int64_t hysteresis_left() const { return hysteresis_left_; }

  // Scale and growth tracker, for the recorder (Program::state()) and exact restore.
  std::vector<NamedTensor> state() const;
  void load_state(const std::vector<NamedTensor>& state);

 private:
  LossScalerOptions options_;
  at::Tensor scale_;           // float32 [1]
  at::Tensor growth_tracker_;  // int32 [1]
  at::Tensor found_inf_;       // float32 [1], valid after unscale()
  bool unscaled_ = false;
  std::int64_t skipped_ = 0, backoffs_ = 0, growths_ = 0, tolerated_ = 0;
  std::int64_t hysteresis_left_ = 1;
};

}  // namespace retrace
