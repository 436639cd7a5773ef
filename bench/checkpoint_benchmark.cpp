// Checkpointed vs plain training step, recompute verification overhead, and the cost of running
// the forward in the recompute's grad mode. Every figure is a ratio of two variants measured
// interleaved in the same benchmark, so machine noise hits both sides alike.
#include "alternate.h"
#include "bench_models.h"

#include <retrace/checkpoint.h>
#include <retrace/memory.h>
#include <retrace/models.h>
#include <retrace/verify.h>

#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>

namespace retrace {
namespace {

models::GptConfig bench_config() { return bench::gpt8_config(); }

struct Fixture {
  explicit Fixture(const models::GptConfig& config = bench_config()) {
    torch::manual_seed(0);
    model = std::make_shared<models::TinyGpt>(config);
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

// No recompute, full recompute (every block a checkpointed segment), the attention cores alone
// recomputed (RecomputePolicy::attention_core) and selective recompute (attention cores, norms,
// gelus and dropout masks recomputed, every matmul output kept: RecomputePolicy::selective), one
// step of each per iteration in rotating order. Arg 0: the 8-block tiny GPT of the other
// benchmarks; arg 1: GPT-2 small's body at 256 tokens (bench/README.md); arg 2: the same at 1024.
models::GptConfig recompute_config(std::int64_t which) {
  if (which == 0) return bench_config();
  models::GptConfig c;
  c.layers = 12;
  c.d_model = 768;
  c.heads = 12;
  c.vocab = 8192;
  c.seq_len = which == 1 ? 256 : 1024;
  c.batch = 1;
  c.dropout = 0.1;
  return c;
}

void BM_RecomputePolicies(benchmark::State& state) {
  const models::GptConfig config = recompute_config(state.range(0));
  Fixture f(config);
  const models::CheckpointPlan none{0, {}};
  const models::CheckpointPlan full{static_cast<int>(config.layers), {}};
  const models::CheckpointPlan selective{0, {}, true};
  // A step under `policy` (set around the step): the regions it names recomputed, the rest plain.
  const auto under = [&](const RecomputePolicy& policy) {
    return [&f, &none, policy] {
      RecomputePolicyScope scope(policy);
      f.step(none);
    };
  };
  // Megatron's selective recompute (the attention cores only), selective, and -- on the tiny model,
  // where a step takes milliseconds -- each other kind alone, to show where selective's time goes.
  std::vector<std::function<void()>> variants = {[&] { f.step(none); }, [&] { f.step(full); },
                                                 under(RecomputePolicy::attention_core()), [&] { f.step(selective); }};
  const std::vector<std::pair<const char*, RegionKind>> kinds = {
      {"norm", RegionKind::kNorm}, {"activation", RegionKind::kActivation}, {"dropout", RegionKind::kDropout}};
  const bool per_kind = state.range(0) == 0;
  // Selective without the attention core: the three cheap kinds together (tiny model only).
  const RecomputePolicy no_core{{RegionKind::kNorm, RegionKind::kActivation, RegionKind::kDropout}, {}};
  // The floor under any recompute of the attention cores: a plain step, then the cores' forward
  // once more with no graph and nothing kept -- TinyGpt's ops (harness/models.cpp, Block::attention)
  // on tensors of the cores' shapes and strides (q, k, v views into one qkv output), the dropout
  // mask already at hand (one multiply). What recompute_region adds above this is its own cost.
  at::Tensor floor_q, floor_k, floor_v, floor_causal, floor_keep;
  if (per_kind) {
    const std::int64_t B = config.batch, T = config.seq_len, C = config.d_model, H = config.heads;
    const auto qkv = at::randn({B, T, 3 * C}).chunk(3, -1);
    const auto split = [&](const at::Tensor& t) { return t.view({B, T, H, C / H}).transpose(1, 2); };
    floor_q = split(qkv[0]);
    floor_k = split(qkv[1]);
    floor_v = split(qkv[2]);
    floor_causal = at::ones({T, T}, at::kBool).triu(1);
    floor_keep = at::bernoulli(at::full({B, H, T, T}, 1.0 - config.dropout)).div_(1.0 - config.dropout);
  }
  const auto cores_again = [&, layers = config.layers, hd = config.d_model / config.heads] {
    f.step(none);
    at::NoGradGuard no_grad;
    for (std::int64_t l = 0; l < layers; ++l) {
      at::Tensor att = at::matmul(floor_q, floor_k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
      att = at::softmax(att.masked_fill(floor_causal, -std::numeric_limits<double>::infinity()), -1) * floor_keep;
      benchmark::DoNotOptimize(at::matmul(att, floor_v));
    }
  };
  if (per_kind) {
    for (const auto& [name, kind] : kinds) variants.push_back(under(RecomputePolicy{{kind}, {}}));
    variants.push_back(under(no_core));
    variants.push_back(cores_again);
  }
  const int warmup = config.d_model > 64 ? 1 : 3;
  for (int i = 0; i < warmup; ++i) {
    for (const auto& v : variants) v();
  }
  std::vector<double> t(variants.size(), 0.0);
  std::size_t first = 0;
  for (auto _ : state) {
    double selective_time = 0;
    for (std::size_t k = 0; k < variants.size(); ++k) {
      const std::size_t v = (first + k) % variants.size();
      const double dt = bench::seconds(variants[v]);
      t[v] += dt;
      if (v == 3) selective_time = dt;
    }
    first = (first + 1) % variants.size();
    state.SetIterationTime(selective_time);
  }
  const double bytes_none = static_cast<double>(f.saved_bytes(none));
  std::int64_t bytes_core = 0;
  {
    RecomputePolicyScope scope(RecomputePolicy::attention_core());
    bytes_core = f.saved_bytes(none);
  }
  state.counters["plain_ms"] = 1e3 * t[0] / static_cast<double>(state.iterations());
  state.counters["full_over_plain"] = t[1] / t[0];
  state.counters["core_over_plain"] = t[2] / t[0];
  state.counters["selective_over_plain"] = t[3] / t[0];
  if (per_kind) {
    for (std::size_t k = 0; k < kinds.size(); ++k) {
      state.counters[std::string(kinds[k].first) + "_alone_over_plain"] = t[4 + k] / t[0];
    }
    state.counters["no_core_over_plain"] = t[4 + kinds.size()] / t[0];
    state.counters["cores_again_over_plain"] = t[5 + kinds.size()] / t[0];
    RecomputePolicyScope scope(no_core);
    state.counters["saved_no_core_over_plain"] = static_cast<double>(f.saved_bytes(none)) / bytes_none;
  }
  state.counters["saved_MiB_plain"] = bytes_none / (1 << 20);
  state.counters["saved_full_over_plain"] = static_cast<double>(f.saved_bytes(full)) / bytes_none;
  state.counters["saved_core_over_plain"] = static_cast<double>(bytes_core) / bytes_none;
  state.counters["saved_selective_over_plain"] = static_cast<double>(f.saved_bytes(selective)) / bytes_none;
}
BENCHMARK(BM_RecomputePolicies)->ArgName("model")->Arg(0)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_RecomputePolicies)
    ->ArgName("model")
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

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
