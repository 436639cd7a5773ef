#pragma once
// The tensor payload codec: how TraceWriter stores one tensor's bytes and TraceReader gets them
// back. An internal of the trace layer (not installed); tests and benchmarks include it as
// "core/tensor_codec.h".

#include <retrace/trace.h>

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace retrace {

// The tensor payload codec on its own, as TraceWriter stores each tensor. `tensor` must be a
// contiguous CPU tensor. kZstd/kZstdShuffle: the bytes (byte-shuffled for kZstdShuffle when the
// element size > 1) in one zstd frame with its content size and checksum. kBloscBitshuffleLz4: one
// Blosc buffer (bit shuffle at the element size, LZ4); tensors over Blosc's 2 GiB limit throw.
// Blosc runs on the calling thread: its own threads are spawned per call, which costs more than
// they gain on tensors of a few MiB (bench/README.md).
std::string encode_tensor_payload(const at::Tensor& tensor, TensorCodec codec, int zstd_level = kDefaultZstdLevel);
// The most bytes encoding `tensor` with `codec` can take (the same checks as encoding it).
std::size_t tensor_payload_bound(const at::Tensor& tensor, TensorCodec codec);
// The same bytes written to `out`, which has `capacity` >= tensor_payload_bound() bytes of room;
// returns how many. The bytes do not depend on `capacity`. The trace writer encodes a record's
// tensors straight into the record's bytes, each at its own place, on several threads at once
// (thread-safe: no shared state).
std::size_t encode_tensor_payload_into(const at::Tensor& tensor, TensorCodec codec, int zstd_level, char* out,
                                       std::size_t capacity);
// The codec TraceWriter picks for `tensor` (contiguous CPU) under `options`.
TensorCodec choose_codec(const at::Tensor& tensor, const WriterOptions& options);
// The decoded size `data` declares, or nullopt when it is not a well-formed payload of `codec`
// (checked before anything is allocated).
std::optional<std::uint64_t> declared_payload_size(const void* data, std::size_t size, TensorCodec codec);
// Decodes into `out` (contiguous CPU, of the encoded dtype and shape). Throws retrace::Error when
// the payload does not declare exactly out.nbytes(), fails zstd's checksum, or does not decode.
void decode_tensor_payload(const void* data, std::size_t size, TensorCodec codec, at::Tensor& out);

}  // namespace retrace
