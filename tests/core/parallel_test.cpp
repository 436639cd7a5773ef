// LibTorch's at::parallel_for is a header template: it runs in parallel only in code compiled with
// OpenMP (_OPENMP defined; RETRACE_OPENMP, on with GCC). Without it every at::parallel_for of ours
// -- the replay's anchor decode, the trace's open, the recorder's digests and copies -- ran on the
// calling thread alone, silently (bench/README.md, "OpenMP").
#include <retrace/parallel.h>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace retrace {
namespace {

// The thread ids a parallel_for over `n` items with grain 1 ran its chunks on.
std::set<std::thread::id> threads_of_parallel_for(std::int64_t n) {
  std::mutex m;
  std::set<std::thread::id> ids;
  at::parallel_for(0, n, 1, [&](std::int64_t, std::int64_t) {
    std::lock_guard<std::mutex> lock(m);
    ids.insert(std::this_thread::get_id());
  });
  return ids;
}

TEST(Parallel, AtParallelForInOurCodeRunsOnTheIntraOpThreads) {
#if defined(__GNUC__) && !defined(__clang__) && !defined(_OPENMP)
  FAIL() << "built by GCC without OpenMP: at::parallel_for runs serially in every retrace source; configure "
            "with -DRETRACE_OPENMP=ON";
#elif !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP (RETRACE_OPENMP=OFF, as with clang): at::parallel_for runs serially";
#else
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(threads_of_parallel_for(2).size(), 2u);
  // Control: with one intra-op thread the same loop runs on the caller alone.
  at::set_num_threads(1);
  const std::set<std::thread::id> one = threads_of_parallel_for(2);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(*one.begin(), std::this_thread::get_id());
  at::set_num_threads(before);
#endif
}

TEST(Parallel, ChunkBySizeEndsAChunkAtTheItemThatFillsIt) {
  const std::vector<std::uint64_t> v = {1000, 50, 50, 50, 50, 30};
  const auto size = [&](std::size_t i) { return v[i]; };
  EXPECT_EQ(chunk_by_size(v.size(), 100, size), (std::vector<std::size_t>{0, 1, 3, 5, 6}));
  EXPECT_EQ(chunk_by_size(v.size(), 1, size), (std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(chunk_by_size(v.size(), 1 << 20, size), (std::vector<std::size_t>{0, 6}));
  EXPECT_EQ(chunk_by_size(0, 100, size), (std::vector<std::size_t>{0}));
  // Items of no bytes (a device tensor among host ones) join the chunk after them.
  const std::vector<std::uint64_t> z = {0, 0, 100, 0};
  EXPECT_EQ(chunk_by_size(z.size(), 100, [&](std::size_t i) { return z[i]; }), (std::vector<std::size_t>{0, 3, 4}));
}

// One large item, then many small ones, as a model's state begins with its embedding. The large
// item does not finish until every small one has run: only threads that take the next chunk as
// they finish one get there. A cut by count (at::parallel_for's) leaves the large item's thread
// half the small ones, which wait behind it: the wait then times out.
TEST(Parallel, ParallelForBySizeRunsEveryItemOnceAndTheOtherThreadTakesWhatIsLeft) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP: at::parallel_for runs serially";
#else
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  constexpr std::size_t kSmall = 20;
  std::vector<int> runs(kSmall + 1, 0);
  std::mutex m;
  std::condition_variable cv;
  std::size_t small_done = 0;
  bool timed_out = false;
  parallel_for_by_size(
      kSmall + 1, [](std::size_t i) { return i == 0 ? 1000 : 50; },
      [&](std::size_t i) {
        std::unique_lock<std::mutex> lock(m);
        ++runs[i];
        if (i == 0) {
          timed_out = !cv.wait_for(lock, std::chrono::seconds(10), [&] { return small_done == kSmall; });
        } else if (++small_done == kSmall) {
          cv.notify_all();
        }
      },
      /*chunk_bytes=*/1);
  at::set_num_threads(before);
  EXPECT_EQ(runs, std::vector<int>(kSmall + 1, 1));
  EXPECT_FALSE(timed_out) << "small items waited behind the large one on its thread";
  // Nothing to do, nothing run.
  parallel_for_by_size(
      0, [](std::size_t) { return 1; }, [](std::size_t) { ADD_FAILURE() << "ran an item of none"; });
#endif
}

TEST(Parallel, ParallelForBySizeInsideAParallelRegionStaysOnItsThread) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP: at::parallel_for runs serially";
#else
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  std::vector<std::set<std::thread::id> > inner(2);
  std::vector<char> in_region(2, 0);  // not vector<bool>: two threads write it
  at::parallel_for(0, 2, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t t = begin; t < end; ++t) {
      in_region[t] = at::in_parallel_region();
      parallel_for_by_size(
          8, [](std::size_t) { return 1; }, [&](std::size_t) { inner[t].insert(std::this_thread::get_id()); },
          /*chunk_bytes=*/1);
    }
  });
  at::set_num_threads(before);
  for (int t = 0; t < 2; ++t) {
    EXPECT_TRUE(in_region[t]);
    EXPECT_EQ(inner[t].size(), 1u) << "a call inside a parallel region left its thread";
  }
#endif
}

}  // namespace
}  // namespace retrace
