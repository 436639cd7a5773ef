#pragma once
// Host snapshots of tensors that later in-place updates cannot change: what the recorder stores
// in full mode and keeps in the flight ring.

#include <ATen/core/Tensor.h>

#include <functional>

namespace retrace {

struct HostSnapshot {
  at::Tensor host;             // contiguous, on the CPU (pinned for a CUDA source)
  std::function<void()> wait;  // call before reading `host`; empty when it is ready already
};

// CPU tensors: a contiguous clone, complete on return. CUDA tensors: asynchronous, and the
// calling thread never waits: a device-side clone on the current stream (so an in-place update
// queued afterwards cannot tear the snapshot), then the device-to-host copy into pinned memory
// from LibTorch's caching host allocator on a side stream, ordered after the clone by an event.
// wait() blocks on that copy's event only. The clone holds device memory until the copy is
// done. Both buffers skip the NaN fill that at::empty does under DeterministicGuard: they are
// overwritten in full, and the fill would cost a host pass over every snapshot on the training
// thread. Throws retrace::Error for a CUDA tensor in a build without CUDA.
HostSnapshot snapshot_to_host(const at::Tensor& tensor);

}  // namespace retrace
