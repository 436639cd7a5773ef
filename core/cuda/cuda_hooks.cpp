// CUDA side of core/cuda_hooks.h: stream-capture queries and the device digest launcher.
#include "../cuda_hooks.h"

#include "digest_kernel.h"

#include <retrace/error.h>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

namespace retrace::detail {

bool cuda_stream_capturing(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

Digest cuda_digest(const at::Tensor& contiguous, const Digest& header) {
  c10::cuda::CUDAGuard guard(contiguous.device());
  at::Tensor t = contiguous;
  if (reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 8 != 0) t = t.clone();  // a view at an odd offset
  at::Tensor lanes = at::zeros({2}, t.options().dtype(at::kLong));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int err = launch_digest_lanes(t.const_data_ptr(), t.nbytes(),
                                      reinterpret_cast<std::uint64_t*>(lanes.mutable_data_ptr<std::int64_t>()),
                                      stream);
  C10_CUDA_CHECK(static_cast<cudaError_t>(err));
  const at::Tensor host = lanes.cpu();  // 16 bytes; waits for the kernel
  const auto* v = reinterpret_cast<const std::uint64_t*>(host.const_data_ptr<std::int64_t>());
  Digest d;
  d.algorithm = DigestAlgorithm::kDeviceLanes;
  finish_digest_lanes(v[0], v[1], header.lo, header.hi, t.nbytes(), &d.lo, &d.hi);
  return d;
}

std::string cuda_device_name(c10::DeviceIndex device) {
  return at::cuda::getDeviceProperties(device)->name;
}

}  // namespace retrace::detail
