#pragma once
// Faulting in, with one call, the pages a decode is about to write.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

namespace retrace::detail {

#ifdef MADV_POPULATE_WRITE
inline constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
inline constexpr int kMadvPopulateWrite = 23;  // Linux 5.14; glibc's headers before 2.35 lack it
#endif

// Makes the whole pages inside [data, data + bytes) present and writable with one madvise
// (MADV_POPULATE_WRITE) instead of one page fault per page as a decode writes them: the replay's
// decode of GPT-2 small's state (1.2 GB, mostly memory no one had touched) took ~7% less time.
// Pages already present are walked, not changed. Returns whether the kernel did it; false, with
// nothing changed, before Linux 5.14 or for memory it cannot populate.
inline bool prefault_for_write(void* data, std::size_t bytes) noexcept {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(page - 1);
  if (data == nullptr || end <= begin) return false;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, kMadvPopulateWrite) == 0;
}

}  // namespace retrace::detail
