// Host digest (XXH3-128 over the tensor) against memcpy of the same bytes, interleaved.
#include <retrace/digest.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>

namespace retrace {
namespace {

void BM_DigestVsMemcpy(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  torch::manual_seed(0);
  const at::Tensor t = torch::randn({bytes / 4});
  at::Tensor dst = torch::empty_like(t);
  double t_digest = 0, t_copy = 0;
  std::uint64_t sink = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    sink ^= digest(t).lo;
    auto t1 = std::chrono::steady_clock::now();
    std::memcpy(dst.data_ptr(), t.data_ptr(), t.nbytes());
    benchmark::ClobberMemory();
    auto t2 = std::chrono::steady_clock::now();
    const double d = std::chrono::duration<double>(t1 - t0).count();
    t_digest += d;
    t_copy += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(d);
  }
  benchmark::DoNotOptimize(sink);
  const double n = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(n) * bytes);
  state.counters["digest_GBps"] = n * bytes / t_digest / 1e9;
  state.counters["memcpy_GBps"] = n * bytes / t_copy / 1e9;
  state.counters["digest_over_memcpy_time"] = t_digest / t_copy;
}
BENCHMARK(BM_DigestVsMemcpy)
    ->ArgName("bytes")
    ->Arg(64 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Arg(256 << 20)
    ->UseManualTime()
    ->MinTime(1.0);

}  // namespace
}  // namespace retrace
