#pragma once
// Timing two variants against each other on a noisy machine: one of each per call, their order
// flipped from one call to the next, so that drift and noise land on both alike.

#include <chrono>
#include <functional>
#include <utility>

namespace retrace::bench {

inline double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `a` and `b` once each (a first when a_first, then flips a_first); returns their times,
// each measured by `time` (default: wall clock around the call).
inline std::pair<double, double> alternate(bool& a_first, const std::function<void()>& a,
                                           const std::function<void()>& b,
                                           const std::function<double(const std::function<void()>&)>& time = seconds) {
  double ta, tb;
  if (a_first) {
    ta = time(a);
    tb = time(b);
  } else {
    tb = time(b);
    ta = time(a);
  }
  a_first = !a_first;
  return {ta, tb};
}

}  // namespace retrace::bench
