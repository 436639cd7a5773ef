#include "gloo_backend.h"

#include <retrace/error.h>

namespace retrace::dist_internal {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds) {
  throw Error("this retrace was built without NCCL, so a data-parallel run cannot train on CUDA; rebuild where "
              "the CUDA toolkit and NCCL are found (cmake reports NCCL=ON), or train on the CPU (Gloo)");
}
bool nccl_built() { return false; }

}  // namespace retrace::dist_internal
