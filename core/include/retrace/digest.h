#pragma once
// Tensor digests: a 128-bit content hash of a tensor's logical values, with its dtype and shape
// folded in. Equal digests mean equal bits (up to hash collisions); a digest is how the recorder
// and the recompute verifier compare tensors without keeping them.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace retrace {

// Which function produced a digest. Digests of different algorithms never compare equal.
enum class DigestAlgorithm : std::uint8_t {
  kNone = 0,
  // Host: XXH3-128 of the contiguous bytes, seeded with XXH3-64 of a header (layout version,
  // dtype, rank, sizes).
  kXxh3_128 = 1,
  // CUDA device kernel: two independent position-keyed 64-bit lanes summed over 8-byte words
  // (docs/checkpoint.md). Any change confined to one 8-byte word always changes the digest.
  kDeviceLanes = 2,
};

struct Digest {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  DigestAlgorithm algorithm = DigestAlgorithm::kNone;

  bool operator==(const Digest& o) const { return lo == o.lo && hi == o.hi && algorithm == o.algorithm; }
  bool operator!=(const Digest& o) const { return !(*this == o); }
  // 32 lowercase hex digits, hi then lo.
  std::string hex() const;
};

// Digest of a tensor's logical contents. Non-contiguous views, conjugate and negative views are
// digested by value (a contiguous copy is made first). CPU tensors: XXH3-128 (throughput: bench/README.md).
// CUDA tensors: a device kernel on the current stream; only the 16-byte result crosses to the
// host (this call waits for it). Throws retrace::Error for an undefined tensor, or a CUDA tensor
// in a build without CUDA.
Digest digest(const at::Tensor& tensor);

// A digest that may still be computing on a device. get() waits for it (on a CUDA event, never
// on the whole device) and finishes it; a ready one returns at once. Copyable; get() may run on
// another thread than the one that started it (the recorder's writer thread does).
class PendingDigest {
 public:
  PendingDigest() = default;
  explicit PendingDigest(const Digest& ready) : ready_(ready) {}
  explicit PendingDigest(std::function<Digest()> finish) : finish_(std::move(finish)) {}
  bool ready() const { return !finish_; }
  Digest get() const { return finish_ ? finish_() : ready_; }

 private:
  Digest ready_;
  std::function<Digest()> finish_;
};

// digest(), without waiting for a device. CUDA tensors: the kernel and the copy of its 16-byte
// result into pinned host memory are queued on the current stream, behind an event; the caller
// never synchronizes (the recorder's digest mode: no host sync per segment, the writer thread
// collects the results). Other tensors: digested now. Equal to digest(tensor) once finished.
PendingDigest digest_async(const at::Tensor& tensor);

// digest_async for many tensors at once: the CUDA ones of each device in one batch (one launch
// per 128 tensors, one copy of the results, one event), the others digested now. The recorder
// digests the whole state and every gradient each step this way: one by one, the per-tensor
// launches, allocations and events cost more than the hashing. Each result equals
// digest(tensors[i]) once finished.
std::vector<PendingDigest> digest_async_many(const std::vector<at::Tensor>& tensors);

// The host algorithm on raw bytes (what digest() computes on a CPU tensor's contiguous bytes).
Digest digest_bytes(const void* data, std::size_t size);

}  // namespace retrace
