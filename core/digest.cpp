#include <retrace/digest.h>

#include "bytes.h"
#include "cuda_hooks.h"
#include "xxh3.h"

#include <retrace/error.h>

#include <c10/util/SmallVector.h>

#include <algorithm>

namespace retrace {

std::string Digest::hex() const {
  std::string out;
  out.reserve(32);
  detail::append_hex(out, hi);
  detail::append_hex(out, lo);
  return out;
}

Digest digest_bytes(const void* data, std::size_t size) {
  const XXH128_hash_t h = detail::xxh3_128(data, size);
  return {h.low64, h.high64, DigestAlgorithm::kXxh3_128};
}

namespace {

// dtype, rank and sizes: tensors with equal bytes but another dtype or shape digest differently.
// Laid out as detail::ByteWriter writes them (u8 layout version, u8 dtype, u32 rank, i64 per
// size, little-endian), in a buffer on the stack for tensors of up to 8 dimensions: the recorder
// digests hundreds of tensors a step, and a heap vector each cost more than hashing a small one.
class HeaderBytes {
 public:
  explicit HeaderBytes(const at::Tensor& t) {
    put(static_cast<std::uint8_t>(1));  // header layout version
    put(static_cast<std::uint8_t>(t.scalar_type()));
    put(static_cast<std::uint32_t>(t.dim()));
    for (std::int64_t s : t.sizes()) put(s);
  }
  const std::uint8_t* data() const { return bytes_.data(); }
  std::size_t size() const { return bytes_.size(); }

 private:
  template <typename T>
  void put(T value) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
    bytes_.append(p, p + sizeof(T));  // little-endian hosts only (x86-64, arm64)
  }
  c10::SmallVector<std::uint8_t, 2 + 4 + 8 * 8> bytes_;
};

}  // namespace

namespace {

// The tensor digest() hashes (contiguous, conj and neg resolved), after validating it.
at::Tensor digestable(const at::Tensor& tensor) {
  if (!tensor.defined()) throw Error("retrace::digest: the tensor is undefined");
  if (tensor.layout() != c10::kStrided) {
    throw Error("retrace::digest: only strided (dense) tensors are supported; call .to_dense() first");
  }
  if (tensor.is_meta()) throw Error("retrace::digest: a meta tensor has no values to digest");
  // Fast path (no dispatch): a contiguous CPU tensor is hashed where it lies.
  if (!tensor.is_contiguous() || tensor.is_conj() || tensor.is_neg())
    return tensor.resolve_conj().resolve_neg().contiguous();
  return tensor;
}

}  // namespace

PendingDigest digest_async(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.is_cuda()) return PendingDigest(digest(tensor));
  const at::Tensor t = digestable(tensor);
  const HeaderBytes header(t);
  return PendingDigest(detail::cuda_digest_async(t, digest_bytes(header.data(), header.size())));
}

std::vector<PendingDigest> digest_async_many(const std::vector<at::Tensor>& tensors) {
  std::vector<PendingDigest> out(tensors.size());
  // CUDA tensors by device, each device's in one batch on its current stream.
  std::vector<c10::DeviceIndex> devices;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda() && std::find(devices.begin(), devices.end(), t.device().index()) == devices.end()) {
      devices.push_back(t.device().index());
    }
  }
  for (c10::DeviceIndex device : devices) {
    std::vector<std::size_t> index;
    std::vector<at::Tensor> contiguous;
    std::vector<Digest> headers;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      if (!t.defined() || !t.is_cuda() || t.device().index() != device) continue;
      index.push_back(i);
      contiguous.push_back(digestable(t));
      const HeaderBytes header(contiguous.back());
      headers.push_back(digest_bytes(header.data(), header.size()));
    }
    std::vector<std::function<Digest()>> pending = detail::cuda_digest_async_many(contiguous, headers);
    for (std::size_t k = 0; k < index.size(); ++k) out[index[k]] = PendingDigest(std::move(pending[k]));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || !tensors[i].is_cuda()) out[i] = PendingDigest(digest(tensors[i]));
  }
  return out;
}

Digest digest(const at::Tensor& tensor) {
  at::Tensor t = digestable(tensor);
  const HeaderBytes header(t);
  if (t.is_cuda()) return detail::cuda_digest(t, digest_bytes(header.data(), header.size()));
  if (!t.is_cpu()) t = t.cpu();
  // The header (dtype, rank, sizes) seeds the hash of the bytes.
  const XXH128_hash_t h = detail::xxh3_128(t.const_data_ptr(), t.nbytes(), XXH3_64bits(header.data(), header.size()));
  return {h.low64, h.high64, DigestAlgorithm::kXxh3_128};
}

}  // namespace retrace
