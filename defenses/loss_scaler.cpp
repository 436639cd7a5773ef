#include <retrace/loss_scaler.h>

#include <retrace/error.h>

#include <ATen/ATen.h>  // operator*, scalar_tensor (the fuzz build has no LibTorch PCH)
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>

namespace retrace {

LossScaler::LossScaler(LossScalerOptions options, c10::Device device) : options_(options) {
  if (!(options.init_scale > 0) || !std::isfinite(options.init_scale) || !(options.growth_factor > 1) ||
      !(options.backoff_factor > 0 && options.backoff_factor < 1) || options.growth_interval < 1 ||
      options.hysteresis < 1 || !(options.min_scale >= 0) || options.min_scale > options.init_scale) {
    throw Error("retrace::LossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                "growth_interval >= 1, hysteresis >= 1 and 0 <= min_scale <= init_scale");
  }
  hysteresis_left_ = options.hysteresis;
  scale_ = at::full({1}, options.init_scale, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  found_inf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const { return loss * scale_.to(loss.device()); }

bool LossScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (unscaled_) throw Error("retrace::LossScaler: unscale() was already called since the last step()");
  found_inf_.zero_();
  // GradScaler computes the reciprocal in double, then rounds to float.
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  // Group by device and dtype: the fused kernel takes one of each per call.
  struct Group {
    c10::Device device;
    at::ScalarType dtype;
    std::vector<at::Tensor> grads;
  };
  std::vector<Group> groups;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& g = p.grad();
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const Group& x) { return x.device == g.device() && x.dtype == g.scalar_type(); });
      if (it == groups.end()) {
        groups.push_back({g.device(), g.scalar_type(), {}});
        it = groups.end() - 1;
      }
      it->grads.push_back(g);
    }
  }
  for (Group& group : groups) {
    at::Tensor found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(group.device));
    at::_amp_foreach_non_finite_check_and_unscale_(group.grads, found, inv_scale.to(group.device));
    found_inf_ = found_inf_.maximum(found.to(found_inf_.device()));
  }
  unscaled_ = true;
  return found_inf_.item<float>() == 0.0f;
}

bool LossScaler::step(torch::optim::Optimizer& optimizer) {
  if (!unscaled_) unscale(optimizer);
  const bool skip = found_inf_.item<float>() != 0.0f;
  if (!skip) optimizer.step();
  const double before = current_scale();
  // Hysteresis (DeepSpeed's delayed shift): while overflows are left to tolerate, an overflow skips
  // the step and resets the growth counter but keeps the scale.
  const bool tolerate = skip && hysteresis_left_ > 1;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor,
                         tolerate ? 1.0 : options_.backoff_factor, options_.growth_interval);
  if (skip && options_.min_scale > 0) scale_.clamp_min_(options_.min_scale);
  const double after = current_scale();
  if (skip) {
    ++skipped_;
    if (tolerate) {
      --hysteresis_left_;
      ++tolerated_;
    } else if (after < before) {
      ++backoffs_;
    }
  } else if (after > before) {
    ++growths_;
    hysteresis_left_ = options_.hysteresis;  // DeepSpeed restores its hysteresis on growth
  }
  unscaled_ = false;
  return skip;
}

double LossScaler::current_scale() const { return scale_.item<double>(); }
std::int64_t LossScaler::growth_tracker() const { return growth_tracker_.item<std::int64_t>(); }

std::vector<NamedTensor> LossScaler::state() const {
  return {{"scaler.scale", scale_, TensorKind::kDefenseState},
          {"scaler.growth_tracker", growth_tracker_, TensorKind::kDefenseState},
          {"scaler.hysteresis_left", at::scalar_tensor(hysteresis_left_, at::kLong), TensorKind::kDefenseState}};
}

void LossScaler::load_state(const std::vector<NamedTensor>& state) {
  for (const NamedTensor& s : state) {
    if (s.name == "scaler.scale") scale_.copy_(s.tensor);
    if (s.name == "scaler.growth_tracker") growth_tracker_.copy_(s.tensor);
    if (s.name == "scaler.hysteresis_left") hysteresis_left_ = s.tensor.item<std::int64_t>();
  }
  unscaled_ = false;
}

}  // namespace retrace
