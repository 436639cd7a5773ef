// Built only with NCCL (RETRACE_WITH_NCCL): USE_C10D_NCCL is defined for this file alone, so that
// ProcessGroupNCCL.hpp declares the class libtorch_cuda exports.
#include "gloo_backend.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace retrace::dist_internal {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}
bool nccl_built() { return true; }

}  // namespace retrace::dist_internal
