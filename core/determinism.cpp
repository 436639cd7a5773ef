#include <retrace/determinism.h>

#include <retrace/error.h>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cstdlib>
#include <string>

namespace retrace {

bool cublas_workspace_config_is_deterministic() {
  const char* v = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  if (v == nullptr) return false;
  const std::string s = v;
  return s == ":4096:8" || s == ":16:8" || s == ":4096:2:16:8";
}

namespace {
bool cuda_initialized() {
  auto& ctx = at::globalContext();
  if (!ctx.hasCUDA()) return false;
  const auto& hooks = at::detail::getCUDAHooks();
  for (int i = 0; i < hooks.deviceCount(); ++i) {
    if (hooks.hasPrimaryContext(static_cast<c10::DeviceIndex>(i))) return true;
  }
  return false;
}
}  // namespace

DeterministicGuard::DeterministicGuard() {
  auto& ctx = at::globalContext();
  if (!cublas_workspace_config_is_deterministic()) {
    if (cuda_initialized()) {
      throw Error("retrace::DeterministicGuard: CUDA is already initialized and CUBLAS_WORKSPACE_CONFIG is not "
                  "set to :4096:8 or :16:8, so cuBLAS cannot be made deterministic; export "
                  "CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting the process");
    }
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/1);
  }
  algorithms_ = ctx.deterministicAlgorithms();
  warn_only_ = ctx.deterministicAlgorithmsWarnOnly();
  cudnn_deterministic_ = ctx.deterministicCuDNN();
  cudnn_benchmark_ = ctx.benchmarkCuDNN();
  ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);
  ctx.setDeterministicCuDNN(true);
  ctx.setBenchmarkCuDNN(false);
}

DeterministicGuard::~DeterministicGuard() {
  auto& ctx = at::globalContext();
  ctx.setDeterministicAlgorithms(algorithms_, warn_only_);
  ctx.setDeterministicCuDNN(cudnn_deterministic_);
  ctx.setBenchmarkCuDNN(cudnn_benchmark_);
}

}  // namespace retrace
