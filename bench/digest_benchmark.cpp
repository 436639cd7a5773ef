// Host digest (XXH3-128 over the tensor) against memcpy of the same bytes, interleaved.
#include <retrace/digest.h>

#include "core/xxh3.h"

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <vector>

#include <xxhash.h>

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

// Code built for the x86-64 baseline right after a host digest (core/xxh3.h): the dispatcher's
// AVX-512 code leaves the vector registers' upper halves dirty unless they are cleared, and
// legacy SSE after it slows down. The victim is libxxhash's own baseline (SSE2) XXH3 over 64 KiB,
// in cache. Each iteration times it after (a) a digest through our wrappers,
// (b) the dispatcher's call left dirty -- the control, which must show the slowdown -- and (c) no
// digest at all. The goal: sse_after_digest_over_clean ~1.00.
void BM_DigestLeavesSseFast(benchmark::State& state) {
  std::vector<char> data(64 << 10, 1);  // in L2
  std::vector<char> hashed(64 << 10, 3);
  double t_ours = 0, t_dirty = 0, t_clean = 0;
  std::uint64_t sink = 0;
  const auto time_sse = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 4; ++k) sink += XXH3_64bits(data.data(), data.size());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto _ : state) {
    benchmark::DoNotOptimize(detail::xxh3_64_leaving_upper_dirty(hashed.data(), hashed.size()));
    t_dirty += time_sse();
    benchmark::DoNotOptimize(detail::xxh3_64(hashed.data(), hashed.size()));  // clears them
    const double ours = time_sse();
    t_ours += ours;
    t_clean += time_sse();
    state.SetIterationTime(ours);
  }
  benchmark::DoNotOptimize(sink);
  state.counters["sse_after_digest_over_clean"] = t_ours / t_clean;
  state.counters["control_sse_after_dirty_over_clean"] = t_dirty / t_clean;
  state.counters["dispatched"] = detail::xxh3_dispatched() ? 1 : 0;  // 0: the library's baseline build
}
BENCHMARK(BM_DigestLeavesSseFast)->UseManualTime()->MinTime(1.0);

}  // namespace
}  // namespace retrace
