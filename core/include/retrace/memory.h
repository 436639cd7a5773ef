#pragma once
// Counting of host memory allocated through LibTorch's CPU allocator, to *measure* what
// checkpointing saves rather than guess it.

#include <cstdint>

namespace retrace {

// While alive, every CPU tensor allocation goes through a counting wrapper around the allocator
// that was installed before. live_bytes() is what is allocated now and not yet freed (counting
// from construction), peak_bytes() its maximum. One instance at a time (throws retrace::Error
// otherwise). Cost: a mutex and a hash-table entry per allocation and free. Allocations made
// under an earlier counter and freed under this one are subtracted too, so live_bytes() can go
// below zero then: create the counter before what it should measure.
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
