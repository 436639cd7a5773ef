#include <retrace/snapshot.h>

#include "cuda_hooks.h"

namespace retrace {

HostSnapshot snapshot_to_host(const at::Tensor& tensor) {
  if (tensor.is_cuda()) {
    detail::CudaHostCopy copy = detail::cuda_copy_to_host_async(tensor);
    return {std::move(copy.host), std::move(copy.ready)};
  }
  return {tensor.detach().resolve_conj().resolve_neg().cpu().clone(at::MemoryFormat::Contiguous), {}};
}

}  // namespace retrace
