// Checkpointed vs plain training step, recompute verification overhead, and the cost of running
// the forward in the recompute's grad mode. Every figure is a ratio of two variants measured
// interleaved in the same benchmark, so machine noise hits both sides alike.
#include "alternate.h"
#include "bench_models.h"

#include <retrace/memory.h>
#include <retrace/models.h>
#include <retrace/verify.h>

#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>

namespace retrace {
namespace {

models::GptConfig bench_config() { return bench::gpt8_config(); }

struct Fixture {
  Fixture() {
    torch::manual_seed(0);
    model = std::make_shared<models::TinyGpt>(bench_config());
    model->train();
    optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-4));
    batch = model->make_batch(1);
  }
  // One training step: zero grads, forward, backward, Adam step.
  void step(const models::CheckpointPlan& plan) {
    optimizer->zero_grad();
    model->loss(batch, plan).backward();
    optimizer->step();
  }
  std::int64_t saved_bytes(const models::CheckpointPlan& plan) {
    optimizer->zero_grad();
    CpuMemoryCounter counter;
    at::Tensor loss = model->loss(batch, plan);
    const std::int64_t held = counter.live_bytes();
    loss.backward();
    return held;
  }
  std::shared_ptr<models::TinyGpt> model;
  std::unique_ptr<torch::optim::Adam> optimizer;
  models::Batch batch;
};

// Times a and b alternately (order flipped every iteration); reports b as the iteration time and
// the ratio b / a as a counter.
void interleave(benchmark::State& state, const std::function<void()>& a, const std::function<void()>& b,
                const char* a_name, const char* b_name) {
  for (int i = 0; i < 3; ++i) {  // warm-up
    a();
    b();
  }
  double ta = 0, tb = 0;
  bool a_first = true;
  for (auto _ : state) {
    const auto [da, db] = bench::alternate(a_first, a, b);
    ta += da;
    tb += db;
    state.SetIterationTime(db);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters[std::string(a_name) + "_ms"] = 1e3 * ta / n;
  state.counters[std::string(b_name) + "_ms"] = 1e3 * tb / n;
  state.counters["time_ratio"] = tb / ta;
}

void BM_CheckpointedVsPlainStep(benchmark::State& state) {
  Fixture f;
  const models::CheckpointPlan plain{0, {}};
  const models::CheckpointPlan ckpt{static_cast<int>(state.range(0)), {}};
  interleave(
      state, [&] { f.step(plain); }, [&] { f.step(ckpt); }, "plain", "checkpointed");
  const double plain_bytes = static_cast<double>(f.saved_bytes(plain));
  const double ckpt_bytes = static_cast<double>(f.saved_bytes(ckpt));
  state.counters["saved_MiB_plain"] = plain_bytes / (1 << 20);
  state.counters["saved_MiB_ckpt"] = ckpt_bytes / (1 << 20);
  state.counters["saved_ratio"] = ckpt_bytes / plain_bytes;
}
BENCHMARK(BM_CheckpointedVsPlainStep)
    ->ArgName("segments")
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// Live recompute verification in digest mode vs the same checkpointed step without it.
void BM_VerifyOverhead(benchmark::State& state) {
  Fixture f;
  const models::CheckpointPlan ckpt{static_cast<int>(state.range(0)), {}};
  RecomputeVerifier verifier({VerifyPolicy::kThrow, false});
  interleave(
      state, [&] { f.step(ckpt); },
      [&] {
        ObserverScope scope(verifier);
        f.step(ckpt);
      },
      "checkpointed", "verified");
  state.counters["mismatches"] = static_cast<double>(verifier.mismatches().size());
}
BENCHMARK(BM_VerifyOverhead)
    ->ArgName("segments")
    ->Arg(2)
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// ForwardMode::kLikeRecompute (the default) vs kNoGrad.
void BM_ForwardModeCost(benchmark::State& state) {
  Fixture f;
  models::CheckpointPlan nograd{static_cast<int>(state.range(0)), {}};
  nograd.options.forward_mode = ForwardMode::kNoGrad;
  const models::CheckpointPlan like{static_cast<int>(state.range(0)), {}};
  interleave(
      state, [&] { f.step(nograd); }, [&] { f.step(like); }, "nograd", "like_recompute");
}
BENCHMARK(BM_ForwardModeCost)
    ->ArgName("segments")
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

}  // namespace
}  // namespace retrace
