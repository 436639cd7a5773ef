#pragma once
// Work on items of unequal size spread over several threads, as the trace writer encodes a
// record's tensors and the reader checks a trace's records: largest first, each thread taking the
// next item, and the error of the first failing item in index order thrown, as one thread going
// through them in order throws it -- whatever the thread count or which thread met it first.
// Internal to retrace::core.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <numeric>
#include <vector>

namespace retrace::detail {

// Runs work(i) for every i in [0, n), in decreasing size(i) (ties in index order). `spread(loop)`
// runs `loop` on each of the threads it has and returns when every one has returned (one thread
// calling it once is enough). After all ran, rethrows what work(i) threw for the lowest such i,
// having set *failed to that i when `failed` is given.
template <class Size, class Work, class Spread>
void largest_first(std::size_t n, const Size& size, const Work& work, const Spread& spread,
                   std::size_t* failed = nullptr) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return size(a) > size(b); });
  std::vector<std::exception_ptr> errors(n);
  std::atomic<std::size_t> next{0};
  spread([&] {
    for (std::size_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      try {
        work(order[k]);
      } catch (...) {
        errors[order[k]] = std::current_exception();
      }
    }
  });
  for (std::size_t i = 0; i < n; ++i) {
    if (!errors[i]) continue;
    if (failed) *failed = i;
    std::rethrow_exception(errors[i]);
  }
}

}  // namespace retrace::detail
