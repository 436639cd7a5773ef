#pragma once
// Counting of host memory allocated through LibTorch's CPU allocator, to *measure* what
// checkpointing saves rather than guess it.

#include <cstdint>

namespace retrace {

// While alive, every CPU tensor allocation goes through a counting wrapper around the allocator
// that was installed before. live_bytes() is what is allocated now and not yet freed (counting
// from construction), peak_bytes() its maximum. One instance at a time (throws retrace::Error
// otherwise). Cost: two relaxed atomic adds per allocation and free.
class CpuMemoryCounter {
 public:
  CpuMemoryCounter();
  ~CpuMemoryCounter();
  CpuMemoryCounter(const CpuMemoryCounter&) = delete;
  CpuMemoryCounter& operator=(const CpuMemoryCounter&) = delete;

  std::int64_t live_bytes() const;
  std::int64_t peak_bytes() const;
  // Sets the peak to the current live bytes.
  void reset_peak();
};

}  // namespace retrace
