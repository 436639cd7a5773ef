// LibTorch's at::parallel_for is a header template: it runs in parallel only in code compiled with
// OpenMP (_OPENMP defined; RETRACE_OPENMP, on with GCC). Without it every at::parallel_for of ours
// -- the replay's anchor decode, the trace's open, the recorder's digests and copies -- ran on the
// calling thread alone, silently (bench/README.md, "OpenMP").
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <mutex>
#include <set>
#include <thread>

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

}  // namespace
}  // namespace retrace
