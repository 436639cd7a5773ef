#pragma once
// XXH3 at the widest vector unit this CPU has. Debian's libxxhash is built for the x86-64
// baseline (SSE2, ~19 GB/s here); its x86 dispatcher (xxh_x86dispatch.h, in the same package)
// picks AVX2 or AVX-512 at run time (~44 GB/s). The values are XXH3's, whichever unit computes
// them: traces and digests do not change.
//
// The dispatcher's AVX-512 code returns with the upper halves of the vector registers dirty, and
// every legacy-SSE instruction after it then runs about 3.5 times slower on this machine (the
// SSE2 build of XXH3 itself: 19 -> 5.4 GB/s) -- libraries built for the baseline, ours included.
// These wrappers clear them (vzeroupper) on the way out. bench: BM_DigestLeavesSseFast.

#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace retrace::detail {

std::uint64_t xxh3_64(const void* data, std::size_t size);
std::uint64_t xxh3_64(const void* data, std::size_t size, std::uint64_t seed);
XXH128_hash_t xxh3_128(const void* data, std::size_t size);
XXH128_hash_t xxh3_128(const void* data, std::size_t size, std::uint64_t seed);
// XXH3_64bits_update, dispatched as above.
void xxh3_64_update(XXH3_state_t* state, const void* data, std::size_t size);

// Whether the dispatcher is built in (core/CMakeLists.txt found it in the library; x86-64).
bool xxh3_dispatched();

// For the benchmark's control: the dispatched XXH3-64 without clearing the upper halves after
// it. Nothing else calls it.
std::uint64_t xxh3_64_leaving_upper_dirty(const void* data, std::size_t size);

}  // namespace retrace::detail
