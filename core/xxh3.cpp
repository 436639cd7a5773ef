#include "xxh3.h"

// RETRACE_XXH3_DISPATCH: core/CMakeLists.txt found the dispatcher in the library.
#if defined(RETRACE_XXH3_DISPATCH) && defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#include <immintrin.h>
#endif

namespace retrace::detail {

#if defined(RETRACE_XXH3_DISPATCH) && defined(__x86_64__)
namespace {

// XXH3 hashes inputs of up to 240 bytes with scalar code, the same in every build: those skip
// the dispatcher (and the vzeroupper).
constexpr std::size_t kScalarBytes = 240;

__attribute__((target("avx"))) void clear_upper_avx() { _mm256_zeroupper(); }

// Whether the CPU has AVX (its upper halves need clearing), found once. libxxhash 0.8.1 fills its
// dispatch table on the first dispatched call without synchronization: the first call is made
// here, under the magic static's lock, before any thread can call the dispatcher concurrently.
bool ready() {
  static const bool has_avx = [] {
    __builtin_cpu_init();  // (may run before the CPU model's own initializer, from another one)
    const bool avx = __builtin_cpu_supports("avx") != 0;
    const unsigned char warm[kScalarBytes + 16] = {};
    (void)XXH3_64bits_dispatch(warm, sizeof warm);
    if (avx) clear_upper_avx();
    return avx;
  }();
  return has_avx;
}

// After the dispatcher's AVX2 or AVX-512 code: legacy SSE runs at full speed again.
inline void clear_upper(bool avx) {
  if (avx) clear_upper_avx();
}

// XXH3 of `size` bytes: `scalar()` (the library's own build) for short inputs, else
// `dispatched()`, the upper halves cleared after it.
template <class Scalar, class Dispatched>
auto hash(std::size_t size, Scalar scalar, Dispatched dispatched) {
  if (size <= kScalarBytes) return scalar();
  const bool avx = ready();
  const auto h = dispatched();
  clear_upper(avx);
  return h;
}

}  // namespace

std::uint64_t xxh3_64(const void* data, std::size_t size) {
  return hash(
      size, [&] { return XXH3_64bits(data, size); }, [&] { return XXH3_64bits_dispatch(data, size); });
}

std::uint64_t xxh3_64(const void* data, std::size_t size, std::uint64_t seed) {
  return hash(
      size, [&] { return XXH3_64bits_withSeed(data, size, seed); },
      [&] { return XXH3_64bits_withSeed_dispatch(data, size, seed); });
}

XXH128_hash_t xxh3_128(const void* data, std::size_t size) {
  return hash(
      size, [&] { return XXH3_128bits(data, size); }, [&] { return XXH3_128bits_dispatch(data, size); });
}

XXH128_hash_t xxh3_128(const void* data, std::size_t size, std::uint64_t seed) {
  return hash(
      size, [&] { return XXH3_128bits_withSeed(data, size, seed); },
      [&] { return XXH3_128bits_withSeed_dispatch(data, size, seed); });
}

void xxh3_64_update(XXH3_state_t* state, const void* data, std::size_t size) {
  const bool avx = ready();
  XXH3_64bits_update_dispatch(state, data, size);
  clear_upper(avx);
}

std::uint64_t xxh3_64_leaving_upper_dirty(const void* data, std::size_t size) {
  ready();
  return XXH3_64bits_dispatch(data, size);
}

bool xxh3_dispatched() { return true; }

#else  // no dispatcher (not x86-64): the library's own build

std::uint64_t xxh3_64(const void* data, std::size_t size) { return XXH3_64bits(data, size); }
std::uint64_t xxh3_64(const void* data, std::size_t size, std::uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}
XXH128_hash_t xxh3_128(const void* data, std::size_t size) { return XXH3_128bits(data, size); }
XXH128_hash_t xxh3_128(const void* data, std::size_t size, std::uint64_t seed) {
  return XXH3_128bits_withSeed(data, size, seed);
}
void xxh3_64_update(XXH3_state_t* state, const void* data, std::size_t size) { XXH3_64bits_update(state, data, size); }
std::uint64_t xxh3_64_leaving_upper_dirty(const void* data, std::size_t size) { return XXH3_64bits(data, size); }
bool xxh3_dispatched() { return false; }

#endif

}  // namespace retrace::detail
