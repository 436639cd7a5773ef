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
