// GPU benchmarks, as fractions of what the hardware does for the same bytes, measured in the same
// run: the device digest against a device-to-device copy, an asynchronous snapshot against a
// plain pinned cudaMemcpy. They skip where no CUDA device is visible (scripts/gpu-check runs them).
#include <retrace/digest.h>
#include <retrace/snapshot.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <vector>

namespace retrace {
namespace {

double seconds_synced(const std::function<void()>& f) {
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  bool flip = false;
  for (int i = 0; i < 2; ++i) digest(src);  // warm-up
  for (auto _ : state) {
    const auto run_digest = [&] {
      t_digest += seconds_synced([&] {
        for (int r = 0; r < kReps; ++r) pending[r] = digest_async(src);
        for (int r = 0; r < kReps; ++r) benchmark::DoNotOptimize(pending[r].get());
      });
    };
    const auto run_copy = [&] {
      t_copy += seconds_synced([&] {
        for (int r = 0; r < kReps; ++r) dst.copy_(src);
      });
    };
    if (flip) {
      run_copy();
      run_digest();
    } else {
      run_digest();
      run_copy();
    }
    flip = !flip;
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
  bool flip = false;
  for (int i = 0; i < 2; ++i) snapshot_to_host(src).wait();  // warm-up: the pinned pool fills
  for (auto _ : state) {
    const auto run_snap = [&] {
      t_snap += seconds_synced([&] {
        const HostSnapshot s = snapshot_to_host(src);
        s.wait();
      });
    };
    const auto run_plain = [&] { t_plain += seconds_synced([&] { pinned.copy_(src); }); };
    if (flip) {
      run_plain();
      run_snap();
    } else {
      run_snap();
      run_plain();
    }
    flip = !flip;
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
