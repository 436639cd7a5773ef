#include <retrace/environment.h>

#include "cuda_hooks.h"

#include <retrace/version.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>

#include <algorithm>
#include <thread>

#include <sched.h>
#include <unistd.h>

namespace retrace {

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cores = ::sched_getaffinity(0, sizeof set, &set) == 0
                        ? CPU_COUNT(&set)
                        : static_cast<int>(std::thread::hardware_concurrency());
  return std::max(cores, 1);
}

Environment Environment::current() {
  Environment e;
  auto& ctx = at::globalContext();
  e.bitwise["torch_version"] = TORCH_VERSION;
  e.bitwise["cpu_capability"] = at::get_cpu_capability();
  e.bitwise["intra_op_threads"] = std::to_string(at::get_num_threads());
  e.bitwise["deterministic_algorithms"] = ctx.deterministicAlgorithms() ? "on" : "off";
  e.bitwise["cudnn_deterministic"] = ctx.deterministicCuDNN() ? "on" : "off";
  e.bitwise["cudnn_benchmark"] = ctx.benchmarkCuDNN() ? "on" : "off";
  e.bitwise["tf32_cublas"] = ctx.allowTF32CuBLAS() ? "on" : "off";
  const bool cuda = ctx.hasCUDA();
  const int devices = cuda ? at::detail::getCUDAHooks().deviceCount() : 0;
  std::string names;
  for (int i = 0; i < devices; ++i) {
    if (i) names += ", ";
    names += detail::cuda_device_name(static_cast<c10::DeviceIndex>(i));
  }
  e.bitwise["cuda_devices"] = devices ? names : "none";
  if (devices) {
    e.bitwise["cuda_runtime"] = std::to_string(at::detail::getCUDAHooks().versionCUDART());
    e.bitwise["cudnn_version"] = std::to_string(at::detail::getCUDAHooks().versionCuDNN());
    e.bitwise["tf32_cudnn"] = ctx.allowTF32CuDNN() ? "on" : "off";
  }
  e.info["retrace_version"] = kVersion;
  e.info["retrace_cuda_sources"] = kBuiltWithCuda ? "built" : "not built";
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) == 0) e.info["host"] = host;
  e.info["interop_threads"] = std::to_string(at::get_num_interop_threads());
  return e;
}

nlohmann::json Environment::to_json() const { return {{"bitwise", bitwise}, {"info", info}}; }

Environment Environment::from_json(const nlohmann::json& j) {
  Environment e;
  auto take = [](const nlohmann::json& src, std::map<std::string, std::string>& dst) {
    if (!src.is_object()) return;
    for (auto it = src.begin(); it != src.end(); ++it) {
      if (it.value().is_string()) dst[it.key()] = it.value().get<std::string>();
    }
  };
  if (j.is_object()) {
    if (j.contains("bitwise")) take(j["bitwise"], e.bitwise);
    if (j.contains("info")) take(j["info"], e.info);
  }
  return e;
}

std::vector<EnvironmentDifference> Environment::differences(const Environment& now) const {
  std::vector<EnvironmentDifference> out;
  if (bitwise.empty()) {
    out.push_back({"environment", "not recorded", "this process", "the trace has no environment fingerprint"});
    return out;
  }
  for (const auto& [key, recorded] : bitwise) {
    auto it = now.bitwise.find(key);
    const std::string current = it == now.bitwise.end() ? "absent" : it->second;
    if (current == recorded) continue;
    std::string fix;
    if (key == "intra_op_threads")
      fix = "run with " + recorded +
            " intra-op threads (retrace replay takes the trace's count unless --threads "
            "says otherwise: leave it out; in a process of your own, at::set_num_threads(" +
            recorded + ") or OMP_NUM_THREADS=" + recorded + ")";
    else if (key == "torch_version") fix = "replay with LibTorch " + recorded;
    else if (key == "cpu_capability")
      fix = "replay on a CPU with " + recorded + " kernels, or set ATEN_CPU_CAPABILITY=" + recorded;
    else if (key == "cuda_devices") fix = "replay on " + recorded;
    out.push_back({key, recorded, current, fix});
  }
  return out;
}

}  // namespace retrace
