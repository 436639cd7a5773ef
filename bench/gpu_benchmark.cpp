// GPU benchmarks, as fractions of what the hardware does for the same bytes, measured in the same
// run: the device digest against a device-to-device copy, an asynchronous snapshot against a
// plain pinned cudaMemcpy. They skip where no CUDA device is visible (scripts/gpu-check runs them).
#include "alternate.h"

#include <retrace/digest.h>
#include <retrace/snapshot.h>

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
BENCHMARK(BM_CudaDigestVsCopy)->Arg(16 << 20)->Arg(256 << 20)->Arg(std::int64_t{1} << 30)->UseManualTime();

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
BENCHMARK(BM_CudaSnapshotVsPinnedCopy)->Arg(64 << 20)->Arg(256 << 20)->Arg(std::int64_t{1} << 30)->UseManualTime();

}  // namespace
}  // namespace retrace
