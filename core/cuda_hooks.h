#pragma once
// Internal seam between the host code and the CUDA sources. Implemented in core/cuda/ when the
// build has CUDA, and by core/cuda_stubs.cpp otherwise, so that no host source needs CUDA headers.

#include <retrace/digest.h>
#include <retrace/rng.h>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace retrace::detail {

// True while the current stream of `device` is capturing a CUDA graph.
bool cuda_stream_capturing(c10::DeviceIndex device);

// The id of the CUDA graph capture running on `device`'s current stream; 0 when none.
std::uint64_t cuda_capture_id(c10::DeviceIndex device);

// CUDA RNG during graph capture (core/rng.cpp; Note [CUDA Graph-safe RNG states] in
// ATen/cuda/CUDAGeneratorImpl.h). The caller holds the generator's mutex and has checked that
// `device`'s current stream is capturing.
//
// Where `generator` (device's default generator) stands in the capture. Throws retrace::Error
// when its state is not registered with the capturing graph.
GraphRngPosition cuda_graph_rng_position(const at::Generator& generator, c10::DeviceIndex device);
// Makes `generator` draw again from `position`: installs a fresh state object, at that offset,
// that reads the same device seed and offset as position.state (filled by each replay). The
// graph-registered state object itself is left as it is: it counts the capture's draws.
void cuda_graph_rng_rewind(at::Generator generator, c10::DeviceIndex device, const GraphRngPosition& position);

// Device digest of a contiguous CUDA tensor, seeded with the host digest of its header.
// Runs on the current stream; waits for the 16-byte result.
Digest cuda_digest(const at::Tensor& contiguous, const Digest& header);

// cuda_digest without waiting: the kernel and the copy of its lanes into pinned host memory are
// queued on the current stream behind an event; the returned function waits on that event and
// finishes the digest (callable from any thread, any number of times).
std::function<Digest()> cuda_digest_async(const at::Tensor& contiguous, const Digest& header);

// cuda_digest_async for many contiguous tensors on one device, with one launch per 128 tensors,
// one copy of all their lanes to the host and one event; each function finishes its tensor's
// digest, equal to what cuda_digest_async gives for that tensor alone.
std::vector<std::function<Digest()>> cuda_digest_async_many(const std::vector<at::Tensor>& contiguous,
                                                            const std::vector<Digest>& headers);

// An asynchronous snapshot of a CUDA tensor in pinned host memory (core/snapshot.cpp).
struct CudaHostCopy {
  at::Tensor host;              // pinned; its bytes are valid once `ready` returned
  std::function<void()> ready;  // waits on the copy's event
};
CudaHostCopy cuda_copy_to_host_async(const at::Tensor& tensor);

// The device's name (e.g. "NVIDIA H200").
std::string cuda_device_name(c10::DeviceIndex device);

}  // namespace retrace::detail
