// Bitwise diff reports: known answers for counts, first index, ULP distance and non-finite counts.
#include <retrace/diff.h>
#include <retrace/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace retrace {
namespace {

TEST(BitwiseDiff, EqualTensorsReportNothing) {
  const at::Tensor a = torch::randn({3, 4});
  const DiffReport r = bitwise_diff(a, a.clone());
  EXPECT_TRUE(r.bitwise_equal());
  EXPECT_EQ(r.differing, 0);
  EXPECT_EQ(r.first_index, -1);
  EXPECT_EQ(r.numel, 12);
}

TEST(BitwiseDiff, OneUlpApartAtAKnownPosition) {
  at::Tensor a = torch::ones({2, 3});
  at::Tensor b = a.clone();
  b[1][2] = std::nextafter(1.0f, 2.0f);
  const DiffReport r = bitwise_diff(a, b);
  EXPECT_FALSE(r.bitwise_equal());
  EXPECT_EQ(r.differing, 1);
  EXPECT_EQ(r.first_index, 5);
  EXPECT_EQ(r.first_position, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(r.max_ulp, 1u);
  EXPECT_DOUBLE_EQ(r.max_abs_diff, std::nextafter(1.0f, 2.0f) - 1.0f);
}

TEST(BitwiseDiff, UlpDistanceCrossesZero) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  const DiffReport r = bitwise_diff(torch::tensor({tiny}), torch::tensor({-tiny}));
  EXPECT_EQ(r.max_ulp, 2u);  // -denorm_min, (+-)0, +denorm_min
}

TEST(BitwiseDiff, SignedZerosDifferBitwiseButAreZeroUlpApart) {
  const DiffReport r = bitwise_diff(torch::tensor({0.0f}), torch::tensor({-0.0f}));
  EXPECT_EQ(r.differing, 1);
  EXPECT_EQ(r.max_ulp, 0u);
  EXPECT_EQ(r.max_abs_diff, 0.0);
}

TEST(BitwiseDiff, HalfAndBFloat16UlpsAreInTheirOwnUnits) {
  const at::Tensor one_h = torch::ones({1}, at::kHalf);
  const at::Tensor next_h = torch::tensor({1.0009765625}).to(at::kHalf);  // 1 + 2^-10
  EXPECT_EQ(bitwise_diff(one_h, next_h).max_ulp, 1u);
  const at::Tensor one_b = torch::ones({1}, at::kBFloat16);
  const at::Tensor next_b = torch::tensor({1.0078125}).to(at::kBFloat16);  // 1 + 2^-7
  EXPECT_EQ(bitwise_diff(one_b, next_b).max_ulp, 1u);
}

TEST(BitwiseDiff, CountsNanAndInfOnEachSide) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor a = torch::tensor({1.0f, nan, inf, 2.0f, -inf});
  const at::Tensor b = torch::tensor({1.0f, nan, 3.0f, 2.5f, -inf});
  const DiffReport r = bitwise_diff(a, b);
  EXPECT_EQ(r.expected_nonfinite, (NonFiniteCounts{1, 1, 1}));
  EXPECT_EQ(r.actual_nonfinite, (NonFiniteCounts{1, 0, 1}));
  EXPECT_EQ(r.differing, 2);  // inf vs 3, 2 vs 2.5; equal NaN payloads are equal bits
  EXPECT_EQ(r.nonfinite_mismatches, 1);
  EXPECT_DOUBLE_EQ(r.max_abs_diff, 0.5);
  EXPECT_EQ(r.first_index, 2);
}

TEST(BitwiseDiff, NanPayloadsAreBits) {
  const at::Tensor a = torch::tensor({std::numeric_limits<float>::quiet_NaN()});
  at::Tensor b = a.clone();
  b.view(at::kInt).add_(1);  // another NaN payload
  const DiffReport r = bitwise_diff(a, b);
  EXPECT_EQ(r.differing, 1);
  EXPECT_EQ(r.max_ulp, 0u);  // undefined for NaN, so not counted
  EXPECT_EQ(r.nonfinite_mismatches, 1);
}

TEST(BitwiseDiff, IntegersReportIntegerDistance) {
  const DiffReport r = bitwise_diff(torch::tensor({1, 5, 9}), torch::tensor({1, 2, 19}));
  EXPECT_EQ(r.differing, 2);
  EXPECT_EQ(r.max_ulp, 10u);
  EXPECT_DOUBLE_EQ(r.max_abs_diff, 10.0);
}

TEST(BitwiseDiff, DtypeOrShapeMismatchIsNotComparable) {
  EXPECT_FALSE(bitwise_diff(torch::ones({2}), torch::ones({2}, at::kDouble)).comparable());
  const DiffReport r = bitwise_diff(torch::ones({2, 3}), torch::ones({3, 2}));
  EXPECT_FALSE(r.comparable());
  EXPECT_NE(r.mismatch.find("shape differs: [2, 3] vs [3, 2]"), std::string::npos);
  EXPECT_FALSE(bitwise_diff(torch::ones({1}), at::Tensor()).comparable());
}

TEST(BitwiseDiff, NonContiguousComparesLogicalOrder) {
  const at::Tensor a = torch::arange(6, at::kFloat).view({2, 3});
  EXPECT_TRUE(bitwise_diff(a.t(), a.t().contiguous()).bitwise_equal());
  EXPECT_FALSE(bitwise_diff(a.t().contiguous().view({2, 3}), a).bitwise_equal());
}

TEST(BitwiseDiff, ReportTextNamesTheFirstDifference) {
  at::Tensor a = torch::zeros({4});
  at::Tensor b = a.clone();
  b[2] = 1.5f;
  const std::string text = bitwise_diff(a, b).to_string();
  EXPECT_NE(text.find("1 of 4 elements differ; first at [2] expected 0 got 1.5"), std::string::npos) << text;
}

// all_finite's one-pass read of each floating dtype finds a NaN or an infinity anywhere: in the
// first and last element, on both sides of its 4096-element blocks. Controls: the largest finite
// value and the smallest subnormal are finite, and so is a tensor with neither.
TEST(AllFinite, FindsNanAndInfInEachFloatingDtypeAtEveryPosition) {
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const double biggest = dtype == at::kFloat    ? std::numeric_limits<float>::max()
                           : dtype == at::kDouble ? std::numeric_limits<double>::max()
                           : dtype == at::kHalf   ? 65504.0
                                                  : 3.3895313892515355e38;
    for (const std::int64_t n : {1, 4095, 4096, 4097, 10000}) {
      const at::Tensor clean = torch::randn({n}, at::kDouble).to(dtype);
      EXPECT_TRUE(all_finite(clean)) << dtype << " n=" << n;
      at::Tensor edge = clean.clone();
      edge[0] = biggest;
      edge[n - 1] = -biggest;
      EXPECT_TRUE(all_finite(edge)) << "the largest finite value, " << dtype;
      edge.fill_(1e-320);  // rounds to the smallest subnormal or zero: finite either way
      EXPECT_TRUE(all_finite(edge));
      for (const std::int64_t at :
           {std::int64_t{0}, n / 2, n - 1, std::min<std::int64_t>(n - 1, 4095), std::min<std::int64_t>(n - 1, 4096)}) {
        for (const double bad :
             {std::nan(""), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
          at::Tensor t = clean.clone();
          t[at] = bad;
          EXPECT_FALSE(all_finite(t)) << dtype << " n=" << n << " at " << at << " value " << bad;
        }
      }
    }
  }
}

// Tensors the one-pass read does not take go through ATen, with the same answers.
TEST(AllFinite, OtherTensorsGoThroughAten) {
  at::Tensor t = torch::ones({3, 4});
  t[2][1] = std::nanf("");
  EXPECT_FALSE(all_finite(t.t()));  // not contiguous
  EXPECT_TRUE(all_finite(torch::ones({3, 4}).t()));
  EXPECT_FALSE(all_finite(torch::tensor({1.0f, INFINITY}).neg()));  // a lazy negation
  EXPECT_TRUE(all_finite(torch::tensor({1, 2, 3})));                // integers are finite
  EXPECT_TRUE(all_finite(at::Tensor()));
  EXPECT_TRUE(all_finite(torch::empty({0})));
}

TEST(GtestHelpers, BitwiseEqFailsWithTheReport) {
  // Negative control for EXPECT_BITWISE_EQ itself.
  const auto result = testing::AssertBitwiseEqual("a", "b", torch::zeros({2}), torch::ones({2}));
  EXPECT_FALSE(result);
  EXPECT_NE(std::string(result.message()).find("2 of 2 elements differ"), std::string::npos);
  EXPECT_FALSE(testing::AssertAllFinite("t", torch::tensor({1.0f, std::nanf("")})));
  EXPECT_ALL_FINITE(torch::ones({3}));
}

}  // namespace
}  // namespace retrace
