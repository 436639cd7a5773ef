#pragma once
// The error types retrace throws for users' mistakes and bad data. Our own invariants use
// TORCH_INTERNAL_ASSERT instead; those are bugs, never the user's fault.

#include <stdexcept>
#include <string>

namespace retrace {

// Base of every error retrace throws on purpose. what() is one line: what is wrong, where, and
// how to fix it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A defense refusing to go on, on purpose: clip.error_if_nonfinite on a non-finite gradient norm.
// The run stops, and that is the defense holding, not the fault breaking the run: a scenario that
// expects to hold by raising (expect.raises) holds only on one of these, and a negative control
// never breaks by one. A program's own guard throws it to be judged the same.
class DefenseRefusal : public Error {
 public:
  using Error::Error;
};

// A checkpointed segment was used in a way that cannot work (bad outputs, mixed devices,
// reentrant backward through torch::autograd::grad with inputs=, ...). segment() names it.
class CheckpointError : public Error {
 public:
  CheckpointError(std::string segment, const std::string& what) : Error(what), segment_(std::move(segment)) {}
  const std::string& segment() const noexcept { return segment_; }

 private:
  std::string segment_;
};

}  // namespace retrace
