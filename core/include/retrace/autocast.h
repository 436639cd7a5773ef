#pragma once
// Autocast (automatic mixed precision) state: whether it is on, and in which dtype, for each
// device type. Checkpoint captures it at forward and re-applies it at recompute: a recompute that
// silently runs in another precision produces other bits, which is the bug class retrace exists
// to catch.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace retrace {

struct AutocastState {
  struct Entry {
    c10::DeviceType device_type = c10::DeviceType::CPU;
    bool enabled = false;
    c10::ScalarType dtype = c10::ScalarType::BFloat16;
    bool operator==(const Entry& o) const {
      return device_type == o.device_type && enabled == o.enabled && dtype == o.dtype;
    }
  };
  std::vector<Entry> entries;  // CPU and CUDA, in that order
  bool cache_enabled = true;

  // Reads the calling thread's autocast state. Cost: a few thread-local reads.
  static AutocastState capture();
  bool any_enabled() const;
  // e.g. "cpu:bfloat16 cuda:off"
  std::string to_string() const;
  bool operator==(const AutocastState& o) const { return entries == o.entries && cache_enabled == o.cache_enabled; }
  bool operator!=(const AutocastState& o) const { return !(*this == o); }
};

// RAII: applies a captured autocast state to the calling thread (like entering torch.autocast
// with those settings) and puts the previous state back on destruction, clearing the autocast
// weight cache when the outermost autocast region ends.
class AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
  bool nested_ = false;
};

}  // namespace retrace
