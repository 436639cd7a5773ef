#pragma once
// One switch for the settings that make LibTorch runs repeatable bit for bit.

namespace retrace {

// While alive: deterministic algorithms on (a nondeterministic op is an error, not a warning),
// cuDNN deterministic, cuDNN benchmark off. cuBLAS needs CUBLAS_WORKSPACE_CONFIG (":4096:8" or
// ":16:8") before its first handle is made: the guard sets ":4096:8" itself when CUDA has not
// been initialized yet, and throws retrace::Error, saying what to set and where, when CUDA is
// already initialized without it. The destructor restores the flags (not the variable).
// Not thread-safe: the flags are process-wide.
class DeterministicGuard {
 public:
  DeterministicGuard();
  ~DeterministicGuard();
  DeterministicGuard(const DeterministicGuard&) = delete;
  DeterministicGuard& operator=(const DeterministicGuard&) = delete;

 private:
  bool algorithms_, warn_only_, cudnn_deterministic_, cudnn_benchmark_;
};

// True when CUBLAS_WORKSPACE_CONFIG holds a value cuBLAS documents as deterministic.
bool cublas_workspace_config_is_deterministic();

}  // namespace retrace
