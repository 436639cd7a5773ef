// CUDA side of core/cuda_hooks.h: stream-capture queries, the default generators under graph
// capture, the device digest launcher and host snapshots.
#include "../cuda_hooks.h"

#include "digest_kernel.h"

#include <retrace/error.h>

#include <ATen/EmptyTensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/from_blob.h>
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

std::uint64_t cuda_capture_id(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(c10::cuda::getCurrentCUDAStream(device).stream(), &status, &id));
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

// How PyTorch keeps RNG right in a graph (torch 2.11, ATen/cuda/CUDAGeneratorImpl.{h,cpp},
// CUDAGraph.cpp): capture_begin() registers the current device's default generator state with
// the graph, and capture_prologue() marks it capturing. A random kernel captured then reads seed
// and base offset from two device slots of that state plus an offset counted from the start of
// the capture (offset_intragraph_); capture_end() takes that count as the graph's increment, and
// each replay() fills the slots with the generator's seed and offset before launching, then
// advances the offset by the increment. torch.compile's checkpointing under CUDA graphs (Note
// [CUDA Graph Safe RNG Functionalization], torch/_functorch/partitioners.py) swaps state objects
// with graphsafe_set_state() for the same reason: it is the one way to change what the
// generator draws that is legal during capture.

GraphRngPosition cuda_graph_rng_position(const at::Generator& generator, c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);  // philox_cuda_state() asks the current device's stream
  auto* impl = generator.get<at::CUDAGeneratorImpl>();
  at::PhiloxCudaState philox;
  try {
    // Increment 0 advances nothing; during capture the answer carries the offset counted from
    // the start of the capture. It throws for a state the capturing graph did not register.
    philox = impl->philox_cuda_state(0);
  } catch (const c10::Error& e) {
    throw Error("retrace::RngState::capture: cuda:" + std::to_string(device) +
                "'s generator is not part of the CUDA graph being captured (at::cuda::CUDAGraph registers the "
                "default generator of the device current at capture_begin(); register others with "
                "register_generator_state()): " +
                e.what_without_backtrace());
  }
  TORCH_INTERNAL_ASSERT(philox.captured_, "the generator of cuda:", static_cast<int>(device),
                        " answered outside a graph capture");
  return {generator.graphsafe_get_state(), cuda_capture_id(device), philox.offset_intragraph_};
}

void cuda_graph_rng_rewind(at::Generator generator, c10::DeviceIndex device, const GraphRngPosition& position) {
  c10::cuda::CUDAGuard guard(device);
  auto* source = position.state.get<at::CUDAGeneratorImpl>();
  // The registered state's device slots, which every random kernel of this capture reads and
  // each replay fills.
  const at::PhiloxCudaState slots = source->philox_cuda_state(0);
  TORCH_INTERNAL_ASSERT(slots.captured_, "the generator of cuda:", static_cast<int>(device),
                        " answered outside a graph capture");
  // A state object of our own, as capture_prologue() leaves a registered one but at the captured
  // offset, reading the same slots (views: the registered state keeps owning them). Rewinding
  // the registered object instead is impossible (no setter is legal during capture) and would be
  // wrong: its count is the graph's increment, which must cover every draw made in the capture.
  auto state = c10::make_intrusive<at::CUDAGeneratorState>(source->current_seed(), source->philox_offset_per_thread(),
                                                           position.offset);
  state->capturing_ = true;
  const auto view = [device](std::int64_t* slot) {
    const at::TensorOptions options = at::TensorOptions().dtype(at::kLong).device(at::kCUDA, device);
    // target_device: for_blob would otherwise ask the driver which device owns the pointer.
    return at::for_blob(slot, {1}).options(options).target_device(options.device()).make_tensor();
  };
  state->seed_extragraph_ = view(slots.seed_.ptr);
  state->offset_extragraph_ = view(slots.offset_.ptr);
  generator.graphsafe_set_state(at::make_generator<at::CUDAGeneratorImpl>(device, std::move(state)));
}

namespace {

// Buffers overwritten in full before anything reads them. While deterministic algorithms are on,
// at::empty NaN-fills every new tensor (Context::deterministicFillUninitializedMemory): a host
// pass over each pinned snapshot buffer on the training thread, an extra kernel for a device one.
// at::detail's allocation, which at::empty runs before the fill, takes the same allocators (the
// caching host allocator for pinned memory) without it. Turning the global flag off around
// at::empty instead would also skip the fill for other threads' allocations meanwhile.
at::Tensor unfilled_pinned(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_cpu(sizes, dtype, /*pin_memory=*/true);
}

at::Tensor unfilled_on_device(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
  return at::detail::empty_cuda(sizes, dtype, device, std::nullopt);
}

// Launches the digest kernel over `contiguous` on the current stream; returns the device lanes.
at::Tensor launch_lanes(const at::Tensor& contiguous) {
  at::Tensor t = contiguous;
  if (reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 8 != 0) t = t.clone();  // a view at an odd offset
  at::Tensor lanes = unfilled_on_device({2}, at::kLong, t.device());
  lanes.zero_();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int err = launch_digest_lanes(t.const_data_ptr(), t.nbytes(),
                                      reinterpret_cast<std::uint64_t*>(lanes.mutable_data_ptr<std::int64_t>()), stream);
  C10_CUDA_CHECK(static_cast<cudaError_t>(err));
  return lanes;  // `t` may be freed now: the caching allocator orders its reuse after the kernel
}

// The digest from lanes `index` of `host_lanes` (two int64 per tensor).
Digest finish(const at::Tensor& host_lanes, const Digest& header, std::uint64_t nbytes, std::size_t index = 0) {
  const auto* v = reinterpret_cast<const std::uint64_t*>(host_lanes.const_data_ptr<std::int64_t>()) + 2 * index;
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
  at::Tensor host = unfilled_pinned({2}, at::kLong);
  host.copy_(lanes, /*non_blocking=*/true);
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(c10::cuda::getCurrentCUDAStream());
  const std::uint64_t nbytes = contiguous.nbytes();
  return [done, host, header, nbytes] {
    done->synchronize();
    return finish(host, header, nbytes);
  };
}

std::vector<std::function<Digest()>> cuda_digest_async_many(const std::vector<at::Tensor>& contiguous,
                                                            const std::vector<Digest>& headers) {
  TORCH_INTERNAL_ASSERT(contiguous.size() == headers.size());
  std::vector<std::function<Digest()>> out;
  if (contiguous.empty()) return out;
  const c10::Device device = contiguous.front().device();
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const std::size_t n = contiguous.size();
  // One zeroed lane buffer, one launch per kDigestBatchMax tensors, one copy to the host, one
  // event: the per-tensor cost on the training thread is filling a slot of the launch's
  // parameter block, not an allocation, a launch, a copy and an event each.
  at::Tensor lanes = unfilled_on_device({static_cast<std::int64_t>(2 * n)}, at::kLong, device);
  lanes.zero_();
  auto* lane_ptr = reinterpret_cast<std::uint64_t*>(lanes.mutable_data_ptr<std::int64_t>());
  std::vector<at::Tensor> realigned;  // views at an odd offset, copied; freed in stream order
  DigestBatch batch;
  std::size_t first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& t = contiguous[i];
    TORCH_INTERNAL_ASSERT(t.device() == device, "cuda_digest_async_many: tensors on ", t.device(), " and ", device);
    const void* data = t.const_data_ptr();
    if (reinterpret_cast<std::uintptr_t>(data) % 8 != 0) {
      realigned.push_back(t.clone());
      data = realigned.back().const_data_ptr();
    }
    batch.data[batch.count] = data;
    batch.nbytes[batch.count] = t.nbytes();
    ++batch.count;
    if (batch.count == kDigestBatchMax || i + 1 == n) {
      C10_CUDA_CHECK(static_cast<cudaError_t>(launch_digest_lanes_many(batch, lane_ptr + 2 * first, stream)));
      first = i + 1;
      batch.count = 0;
    }
  }
  at::Tensor host = unfilled_pinned({static_cast<std::int64_t>(2 * n)}, at::kLong);
  host.copy_(lanes, /*non_blocking=*/true);
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(c10::cuda::getCurrentCUDAStream());
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back([done, host, header = headers[i], nbytes = static_cast<std::uint64_t>(contiguous[i].nbytes()), i] {
      done->synchronize();
      return finish(host, header, nbytes, i);
    });
  }
  return out;
}

CudaHostCopy cuda_copy_to_host_async(const at::Tensor& tensor) {
  c10::cuda::CUDAGuard guard(tensor.device());
  const c10::cuda::CUDAStream producer = c10::cuda::getCurrentCUDAStream();
  // A device-side copy first, ordered on the producing stream: an in-place update queued after
  // this call can no longer reach the bytes being snapshotted, and the training stream never
  // waits for the (much slower) device-to-host leg.
  const at::Tensor source = tensor.detach().resolve_conj().resolve_neg();
  at::Tensor staged = unfilled_on_device(source.sizes(), source.scalar_type(), source.device());
  staged.copy_(source);
  at::cuda::CUDAEvent staged_ready;
  staged_ready.record(producer);
  const c10::cuda::CUDAStream side = side_stream(tensor.device().index());
  staged_ready.block(side);
  at::Tensor host = unfilled_pinned(staged.sizes(), staged.scalar_type());
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    host.copy_(staged, /*non_blocking=*/true);
  }
  staged.record_stream(side);  // not reused by the allocator before the side stream is done with it
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(side);
  return {host, [done] { done->synchronize(); }};
}

std::string cuda_device_name(c10::DeviceIndex device) { return at::cuda::getDeviceProperties(device)->name; }

}  // namespace retrace::detail
