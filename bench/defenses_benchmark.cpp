// The defense pipeline (retrace/defenses.h) against the same defenses written inline in the loop:
// what a user pays per step for Defenses + DefendedStep instead of their own code. Both loops
// train identical tiny GPTs (same seed, same batches) with dynamic loss scaling, global clipping
// at 1.0 and a 5-step warmup; the benchmark also reports whether the two ended bitwise equal.
#include "alternate.h"
#include "bench_models.h"

#include <retrace/defenses.h>
#include <retrace/models.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <functional>
#include <memory>

namespace retrace {
namespace {

constexpr double kLr = 1e-4;
constexpr std::int64_t kWarmup = 5;
constexpr int kSegments = 4;

// The model, optimizer and batches both loops share the recipe of.
struct Training {
  std::shared_ptr<models::TinyGpt> model;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  explicit Training() {
    torch::manual_seed(0);
    model = std::make_shared<models::TinyGpt>(bench::gpt8_config());
    model->train();
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(kLr));
  }
  at::Tensor loss(const models::Batch& b) {
    return model->loss(b, models::CheckpointPlan{kSegments, {}}).to(at::kFloat);
  }
};

// The defenses as a user writes them by hand: warmup on the LR, LossScaler, unscale, norm,
// clip_grad_norm_, scaler step.
class Inline {
 public:
  Inline() : scaler_(LossScalerOptions{}) {}
  void step(std::int64_t step, const models::Batch& b) {
    const double lr = applied_ < kWarmup ? kLr * static_cast<double>(applied_ + 1) / kWarmup : kLr;
    for (auto& g : t_.optimizer->param_groups()) g.options().set_lr(lr);
    t_.optimizer->zero_grad();
    const at::Tensor loss = t_.loss(b);
    scaler_.scale(loss).backward();
    scaler_.unscale(*t_.optimizer);
    torch::nn::utils::clip_grad_norm_(t_.model->parameters(), 1.0);
    if (!scaler_.step(*t_.optimizer)) ++applied_;
    for (auto& g : t_.optimizer->param_groups()) g.options().set_lr(kLr);
  }
  Training& training() { return t_; }

 private:
  Training t_;
  LossScaler scaler_;
  std::int64_t applied_ = 0;
};

// The same defenses through the pipeline.
class Piped : public Program {
 public:
  Piped() {
    DefenseOptions o;
    o.loss_scaling.enabled = true;
    o.clip.mode = ClipMode::kGlobal;
    o.clip.max_norm = 1.0;
    o.warmup_steps = kWarmup;
    defenses_.configure(o, {});
    params_ = named_parameters(*t_.model);
    defenses_.attach(*this, *t_.optimizer, params_);
  }
  std::string name() const override { return "bench.piped"; }
  std::string config() const override { return ""; }
  std::vector<NamedTensor> state() override {
    std::vector<NamedTensor> out = params_;
    for (NamedTensor& n : optimizer_state(*t_.optimizer, params_)) out.push_back(std::move(n));
    for (NamedTensor& n : defenses_.state()) out.push_back(std::move(n));
    return out;
  }
  void load_state(const std::vector<NamedTensor>& state) override {
    copy_state_into(params_, state);
    load_optimizer_state(*t_.optimizer, params_, state);
    defenses_.load_state(state);
  }
  std::vector<NamedTensor> batch(std::int64_t) override { return {}; }
  StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch, StepMonitor*) override {
    DefendedStep s = defenses_.begin(step);
    s.batch(batch);
    t_.optimizer->zero_grad();
    at::Tensor loss;
    {
      const auto forward = s.forward();
      loss = t_.loss(current_);
    }
    s.backward(loss);
    return s.finish();
  }
  void train(std::int64_t step, const models::Batch& b) {
    current_ = b;
    this->step(step, {}, nullptr);
  }
  Training& training() { return t_; }

 private:
  Training t_;
  std::vector<NamedTensor> params_;
  Defenses defenses_;
  models::Batch current_;
};

bool same_parameters(Training& a, Training& b) {
  const auto pa = a.model->parameters(), pb = b.model->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    if (!torch::equal(pa[i], pb[i])) return false;
  }
  return true;
}

// Steps of the two loops alternate (order flipped each iteration), from identical starts on the
// same batches; the ratio is the pipeline's time over the inline loop's.
void BM_DefensePipelineVsInline(benchmark::State& state) {
  at::set_num_threads(1);  // one intra-op thread: the comparison, not the machine's scheduling
  Inline hand;
  Piped piped;
  const models::TinyGpt& shape = *hand.training().model;
  std::int64_t step = 0;
  auto run_hand = [&] { hand.step(step, shape.make_batch(static_cast<std::uint64_t>(step))); };
  auto run_piped = [&] { piped.train(step, shape.make_batch(static_cast<std::uint64_t>(step))); };
  // The dropout masks come from the global generator: each loop draws its step's masks from the
  // same seed, so the two stay bitwise comparable.
  auto seeded = [&](const std::function<void()>& f) {
    return [&, f] {
      torch::manual_seed(1000 + step);
      f();
    };
  };
  const auto a = seeded(run_piped), b = seeded(run_hand);
  for (int i = 0; i < 2; ++i) {  // warm-up
    ++step;
    a();
    b();
  }
  double t_piped = 0, t_hand = 0;
  bool piped_first = true;
  for (auto _ : state) {
    ++step;
    const auto [p, h] = bench::alternate(piped_first, a, b);
    t_piped += p;
    t_hand += h;
    state.SetIterationTime(p);
  }
  state.counters["pipeline_over_inline"] = t_piped / t_hand;
  state.counters["inline_ms"] = 1e3 * t_hand / static_cast<double>(state.iterations());
  state.counters["bitwise_equal"] = same_parameters(hand.training(), piped.training()) ? 1 : 0;
}
BENCHMARK(BM_DefensePipelineVsInline)->UseManualTime()->Iterations(200)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace retrace
