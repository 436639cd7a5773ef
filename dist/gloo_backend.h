#pragma once
// The one translation unit that sees gloo's headers (Debian's libgloo-dev): torch's own gloo is a
// newer snapshot, so no gloo type may cross this seam -- it hands out a c10d::Backend only.
// Internal to retrace::dist.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace retrace::dist_internal {

// ProcessGroupGloo on the loopback-or-hostname device, with `timeout` on every collective.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& hostname);

// ProcessGroupNCCL where retrace was built with NCCL (RETRACE_WITH_NCCL); else a retrace::Error
// saying so.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);
bool nccl_built();

}  // namespace retrace::dist_internal
