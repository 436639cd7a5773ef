#pragma once
// Test support: a user's own Program on the defense pipeline, none of the built-in models.

#include <retrace/checkpoint.h>
#include <retrace/defenses.h>
#include <retrace/error.h>
#include <retrace/program.h>

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace retrace::test {

// A user's program with its own names: weights "w1"/"w2", momentum buffers "momentum.w1" (not
// retrace's "optim." convention), features "x" and targets "y". SGD with momentum; a two-layer
// tanh regressor, the first layer checkpointed as "layer0". Config: "lr: X" (default 0.05) and
// "pipeline: false" (no defense pipeline), "vocab: true" (a vocabulary it does not use),
// "micro_batches: 2" (gradient accumulation over the batch's two halves, each loss / 2),
// "buffer: true" (a BatchNorm-like running mean of the hidden layer, kind buffer, updated in the
// forward: a skipped step's forward has updated it already), "lr_in_step: true" (sets its LR
// after begin(), a program's mistake: finish() refuses it).
class Regressor : public Program {
 public:
  explicit Regressor(const std::string& config) : config_(config) {
    if (config.find("lr: ") != std::string::npos) lr_ = std::stod(config.substr(config.find("lr: ") + 4));
    pipeline_ = config.find("pipeline: false") == std::string::npos;
    forget_defense_state_ = config.find("forget_defense_state: true") != std::string::npos;
    micro_batches_ = config.find("micro_batches: 2") != std::string::npos ? 2 : 1;
    buffer_ = config.find("buffer: true") != std::string::npos;
    // "buffer: segment": the running mean is updated inside the checkpointed segment, as a
    // BatchNorm in it does -- its recompute runs the update again.
    buffer_in_segment_ = config.find("buffer: segment") != std::string::npos;
    buffer_ = buffer_ || buffer_in_segment_;
    lr_in_step_ = config.find("lr_in_step: true") != std::string::npos;
    torch::manual_seed(7);
    w1_ = (torch::randn({8, 16}) * 0.3).requires_grad_();
    w2_ = (torch::randn({16, 1}) * 0.3).requires_grad_();
    optimizer_ = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{w1_, w2_},
                                                     torch::optim::SGDOptions(lr_).momentum(0.9));
    params_ = {{"w1", w1_, TensorKind::kParameter}, {"w2", w2_, TensorKind::kParameter}};
    TrainingTraits traits;
    // "vocab: true" declares a vocabulary though the inputs are float features (a program that
    // gets its traits wrong): a token injection is accepted, and fails when it first falls due.
    if (config.find("vocab: true") != std::string::npos) traits.vocab = 50;
    defenses_.attach(*this, *optimizer_, params_, traits);
  }
  std::string name() const override { return "test.regressor"; }
  std::string config() const override { return config_; }
  std::int64_t default_steps() const override { return 6; }
  std::vector<NamedTensor> state() override {
    std::vector<NamedTensor> out = params_;
    for (const NamedTensor& p : params_) {
      auto it = optimizer_->state().find(p.tensor.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      out.push_back({"momentum." + p.name, s.momentum_buffer(), TensorKind::kOptimizerState});
    }
    if (buffer_) out.push_back({"running_mean", running_mean_, TensorKind::kBuffer});
    if (!forget_defense_state_) {
      for (NamedTensor& n : defenses_.state()) out.push_back(std::move(n));
    }
    return out;
  }
  void load_state(const std::vector<NamedTensor>& state) override {
    copy_state_into(params_, state);
    optimizer_->state().clear();
    for (const NamedTensor& p : params_) {
      for (const NamedTensor& s : state) {
        if (s.name != "momentum." + p.name) continue;
        auto st = std::make_unique<torch::optim::SGDParamState>();
        st->momentum_buffer(s.tensor.clone());
        optimizer_->state()[p.tensor.unsafeGetTensorImpl()] = std::move(st);
      }
    }
    for (const NamedTensor& s : state) {
      if (buffer_ && s.name == "running_mean") running_mean_.copy_(s.tensor);
    }
    defenses_.load_state(state);
  }
  std::vector<NamedTensor> batch(std::int64_t step) override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    const at::Tensor x = at::randn({32, 8}, gen);
    return {{"x", x, TensorKind::kInput}, {"y", x.sum(1, true).sin(), TensorKind::kTarget}};
  }
  StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch_in, StepMonitor* monitor) override {
    DefendedStep s = defenses_.begin(step, monitor);
    const std::vector<NamedTensor> batch = s.batch(batch_in);
    if (s.done()) return s.finish();
    if (lr_in_step_) optimizer_->param_groups()[0].options().set_lr(lr_);
    optimizer_->zero_grad();
    const std::vector<at::Tensor> xs = batch[0].tensor.chunk(micro_batches_),
                                  ys = batch[1].tensor.chunk(micro_batches_);
    for (std::size_t m = 0; m < xs.size(); ++m) {
      at::Tensor loss;
      {
        const auto forward = s.forward();
        const at::Tensor h = checkpoint(
            "layer0",
            [this](const at::Tensor& x) {
              at::Tensor out = torch::tanh(x.matmul(w1_));
              if (buffer_in_segment_) update_running_mean(out);
              return out;
            },
            xs[m]);
        loss = torch::mse_loss(h.matmul(w2_), ys[m]);
        if (buffer_ && !buffer_in_segment_) update_running_mean(h);
      }
      s.backward(micro_batches_ > 1 ? loss / static_cast<double>(micro_batches_) : loss);
    }
    return s.finish();
  }
  Defenses* defenses() override { return pipeline_ ? &defenses_ : nullptr; }
  torch::optim::SGD& optimizer() { return *optimizer_; }

 private:
  std::string config_;
  double lr_ = 0.05;
  bool pipeline_ = true, forget_defense_state_ = false;
  std::int64_t micro_batches_ = 1;
  void update_running_mean(const at::Tensor& h) {
    const torch::NoGradGuard no_grad;
    running_mean_.mul_(0.9).add_(h.detach().mean(0), 0.1);
  }

  bool buffer_ = false, buffer_in_segment_ = false, lr_in_step_ = false;
  at::Tensor w1_, w2_, running_mean_ = torch::zeros({16});
  std::unique_ptr<torch::optim::SGD> optimizer_;
  std::vector<NamedTensor> params_;
  Defenses defenses_;
};

}  // namespace retrace::test
