#pragma once
// Internal seam between the host code and the CUDA sources. Implemented in core/cuda/ when the
// build has CUDA, and by core/cuda_stubs.cpp otherwise, so that no host source needs CUDA headers.

#include <retrace/digest.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <string>

namespace retrace::detail {

// True while the current stream of `device` is capturing a CUDA graph.
bool cuda_stream_capturing(c10::DeviceIndex device);

// Device digest of a contiguous CUDA tensor, seeded with the host digest of its header.
// Runs on the current stream; waits for the 16-byte result.
Digest cuda_digest(const at::Tensor& contiguous, const Digest& header);

// The device's name (e.g. "NVIDIA H200").
std::string cuda_device_name(c10::DeviceIndex device);

}  // namespace retrace::detail
