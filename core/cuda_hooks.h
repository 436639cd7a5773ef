#pragma once
// Internal seam between the host code and the CUDA sources. Implemented in core/cuda/ when the
// build has CUDA, and by core/cuda_stubs.cpp otherwise, so that no host source needs CUDA headers.

#include <retrace/digest.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <string>

namespace retrace::detail {

// True while the current stream of `device` is capturing a CUDA graph.
bool cuda_stream_capturing(c10::DeviceIndex device);

// Device digest of a contiguous CUDA tensor, seeded with the host digest of its header.
// Runs on the current stream; waits for the 16-byte result.
Digest cuda_digest(const at::Tensor& contiguous, const Digest& header);

// cuda_digest without waiting: the kernel and the copy of its lanes into pinned host memory are
// queued on the current stream behind an event; the returned function waits on that event and
// finishes the digest (callable from any thread, any number of times).
std::function<Digest()> cuda_digest_async(const at::Tensor& contiguous, const Digest& header);

// An asynchronous snapshot of a CUDA tensor in pinned host memory (core/snapshot.cpp).
struct CudaHostCopy {
  at::Tensor host;              // pinned; its bytes are valid once `ready` returned
  std::function<void()> ready;  // waits on the copy's event
};
CudaHostCopy cuda_copy_to_host_async(const at::Tensor& tensor);

// The device's name (e.g. "NVIDIA H200").
std::string cuda_device_name(c10::DeviceIndex device);

}  // namespace retrace::detail
