#pragma once
// Plain-C++ interface to the device digest kernel, so that the host side needs no CUDA headers
// and the .cu file needs no ATen headers.

#include <cstdint>

namespace retrace::detail {

// Sums two position-keyed 64-bit lanes over the 8-byte words of [data, data + nbytes) into
// out[0] and out[1] (device memory, zeroed by the caller), on `stream` (a cudaStream_t).
// data must be 8-byte aligned. Returns the cudaError_t of the launch.
int launch_digest_lanes(const void* data, std::uint64_t nbytes, std::uint64_t* out, void* stream);

// Up to kDigestBatchMax tensors for one launch (passed by value as the kernel's parameter, which
// stays under the 4 KiB parameter limit).
constexpr int kDigestBatchMax = 128;
struct DigestBatch {
  const void* data[kDigestBatchMax];  // each 8-byte aligned
  std::uint64_t nbytes[kDigestBatchMax];
  int count = 0;
};

// launch_digest_lanes for batch.count tensors at once: tensor j's lanes go to out[2j], out[2j+1]
// (device memory, zeroed by the caller), equal to what launch_digest_lanes gives for it alone.
int launch_digest_lanes_many(const DigestBatch& batch, std::uint64_t* out, void* stream);

// The host-side finish: folds the lanes and the header digest into the final 128 bits.
void finish_digest_lanes(std::uint64_t lane_a, std::uint64_t lane_b, std::uint64_t header_lo, std::uint64_t header_hi,
                         std::uint64_t nbytes, std::uint64_t* lo, std::uint64_t* hi);

}  // namespace retrace::detail
