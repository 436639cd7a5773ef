// Device digest: each 8-byte word w at word index i contributes
//   lane A: fmix64(w ^ (i * K1 + K2))
//   lane B: fmix64((w + K3) ^ ((i + 1) * K4))
// summed mod 2^64. fmix64 (MurmurHash3's finalizer) is a bijection, so for a fixed position each
// term is a bijection of w: a change confined to one word always changes both lanes. Sums are
// order-independent, so the result does not depend on the launch shape or atomics' order.
#include "digest_kernel.h"

#include <cuda_runtime.h>

namespace retrace::detail {

namespace {

constexpr std::uint64_t K1 = 0x9E3779B97F4A7C15ull;
constexpr std::uint64_t K2 = 0xD6E8FEB86659FD93ull;
constexpr std::uint64_t K3 = 0xA0761D6478BD642Full;
constexpr std::uint64_t K4 = 0xC2B2AE3D27D4EB4Full;

__host__ __device__ __forceinline__ std::uint64_t fmix64(std::uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

constexpr int kThreads = 256;

// One block's share of a tensor's lanes: the grid-stride sum over its 8-byte words (block 0 also
// takes the tail bytes), reduced over the block and added to out[0], out[1] by one atomic pair.
__device__ __forceinline__ void block_lanes(const std::uint64_t* __restrict__ words, std::uint64_t nwords,
                                            unsigned tail_bytes, unsigned long long* out) {
  std::uint64_t a = 0, b = 0;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nwords; i += stride) {
    const std::uint64_t w = __ldg(words + i);
    a += fmix64(w ^ (i * K1 + K2));
    b += fmix64((w + K3) ^ ((i + 1) * K4));
  }
  if (tail_bytes && blockIdx.x == 0 && threadIdx.x == 0) {
    const unsigned char* tail = reinterpret_cast<const unsigned char*>(words + nwords);
    std::uint64_t w = 0;
    for (unsigned j = 0; j < tail_bytes; ++j) w |= static_cast<std::uint64_t>(tail[j]) << (8 * j);
    const std::uint64_t i = nwords;
    a += fmix64(w ^ (i * K1 + K2));
    b += fmix64((w + K3) ^ ((i + 1) * K4));
  }
  // Warp, then block reduction; one atomic pair per block.
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  __shared__ std::uint64_t sa[kThreads / 32], sb[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kThreads / 32 ? sa[lane] : 0;
    b = lane < kThreads / 32 ? sb[lane] : 0;
    for (int offset = 16; offset > 0; offset >>= 1) {
      a += __shfl_down_sync(0xffffffffu, a, offset);
      b += __shfl_down_sync(0xffffffffu, b, offset);
    }
    if (lane == 0) {
      atomicAdd(out, static_cast<unsigned long long>(a));
      atomicAdd(out + 1, static_cast<unsigned long long>(b));
    }
  }
}

__global__ void digest_lanes_kernel(const std::uint64_t* __restrict__ words, std::uint64_t nwords, unsigned tail_bytes,
                                    unsigned long long* out) {
  block_lanes(words, nwords, tail_bytes, out);
}

// Many tensors in one launch: blockIdx.y picks the tensor, and within it the same grid-stride
// sum as digest_lanes_kernel, so each pair of lanes is the one a launch of its own would give.
__global__ void digest_lanes_many_kernel(DigestBatch batch, unsigned long long* out) {
  const unsigned j = blockIdx.y;
  const std::uint64_t nwords = batch.nbytes[j] / 8;
  // Blocks beyond what this tensor needs leave at once (the grid is sized for the largest). The
  // whole block leaves together, before block_lanes' __syncthreads.
  if (blockIdx.x > 0 && blockIdx.x >= (nwords + kThreads - 1) / kThreads) return;
  block_lanes(static_cast<const std::uint64_t*>(batch.data[j]), nwords, static_cast<unsigned>(batch.nbytes[j] % 8),
              out + 2 * j);
}

}  // namespace

int launch_digest_lanes_many(const DigestBatch& batch, std::uint64_t* out, void* stream) {
  if (batch.count <= 0 || batch.count > kDigestBatchMax) return static_cast<int>(cudaErrorInvalidValue);
  std::uint64_t largest = 0;
  for (int j = 0; j < batch.count; ++j) largest = batch.nbytes[j] / 8 > largest ? batch.nbytes[j] / 8 : largest;
  std::uint64_t blocks = (largest + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  // Fewer than the single-tensor launch: the grid is this many blocks for every tensor of the
  // batch, and most tensors need far fewer (their extra blocks return at once).
  if (blocks > 1024) blocks = 1024;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(batch.count));
  digest_lanes_many_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      batch, reinterpret_cast<unsigned long long*>(out));
  return static_cast<int>(cudaGetLastError());
}

int launch_digest_lanes(const void* data, std::uint64_t nbytes, std::uint64_t* out, void* stream) {
  const std::uint64_t nwords = nbytes / 8;
  const unsigned tail_bytes = static_cast<unsigned>(nbytes % 8);
  std::uint64_t blocks = (nwords + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 4096) blocks = 4096;  // grid-stride beyond that; enough to fill any current GPU
  digest_lanes_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::uint64_t*>(data), nwords, tail_bytes, reinterpret_cast<unsigned long long*>(out));
  return static_cast<int>(cudaGetLastError());
}

void finish_digest_lanes(std::uint64_t lane_a, std::uint64_t lane_b, std::uint64_t header_lo, std::uint64_t header_hi,
                         std::uint64_t nbytes, std::uint64_t* lo, std::uint64_t* hi) {
  *lo = fmix64(lane_a ^ header_lo) ^ fmix64(nbytes + K2);
  *hi = fmix64(lane_b + header_hi) ^ fmix64(nbytes ^ K4);
}

}  // namespace retrace::detail
