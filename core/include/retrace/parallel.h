#pragma once
// Work over tensors of unequal size on LibTorch's intra-op threads. at::parallel_for cuts a range
// into one piece per thread by count: over GPT-2 small's 613 state tensors (parameters first, then
// AdamW's moments) that left one of two threads 54% of the bytes to decode, hash or copy. And a
// cut by bytes is not enough either: on a VM's shared cores one thread moved the same bytes up to
// 1.4x slower than the other in the same replay (bench/README.md). So the threads take chunks of
// consecutive items, as each finishes its last, until none is left.
// (at::parallel_for is a header template: this runs in parallel only in code compiled with OpenMP,
// as retrace's own sources are; tests/core/parallel_test.cpp.)

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace retrace {

// Enough bytes a chunk for the hand-over between threads to cost nothing beside the work, and few
// enough that a model's state splits into many: the tiny GPT's 417 state tensors (4.9 MB) make 5.
inline constexpr std::uint64_t kParallelChunkBytes = std::uint64_t{1} << 20;

// [0, n) cut into chunks of consecutive items: each chunk ends at the first item that brings it
// to `min_bytes` (the last chunk may hold less). Chunk k is [b[k], b[k + 1]) of the result b.
template <class Size>
std::vector<std::size_t> chunk_by_size(std::size_t n, std::uint64_t min_bytes, const Size& size) {
  std::vector<std::size_t> bounds{0};
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bytes += static_cast<std::uint64_t>(size(i));
    if (bytes >= min_bytes || i + 1 == n) {
      bounds.push_back(i + 1);
      bytes = 0;
    }
  }
  return bounds;
}

// Runs work(i) for every i in [0, n): on the intra-op threads when there are several, more than
// one chunk (chunk_by_size) and this is not already a parallel region, each thread taking the next
// chunk as it finishes one; items in index order within a chunk. What work throws, at::parallel_for
// rethrows (work that must report the first failing index whatever the thread count keeps its
// errors by index itself).
template <class Size, class Work>
void parallel_for_by_size(std::size_t n, const Size& size, const Work& work,
                          std::uint64_t chunk_bytes = kParallelChunkBytes) {
  const int threads = at::get_num_threads();
  if (threads > 1 && n > 1 && !at::in_parallel_region()) {
    const std::vector<std::size_t> bounds = chunk_by_size(n, chunk_bytes, size);
    const std::size_t chunks = bounds.size() - 1;
    if (chunks > 1) {
      std::atomic<std::size_t> next{0};
      const auto team = static_cast<std::int64_t>(std::min<std::size_t>(static_cast<std::size_t>(threads), chunks));
      at::parallel_for(0, team, 1, [&](std::int64_t, std::int64_t) {
        for (std::size_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
          for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i) work(i);
        }
      });
      return;
    }
  }
  for (std::size_t i = 0; i < n; ++i) work(i);  // one thread, one chunk, or inside a parallel region
}

}  // namespace retrace
