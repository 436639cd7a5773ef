// CUDA side of core/cuda_hooks.h: stream-capture queries and the device digest launcher.
#include "../cuda_hooks.h"

#include "digest_kernel.h"

#include <retrace/error.h>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <memory>
#include <mutex>

namespace retrace::detail {

bool cuda_stream_capturing(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}


namespace {

// Launches the digest kernel over `contiguous` on the current stream; returns the device lanes.
at::Tensor launch_lanes(const at::Tensor& contiguous) {
  at::Tensor t = contiguous;
  if (reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 8 != 0) t = t.clone();  // a view at an odd offset
  at::Tensor lanes = at::zeros({2}, t.options().dtype(at::kLong));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int err = launch_digest_lanes(t.const_data_ptr(), t.nbytes(),
                                      reinterpret_cast<std::uint64_t*>(lanes.mutable_data_ptr<std::int64_t>()),
                                      stream);
  C10_CUDA_CHECK(static_cast<cudaError_t>(err));
  return lanes;  // `t` may be freed now: the caching allocator orders its reuse after the kernel
}

Digest finish(const at::Tensor& host_lanes, const Digest& header, std::uint64_t nbytes) {
  const auto* v = reinterpret_cast<const std::uint64_t*>(host_lanes.const_data_ptr<std::int64_t>());
  Digest d;
  d.algorithm = DigestAlgorithm::kDeviceLanes;
  finish_digest_lanes(v[0], v[1], header.lo, header.hi, nbytes, &d.lo, &d.hi);
  return d;
}

// One side stream per device for snapshot copies, so that they overlap the training stream.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  return it->second;
}

}  // namespace

Digest cuda_digest(const at::Tensor& contiguous, const Digest& header) {
  c10::cuda::CUDAGuard guard(contiguous.device());
  const at::Tensor host = launch_lanes(contiguous).cpu();  // 16 bytes; waits for the kernel
  return finish(host, header, contiguous.nbytes());
}

std::function<Digest()> cuda_digest_async(const at::Tensor& contiguous, const Digest& header) {
  c10::cuda::CUDAGuard guard(contiguous.device());
  const at::Tensor lanes = launch_lanes(contiguous);
  // 16 bytes into pinned memory on the same stream (LibTorch's caching host allocator keeps the
  // block until the copy is done), then an event the finisher waits on: no host sync here.
  at::Tensor host = at::empty({2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  host.copy_(lanes, /*non_blocking=*/true);
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(c10::cuda::getCurrentCUDAStream());
  const std::uint64_t nbytes = contiguous.nbytes();
  return [done, host, header, nbytes] {
    done->synchronize();
    return finish(host, header, nbytes);
  };
}

CudaHostCopy cuda_copy_to_host_async(const at::Tensor& tensor) {
  c10::cuda::CUDAGuard guard(tensor.device());
  const c10::cuda::CUDAStream producer = c10::cuda::getCurrentCUDAStream();
  // A device-side copy first, ordered on the producing stream: an in-place update queued after
  // this call can no longer reach the bytes being snapshotted, and the training stream never
  // waits for the (much slower) device-to-host leg.
  at::Tensor staged = tensor.detach().resolve_conj().resolve_neg().clone(at::MemoryFormat::Contiguous);
  at::cuda::CUDAEvent staged_ready;
  staged_ready.record(producer);
  const c10::cuda::CUDAStream side = side_stream(tensor.device().index());
  staged_ready.block(side);
  at::Tensor host = at::empty(staged.sizes(), staged.options().device(at::kCPU).pinned_memory(true));
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    host.copy_(staged, /*non_blocking=*/true);
  }
  staged.record_stream(side);  // not reused by the allocator before the side stream is done with it
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(side);
  return {host, [done] { done->synchronize(); }};
}

std::string cuda_device_name(c10::DeviceIndex device) {
  return at::cuda::getDeviceProperties(device)->name;
}

}  // namespace retrace::detail
