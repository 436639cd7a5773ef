// The tensor payload codec (docs/trace-format.md, "Tensor entries"): Blosc bit-shuffle + LZ4, or
// zstd over raw or byte-shuffled bytes. Used by the trace writer and reader (tensor_codec.h).
#include "tensor_codec.h"

#include <retrace/error.h>

#include <blosc.h>
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_getFrameHeader: checks the frame carries its checksum
#include <zstd.h>

#include <cstring>
#include <memory>
#include <string>

namespace retrace {

namespace {

// --- byte shuffle ----------------------------------------------------------------------------

void shuffle(const unsigned char* in, unsigned char* out, std::size_t n, std::size_t width) {
  if (n == 0) return;  // an empty tensor may have no data pointer at all
  const std::size_t count = n / width;
  for (std::size_t b = 0; b < width; ++b) {
    unsigned char* dst = out + b * count;
    for (std::size_t i = 0; i < count; ++i) dst[i] = in[i * width + b];
  }
  std::memcpy(out + count * width, in + count * width, n - count * width);
}

void unshuffle(const unsigned char* in, unsigned char* out, std::size_t n, std::size_t width) {
  if (n == 0) return;
  const std::size_t count = n / width;
  for (std::size_t b = 0; b < width; ++b) {
    const unsigned char* src = in + b * count;
    for (std::size_t i = 0; i < count; ++i) out[i * width + b] = src[i];
  }
  std::memcpy(out + count * width, in + count * width, n - count * width);
}

bool want_shuffle(ShuffleMode mode, const at::Tensor& t) {
  switch (mode) {
    case ShuffleMode::kAlways: return t.element_size() > 1;
    case ShuffleMode::kNever: return false;
    case ShuffleMode::kAuto: return t.is_floating_point() && t.element_size() >= 2;
  }
  return false;
}

}  // namespace

const char* to_string(TensorCodec codec) {
  switch (codec) {
    case TensorCodec::kDigestOnly: return "digest-only";
    case TensorCodec::kZstd: return "zstd";
    case TensorCodec::kZstdShuffle: return "zstd+shuffle";
    case TensorCodec::kBloscBitshuffleLz4: return "blosc-bitshuffle-lz4";
  }
  return "unknown";
}

const char* to_string(Compression c) { return c == Compression::kFast ? "fast" : "small"; }

TensorCodec choose_codec(const at::Tensor& tensor, const WriterOptions& options) {
  if (options.compression == Compression::kFast && tensor.nbytes() <= static_cast<std::size_t>(BLOSC_MAX_BUFFERSIZE)) {
    return TensorCodec::kBloscBitshuffleLz4;
  }
  return want_shuffle(options.shuffle, tensor) ? TensorCodec::kZstdShuffle : TensorCodec::kZstd;
}

namespace {

// Blosc: the bit shuffle at the element size groups each bit position of all elements together,
// so the nearly constant exponent bits of floats (and the high bits of small integers) become
// long runs that LZ4 removes at memory speed, while the random mantissa bits are stored as they
// are. Level 5 is Blosc's default: the same size as level 9 here, and faster (bench/README.md).
constexpr int kBloscLevel = 5;

std::size_t encode_blosc(const at::Tensor& tensor, char* out, std::size_t capacity) {
  const std::size_t n = tensor.nbytes();
  if (n > static_cast<std::size_t>(BLOSC_MAX_BUFFERSIZE)) {
    throw Error("a Blosc payload holds at most " + std::to_string(BLOSC_MAX_BUFFERSIZE) + " bytes, not " +
                std::to_string(n));
  }
  const int size = blosc_compress_ctx(kBloscLevel, BLOSC_BITSHUFFLE, tensor.element_size(), n, tensor.const_data_ptr(),
                                      out, capacity, BLOSC_LZ4_COMPNAME, 0, 1);
  if (size <= 0) throw Error("Blosc compression failed (" + std::to_string(size) + ")");
  return static_cast<std::size_t>(size);
}

std::size_t encode_zstd(const at::Tensor& tensor, TensorCodec codec, int zstd_level, char* out, std::size_t capacity) {
  const std::size_t n = tensor.nbytes();
  const auto* raw = static_cast<const unsigned char*>(tensor.const_data_ptr());
  std::string staged;
  if (codec == TensorCodec::kZstdShuffle && tensor.element_size() > 1) {
    staged.resize(n);
    shuffle(raw, reinterpret_cast<unsigned char*>(staged.data()), n, tensor.element_size());
    raw = reinterpret_cast<const unsigned char*>(staged.data());
  }
  // One context per thread, reused: creating one per tensor costs more than compressing a small
  // tensor at a fast level.
  thread_local std::unique_ptr<ZSTD_CCtx, std::size_t (*)(ZSTD_CCtx*)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_reset(cctx.get(), ZSTD_reset_session_and_parameters);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, zstd_level);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, 1);
  // zstd stores literals raw at negative levels unless told otherwise; float bytes are nearly all
  // literals, and Huffman-coding them (the shuffled exponent bytes above all) is where the size
  // goes down. Measured in bench/README.md: level -20 with this on is as small as level 1 and
  // 1.5-2x faster.
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
  const std::size_t size = ZSTD_compress2(cctx.get(), out, capacity, raw, n);
  if (ZSTD_isError(size)) throw Error(std::string("zstd compression failed: ") + ZSTD_getErrorName(size));
  return size;
}

void check_encodable(const at::Tensor& tensor, TensorCodec codec) {
  if (!tensor.is_cpu() || !tensor.is_contiguous()) {
    throw Error(std::string("encode_tensor_payload: the tensor is ") +
                (tensor.is_cpu() ? "not contiguous" : "not on the CPU") + "; pass tensor.cpu().contiguous()");
  }
  if (codec == TensorCodec::kDigestOnly) {
    throw Error("encode_tensor_payload: codec " + std::to_string(static_cast<int>(codec)) + " stores no data");
  }
}

}  // namespace

std::size_t tensor_payload_bound(const at::Tensor& tensor, TensorCodec codec) {
  check_encodable(tensor, codec);
  const std::size_t n = tensor.nbytes();
  return codec == TensorCodec::kBloscBitshuffleLz4 ? n + BLOSC_MAX_OVERHEAD : ZSTD_compressBound(n);
}

std::size_t encode_tensor_payload_into(const at::Tensor& tensor, TensorCodec codec, int zstd_level, char* out,
                                       std::size_t capacity) {
  const std::size_t bound = tensor_payload_bound(tensor, codec);
  if (capacity < bound) {
    throw Error("encode_tensor_payload_into: " + std::to_string(capacity) + " bytes of room, under the bound of " +
                std::to_string(bound));
  }
  // The codec is told exactly the bound, whatever the room: Blosc's output depends on the room it
  // is given (it stores a block raw when its compressed form would not fit what is left), and a
  // tensor's bytes must not depend on where it is encoded.
  return codec == TensorCodec::kBloscBitshuffleLz4 ? encode_blosc(tensor, out, bound)
                                                   : encode_zstd(tensor, codec, zstd_level, out, bound);
}

std::string encode_tensor_payload(const at::Tensor& tensor, TensorCodec codec, int zstd_level) {
  std::string out(tensor_payload_bound(tensor, codec), '\0');
  out.resize(encode_tensor_payload_into(tensor, codec, zstd_level, out.data(), out.size()));
  return out;
}

std::optional<std::uint64_t> declared_payload_size(const void* data, std::size_t size, TensorCodec codec) {
  switch (codec) {
    case TensorCodec::kBloscBitshuffleLz4: {
      // Validates the header against `size` (Blosc's decoder takes no source length), so that
      // decompressing afterwards cannot read past the payload.
      std::size_t n = 0;
      if (size < BLOSC_MIN_HEADER_LENGTH || blosc_cbuffer_validate(data, size, &n) != 0) return std::nullopt;
      std::size_t typesize = 0;
      int flags = 0;
      blosc_cbuffer_metainfo(data, &typesize, &flags);
      if (typesize == 0) return std::nullopt;
      return n;
    }
    case TensorCodec::kZstd:
    case TensorCodec::kZstdShuffle: {
      ZSTD_frameHeader frame{};
      if (ZSTD_getFrameHeader(&frame, data, size) != 0 || !frame.checksumFlag) return std::nullopt;
      const unsigned long long content = ZSTD_getFrameContentSize(data, size);
      if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN) return std::nullopt;
      return content;
    }
    case TensorCodec::kDigestOnly: break;
  }
  return std::nullopt;
}

void decode_tensor_payload(const void* data, std::size_t size, TensorCodec codec, at::Tensor& out) {
  const std::size_t n = out.nbytes();
  const std::optional<std::uint64_t> declared = declared_payload_size(data, size, codec);
  if (!declared) {
    throw Error(codec == TensorCodec::kBloscBitshuffleLz4 ? "Blosc buffer is malformed"
                                                          : "zstd frame is malformed or carries no checksum");
  }
  if (*declared != n) {
    throw Error("payload declares " + std::to_string(*declared) + " bytes, not the tensor's " + std::to_string(n));
  }
  if (codec == TensorCodec::kBloscBitshuffleLz4) {
    if (n == 0) return;
    const int got = blosc_decompress_ctx(data, out.data_ptr(), n, 1);
    if (got < 0 || static_cast<std::size_t>(got) != n)
      throw Error("Blosc buffer does not decompress (" + std::to_string(got) + ")");
    return;
  }
  const bool shuffled = codec == TensorCodec::kZstdShuffle && out.element_size() > 1;
  std::string staged;
  void* dst = out.data_ptr();
  if (shuffled) {
    staged.resize(n);
    dst = staged.data();
  }
  const std::size_t got = ZSTD_decompress(dst, n, data, size);
  if (ZSTD_isError(got) || got != n) {
    throw Error(std::string("does not decompress (") + (ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short") + ")");
  }
  if (shuffled) {
    unshuffle(reinterpret_cast<const unsigned char*>(staged.data()), static_cast<unsigned char*>(out.data_ptr()), n,
              out.element_size());
  }
}

}  // namespace retrace
