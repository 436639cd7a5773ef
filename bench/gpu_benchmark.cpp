// GPU benchmarks, as fractions of what the hardware does for the same bytes, measured in the same
// run: the device digest against a device-to-device copy, an asynchronous snapshot against a
// plain pinned cudaMemcpy, a checkpointed step with the recompute verifier against one without.
// They skip where no CUDA device is visible (scripts/gpu-check runs them). Iteration counts are
// fixed and sizes at most 256 MiB, so that the whole file runs in well under a minute on one GPU.
#include "alternate.h"

#include <retrace/digest.h>
#include <retrace/models.h>
#include <retrace/observer.h>
#include <retrace/snapshot.h>
#include <retrace/verify.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace retrace {
namespace {

// Wall time of f's work on the device: synchronized before and after.
double seconds_synced(const std::function<void()>& f) {
  torch::cuda::synchronize();
  return bench::seconds([&] {
    f();
    torch::cuda::synchronize();
  });
}

bool have_cuda(benchmark::State& state) {
  if (torch::cuda::is_available()) return true;
  state.SkipWithError("no CUDA device is visible");
  return false;
}

// Device digest throughput as a fraction of device-to-device copy throughput (bytes of tensor per
// second; a copy reads and writes them, the digest only reads). Goal: >= 0.4.
void BM_CudaDigestVsCopy(benchmark::State& state) {
  if (!have_cuda(state)) return;
  const std::int64_t bytes = state.range(0);
  const at::Tensor src = torch::randn({bytes / 4}, torch::kCUDA);
  at::Tensor dst = torch::empty_like(src);
  constexpr int kReps = 10;
  std::vector<PendingDigest> pending(kReps);
  double t_digest = 0, t_copy = 0;
  bool digest_first = true;
  for (int i = 0; i < 2; ++i) digest(src);  // warm-up
  for (auto _ : state) {
    const auto [d, c] = bench::alternate(
        digest_first,
        [&] {
          for (int r = 0; r < kReps; ++r) pending[r] = digest_async(src);
          for (int r = 0; r < kReps; ++r) benchmark::DoNotOptimize(pending[r].get());
        },
        [&] {
          for (int r = 0; r < kReps; ++r) dst.copy_(src);
        },
        seconds_synced);
    t_digest += d;
    t_copy += c;
    state.SetIterationTime(0.001);
  }
  const double total = static_cast<double>(state.iterations()) * kReps * static_cast<double>(bytes);
  state.counters["digest_GBps"] = total / t_digest / 1e9;
  state.counters["copy_GBps"] = total / t_copy / 1e9;
  state.counters["digest_over_copy"] = t_copy / t_digest;
}
BENCHMARK(BM_CudaDigestVsCopy)->Arg(16 << 20)->Arg(256 << 20)->Iterations(20)->UseManualTime();

// snapshot_to_host (device clone, then D2H on a side stream into pinned memory) as a fraction of
// a plain synchronous cudaMemcpy into a pinned buffer. Goal: >= 0.8.
void BM_CudaSnapshotVsPinnedCopy(benchmark::State& state) {
  if (!have_cuda(state)) return;
  const std::int64_t bytes = state.range(0);
  const at::Tensor src = torch::randn({bytes / 4}, torch::kCUDA);
  at::Tensor pinned = torch::empty({bytes / 4}, torch::TensorOptions().pinned_memory(true));
  double t_snap = 0, t_plain = 0;
  bool snapshot_first = true;
  for (int i = 0; i < 2; ++i) snapshot_to_host(src).wait();  // warm-up: the pinned pool fills
  for (auto _ : state) {
    const auto [snap, plain] = bench::alternate(
        snapshot_first,
        [&] {
          const HostSnapshot s = snapshot_to_host(src);
          s.wait();
        },
        [&] { pinned.copy_(src); }, seconds_synced);
    t_snap += snap;
    t_plain += plain;
    state.SetIterationTime(0.001);
  }
  const double total = static_cast<double>(state.iterations()) * static_cast<double>(bytes);
  state.counters["snapshot_GBps"] = total / t_snap / 1e9;
  state.counters["pinned_memcpy_GBps"] = total / t_plain / 1e9;
  state.counters["snapshot_over_memcpy"] = t_plain / t_snap;
}
BENCHMARK(BM_CudaSnapshotVsPinnedCopy)->Arg(64 << 20)->Arg(256 << 20)->Iterations(20)->UseManualTime();

// A checkpointed training step (forward, backward with recompute) of a small GPT with the
// recompute verifier attached, as a multiple of the same step without it. The verifier digests
// on the device and waits once per backward pass, not per segment. Goal: <= 1.05.
void BM_CudaVerifiedCheckpointStep(benchmark::State& state) {
  if (!have_cuda(state)) return;
  torch::manual_seed(0);
  models::GptConfig c;
  c.layers = 8;
  c.d_model = 256;
  c.heads = 8;
  c.seq_len = 128;
  c.batch = 16;
  c.dropout = 0.1;
  models::TinyGpt model(c);
  model.to(torch::kCUDA);
  model.train();
  models::Batch batch = model.make_batch(1);
  batch.input = batch.input.cuda();
  batch.target = batch.target.cuda();
  const models::CheckpointPlan plan{static_cast<int>(state.range(0)), {}};
  // kRecord costs what kThrow does on a clean step, and a mismatch shows up as a counter instead of
  // ending the run.
  RecomputeVerifier verifier({VerifyPolicy::kRecord, /*keep_values=*/false});
  const auto plain = [&] {
    model.zero_grad();
    model.loss(batch, plan).backward();
  };
  const auto verified = [&] {
    ObserverScope scope(verifier);
    plain();
  };
  for (int i = 0; i < 3; ++i) {  // warm-up
    plain();
    verified();
  }
  double t_plain = 0, t_verified = 0;
  bool plain_first = true;
  for (auto _ : state) {
    const auto [p, v] = bench::alternate(plain_first, plain, verified, seconds_synced);
    t_plain += p;
    t_verified += v;
    state.SetIterationTime(v);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["plain_ms"] = 1e3 * t_plain / n;
  state.counters["verified_ms"] = 1e3 * t_verified / n;
  state.counters["verified_over_plain"] = t_verified / t_plain;
  state.counters["verified_outputs"] = static_cast<double>(verifier.verified_outputs());
  state.counters["mismatches"] = static_cast<double>(verifier.mismatches().size());
}
BENCHMARK(BM_CudaVerifiedCheckpointStep)
    ->ArgName("segments")
    ->Arg(8)
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace retrace
