#pragma once
// GoogleTest helpers. Include from test code only (needs <gtest/gtest.h>).
//
//   EXPECT_BITWISE_EQ(expected, actual);   // failure message is the DiffReport
//   ASSERT_BITWISE_EQ(expected, actual);
//   EXPECT_ALL_FINITE(tensor);             // failure message gives NaN/Inf counts
//
// Scenario files as tests: retrace/gtest_scenario.h (RETRACE_SCENARIO_TEST).

#include <retrace/diff.h>

#include <gtest/gtest.h>

namespace retrace::testing {

inline ::testing::AssertionResult AssertBitwiseEqual(const char* expected_expr, const char* actual_expr,
                                                     const at::Tensor& expected, const at::Tensor& actual) {
  const DiffReport report = bitwise_diff(expected, actual);
  if (report.bitwise_equal()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << actual_expr << " is not bitwise equal to " << expected_expr << ":\n"
                                       << report.to_string();
}

inline ::testing::AssertionResult AssertAllFinite(const char* expr, const at::Tensor& tensor) {
  const NonFiniteCounts c = count_nonfinite(tensor);
  if (c.nan == 0 && c.pos_inf == 0 && c.neg_inf == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << expr << " holds non-finite values: nan=" << c.nan << " +inf=" << c.pos_inf
                                       << " -inf=" << c.neg_inf;
}

}  // namespace retrace::testing

#define EXPECT_BITWISE_EQ(expected, actual) \
  EXPECT_PRED_FORMAT2(::retrace::testing::AssertBitwiseEqual, expected, actual)
#define ASSERT_BITWISE_EQ(expected, actual) \
  ASSERT_PRED_FORMAT2(::retrace::testing::AssertBitwiseEqual, expected, actual)
#define EXPECT_ALL_FINITE(tensor) EXPECT_PRED_FORMAT1(::retrace::testing::AssertAllFinite, tensor)
