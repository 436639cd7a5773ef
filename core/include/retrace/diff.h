#pragma once
// Bitwise comparison of two tensors, and how far apart they are when they are not equal.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace retrace {

struct NonFiniteCounts {
  std::int64_t nan = 0;
  std::int64_t pos_inf = 0;
  std::int64_t neg_inf = 0;
  bool operator==(const NonFiniteCounts& o) const {
    return nan == o.nan && pos_inf == o.pos_inf && neg_inf == o.neg_inf;
  }
};

struct DiffReport {
  // Set when the tensors cannot be compared element by element (dtype or shape differ); the
  // counts below are then empty.
  std::string mismatch;
  std::string dtype;  // e.g. "Float"
  std::vector<std::int64_t> sizes;
  std::int64_t numel = 0;
  std::int64_t differing = 0;                // elements whose bits differ
  std::int64_t first_index = -1;             // flat (row-major) index of the first differing element
  std::vector<std::int64_t> first_position;  // the same as a multi-index
  double first_expected = 0, first_actual = 0;
  // Largest |a-b| over differing pairs where both are finite (0 if none).
  double max_abs_diff = 0;
  // Largest distance in units in the last place over differing pairs where neither is NaN;
  // for integer dtypes the integer distance. +0 and -0 are 0 ULP apart but still differ bitwise.
  std::uint64_t max_ulp = 0;
  // Differing pairs where exactly one side, or both with different values, are non-finite.
  std::int64_t nonfinite_mismatches = 0;
  NonFiniteCounts expected_nonfinite, actual_nonfinite;

  bool comparable() const { return mismatch.empty(); }
  bool bitwise_equal() const { return comparable() && differing == 0; }
  // A multi-line human-readable report.
  std::string to_string() const;
  // One line, for logs and exception messages.
  std::string summary() const;
};

// Compares the bits of two tensors element by element (on the host; CUDA tensors are copied).
// NaNs with equal payloads are equal; +0 and -0 differ. Cost: O(numel), one pass.
DiffReport bitwise_diff(const at::Tensor& expected, const at::Tensor& actual);

// NaN / +Inf / -Inf counts of a floating tensor (zeros for integer tensors).
NonFiniteCounts count_nonfinite(const at::Tensor& tensor);

// Whether every element of `tensor` is finite (true for a non-floating tensor). A contiguous CPU
// tensor of float, double, half or bfloat16 is read once, without a dispatch (NaN and Inf are the
// values whose exponent bits are all ones); any other through ATen (isfinite, all).
bool all_finite(const at::Tensor& tensor);

}  // namespace retrace
