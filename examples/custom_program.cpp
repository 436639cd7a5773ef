// A user's own training program with retrace's subcommands: implement retrace::Program and hand
// it to retrace::main. (This one runs its own loop without retrace's defense pipeline: record and
// replay work; scenarios need the pipeline, as in encoder/.) Then
//   retrace_example_custom record -o run.trace --steps 20 --ring 4
//   retrace_example_custom replay run.trace
// Data parallel, in its own loop: launched as ranks it joins a c10d group and averages its
// gradients over it (retrace/dist.h); each rank replays alone from its trace.
//   retrace_example_custom record -o run.trace --ranks 2 --mode full   # run.rank0.trace, run.rank1.trace
//   retrace_example_custom replay run.rank1.trace
#include <retrace/retrace.h>
#include <retrace/cli.h>
#include <retrace/program.h>
#include <torch/torch.h>

#include <map>

namespace {

// A two-block MLP regressor, each block checkpointed, trained with SGD + momentum.
class Regression : public retrace::Program {
 public:
  explicit Regression(const std::string& config) : config_(config.empty() ? "lr=0.05" : config) {
    // Launched as a rank (RANK, WORLD_SIZE, ...), or rebuilt by replay as one: join the group.
    const retrace::RendezvousOptions rendezvous = retrace::RendezvousOptions::from_env();
    if (rendezvous.world_size > 1 || retrace::replayed_rank()) group_ = retrace::RankGroup::join(rendezvous, config_);
    torch::manual_seed(0);
    for (int i = 0; i < 2; ++i) {
      blocks_.emplace_back(torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Dropout(0.1));
      for (const auto& p : blocks_.back()->named_parameters()) {
        params_.push_back({"block" + std::to_string(i) + "." + p.key(), p.value(), retrace::TensorKind::kParameter});
      }
    }
    std::vector<at::Tensor> ps;
    for (const auto& p : params_) ps.push_back(p.tensor);
    optimizer_ = std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.05).momentum(0.9));
  }

  std::string name() const override { return "example.regression"; }
  std::string config() const override { return config_; }
  std::int64_t default_steps() const override { return 10; }
  double lr() const override { return 0.05; }
  retrace::RankInfo ranks() const override { return group_ ? group_->ranks() : retrace::RankInfo{}; }

  std::vector<retrace::NamedTensor> state() override {
    std::vector<retrace::NamedTensor> out = params_;
    for (const auto& p : params_) {
      auto it = optimizer_->state().find(p.tensor.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      out.push_back({"momentum." + p.name, s.momentum_buffer(), retrace::TensorKind::kOptimizerState});
    }
    return out;
  }

  void load_state(const std::vector<retrace::NamedTensor>& state) override {
    std::map<std::string, at::Tensor> by_name;
    for (const auto& s : state) by_name[s.name] = s.tensor;
    torch::NoGradGuard no_grad;
    optimizer_->state().clear();
    for (auto& p : params_) {
      p.tensor.copy_(by_name.at(p.name));
      p.tensor.mutable_grad() = at::Tensor();
      if (auto it = by_name.find("momentum." + p.name); it != by_name.end()) {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(it->second.clone());
        optimizer_->state()[p.tensor.unsafeGetTensorImpl()] = std::move(s);
      }
    }
  }

  std::vector<retrace::NamedTensor> batch(std::int64_t step) override {
    const std::int64_t rank = group_ ? group_->ranks().rank : 0;  // each rank its own shard
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step + 7919 * rank);
    const at::Tensor x = at::randn({32, 16}, gen);
    return {{"x", x, retrace::TensorKind::kInput}, {"y", x.sin(), retrace::TensorKind::kTarget}};
  }

  retrace::StepOutcome step(std::int64_t, const std::vector<retrace::NamedTensor>& batch,
                            retrace::StepMonitor* monitor) override {
    optimizer_->zero_grad();
    at::Tensor h = batch[0].tensor;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      h = retrace::checkpoint(
          "block" + std::to_string(i), [b = blocks_[i]](const at::Tensor& in) mutable { return b->forward(in); }, h);
    }
    at::Tensor loss = torch::mse_loss(h, batch[1].tensor);
    loss.backward();
    if (group_) {  // the mean gradient over the ranks, in place
      std::vector<at::Tensor> gs;
      for (const auto& p : params_) gs.push_back(p.tensor.grad());
      group_->average(gs);
    }
    std::vector<retrace::NamedTensor> grads;
    double sq = 0;
    for (const auto& p : params_) {
      grads.push_back({"grad." + p.name, p.tensor.grad(), retrace::TensorKind::kGradient});
      sq += p.tensor.grad().pow(2).sum().item<double>();
    }
    if (monitor) monitor->after_backward(loss, grads);
    optimizer_->step();
    retrace::StepOutcome out;
    out.loss = loss.item<double>();
    out.grad_norm = std::sqrt(sq);
    out.lr = 0.05;
    return out;
  }

 private:
  std::string config_;
  std::unique_ptr<retrace::RankGroup> group_;  // data parallel, or null
  std::vector<torch::nn::Sequential> blocks_;
  std::vector<retrace::NamedTensor> params_;
  std::unique_ptr<torch::optim::SGD> optimizer_;
};

}  // namespace

int main(int argc, char** argv) {
  return retrace::main(argc, argv, "example.regression",
                       [](const std::string& config) { return std::make_unique<Regression>(config); });
}
