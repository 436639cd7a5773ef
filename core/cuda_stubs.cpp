// Stand-ins for core/cuda/ in builds without CUDA.
#include "cuda_hooks.h"

#include <retrace/error.h>

namespace retrace::detail {

bool cuda_stream_capturing(c10::DeviceIndex) { return false; }

std::uint64_t cuda_capture_id(c10::DeviceIndex) { return 0; }

// Unreachable: without CUDA sources no stream is ever seen capturing.
GraphRngPosition cuda_graph_rng_position(const at::Generator&, c10::DeviceIndex) {
  throw Error("retrace::RngState: this build of retrace has no CUDA support");
}

void cuda_graph_rng_rewind(at::Generator, c10::DeviceIndex, const GraphRngPosition&) {
  throw Error("retrace::RngState: this build of retrace has no CUDA support");
}

Digest cuda_digest(const at::Tensor&, const Digest&) {
  throw Error("retrace::digest: this build of retrace has no CUDA support; rebuild with the CUDA toolkit present "
              "(RETRACE_CUDA=ON)");
}

std::function<Digest()> cuda_digest_async(const at::Tensor& t, const Digest& header) {
  return [d = cuda_digest(t, header)] { return d; };
}

std::vector<std::function<Digest()>> cuda_digest_async_many(const std::vector<at::Tensor>& contiguous,
                                                            const std::vector<Digest>& headers) {
  if (contiguous.empty()) return {};
  return {cuda_digest_async(contiguous.front(), headers.front())};  // throws: no CUDA support
}

CudaHostCopy cuda_copy_to_host_async(const at::Tensor&) {
  throw Error(
      "retrace: this build of retrace has no CUDA support; rebuild with the CUDA toolkit present (RETRACE_CUDA=ON)");
}

std::string cuda_device_name(c10::DeviceIndex) { return "unknown (built without CUDA)"; }

}  // namespace retrace::detail
