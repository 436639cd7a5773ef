// GPU tests: each skips, saying why, where no CUDA device is visible. scripts/gpu-check runs them
// on a GPU machine.
#include "../support/training.h"

#include <retrace/checkpoint.h>
#include <retrace/digest.h>
#include <retrace/gtest.h>
#include <retrace/rng.h>
#include <retrace/version.h>

#include <torch/torch.h>

#include <cstdlib>

namespace retrace {
namespace {

#define RETRACE_REQUIRE_CUDA()                                                        \
  do {                                                                                \
    if (!kBuiltWithCuda) GTEST_SKIP() << "retrace was built without CUDA sources";    \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device is visible";    \
  } while (0)

TEST(CudaDigest, EqualTensorsDigestEqualOnDevice) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(0);
  const at::Tensor a = torch::randn({1000, 37}, torch::kCUDA);
  const Digest d = digest(a);
  EXPECT_EQ(d.algorithm, DigestAlgorithm::kDeviceLanes);
  EXPECT_EQ(d, digest(a.clone()));
  EXPECT_NE(d, digest(a.view({37, 1000})));
  EXPECT_EQ(digest(a.t()), digest(a.t().contiguous()));
  const at::Tensor odd = a.view(-1).narrow(0, 1, 999);  // 4-byte offset: not 8-byte aligned
  EXPECT_EQ(digest(odd), digest(odd.clone()));
}

TEST(CudaDigest, OneBitFlipChangesTheDigest) {
  RETRACE_REQUIRE_CUDA();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(1);
    const at::Tensor base = torch::randn({257}, torch::kCUDA).to(dtype);  // odd size: tail bytes
    const Digest reference = digest(base);
    const at::Tensor host = base.cpu();
    for (std::size_t byte = 0; byte < host.nbytes(); byte += 7) {
      for (int bit = 0; bit < 8; ++bit) {
        at::Tensor flipped = host.clone();
        static_cast<std::uint8_t*>(flipped.data_ptr())[byte] ^= static_cast<std::uint8_t>(1u << bit);
        EXPECT_NE(digest(flipped.to(torch::kCUDA)), reference) << "byte " << byte << " bit " << bit;
      }
    }
  }
}

TEST(CudaRng, StateRestoresTheSameDropoutMasks) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(3);
  const c10::Device dev(torch::kCUDA, 0);
  const RngState state = RngState::capture({dev});
  ASSERT_EQ(state.generators().size(), 2u);
  EXPECT_EQ(state.generators()[1].bytes.size(), 16u);  // seed + offset
  const at::Tensor first = torch::dropout(torch::ones({4096}, dev), 0.5, true);
  state.restore();
  EXPECT_BITWISE_EQ(first, torch::dropout(torch::ones({4096}, dev), 0.5, true));
}

TEST(CudaCheckpoint, TinyGptWithDropoutBitwiseEqualToPlain) {
  RETRACE_REQUIRE_CUDA();
  torch::manual_seed(0);
  models::GptConfig c;
  c.layers = 4;
  c.dropout = 0.2;
  models::TinyGpt model(c);
  model.to(torch::kCUDA);
  model.train();
  models::Batch batch = model.make_batch(7);
  batch.input = batch.input.cuda();
  batch.target = batch.target.cuda();
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);  // cuBLAS determinism
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  const test::StepSnapshot plain = test::run_step(model, batch, {0, {}});
  const test::StepSnapshot ckpt = test::run_step(model, batch, {2, {}});
  at::globalContext().setDeterministicAlgorithms(false, false);
  EXPECT_BITWISE_EQ(plain.loss, ckpt.loss);
  EXPECT_BITWISE_EQ(plain.input_grad, ckpt.input_grad);
  for (std::size_t i = 0; i < plain.grads.size(); ++i) {
    SCOPED_TRACE(plain.grads[i].first);
    EXPECT_BITWISE_EQ(plain.grads[i].second, ckpt.grads[i].second);
  }
}

}  // namespace
}  // namespace retrace
