#pragma once
// Plain-C++ interface to the device digest kernel, so that the host side needs no CUDA headers
// and the .cu file needs no ATen headers.

#include <cstdint>

namespace retrace::detail {

// Sums two position-keyed 64-bit lanes over the 8-byte words of [data, data + nbytes) into
// out[0] and out[1] (device memory, zeroed by the caller), on `stream` (a cudaStream_t).
// data must be 8-byte aligned. Returns the cudaError_t of the launch.
int launch_digest_lanes(const void* data, std::uint64_t nbytes, std::uint64_t* out,
                        void* stream);

// The host-side finish: folds the lanes and the header digest into the final 128 bits.
void finish_digest_lanes(std::uint64_t lane_a, std::uint64_t lane_b, std::uint64_t header_lo,
                         std::uint64_t header_hi, std::uint64_t nbytes, std::uint64_t* lo,
                         std::uint64_t* hi);

}  // namespace retrace::detail
