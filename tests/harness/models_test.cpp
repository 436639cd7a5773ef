// The built-in models' constructors check their configs: one retrace::Error naming the field,
// not a LibTorch error from inside a module constructor.
#include <retrace/error.h>
#include <retrace/gtest.h>
#include <retrace/models.h>
#include <retrace/program.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <set>
#include <string>

namespace retrace::models {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(none)";
}

TEST(Models, ABadConfigIsOneErrorNamingTheField) {
  GptConfig gpt;
  gpt.heads = 3;  // 32 is not divisible by 3
  EXPECT_NE(error_of([&] { TinyGpt m(gpt); }).find("GptConfig::d_model (32) must be divisible by GptConfig::heads (3)"),
            std::string::npos);
  gpt = GptConfig{};
  gpt.vocab = 0;
  EXPECT_EQ(error_of([&] { TinyGpt m(gpt); }), "TinyGpt: the config's vocab is 0; it must be at least 1");
  LstmConfig lstm;
  lstm.dropout = 1.0;
  EXPECT_EQ(error_of([&] { LstmLm m(lstm); }), "LstmLm: the config's dropout is 1.000000; it must be in [0, 1)");
  MlpConfig mlp;
  mlp.hidden = -4;
  EXPECT_EQ(error_of([&] { Mlp m(mlp); }), "Mlp: the config's hidden is -4; it must be at least 1");
  // Controls: the defaults construct.
  EXPECT_EQ(error_of([] { TinyGpt m(GptConfig{}); }), "(none)");
  EXPECT_EQ(error_of([] { LstmLm m(LstmConfig{}); }), "(none)");
  EXPECT_EQ(error_of([] { Mlp m(MlpConfig{}); }), "(none)");
}


// Built for a replay (RestoringStateScope: the snapshot will overwrite every parameter), a model
// skips drawing its initial values but has the same parameters -- names, dtypes, shapes, each
// requiring grad, each its own memory -- and, given the usual model's values, the same loss and
// gradients bitwise (with dropout, the generator seeded alike), having drawn less from the global
// generator. Control: the scope ends with its block, so a model built after it is the usual one,
// bitwise the first.
template <class Model, class Config>
void expect_restorable(const Config& config) {
  torch::manual_seed(3);
  auto usual = std::make_shared<Model>(config);
  const at::Tensor drawn_usually = at::detail::getDefaultCPUGenerator().get_state();
  std::shared_ptr<Model> restored;
  {
    const RestoringStateScope restoring;
    EXPECT_TRUE(restoring_state());
    torch::manual_seed(3);
    restored = std::make_shared<Model>(config);
  }
  EXPECT_FALSE(restoring_state());
  // The draws were skipped: from the same seed, the generator ends elsewhere.
  EXPECT_FALSE(at::equal(drawn_usually, at::detail::getDefaultCPUGenerator().get_state()));
  torch::manual_seed(3);
  auto again = std::make_shared<Model>(config);

  const auto a = usual->named_parameters(), b = restored->named_parameters(), c = again->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  std::set<const void*> memory;
  for (std::size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].key());
    EXPECT_EQ(a[i].key(), b[i].key());
    EXPECT_EQ(a[i].value().sizes(), b[i].value().sizes());
    EXPECT_EQ(a[i].value().scalar_type(), b[i].value().scalar_type());
    EXPECT_TRUE(b[i].value().requires_grad());
    EXPECT_TRUE(b[i].value().is_contiguous());
    EXPECT_TRUE(memory.insert(b[i].value().const_data_ptr()).second);
    EXPECT_BITWISE_EQ(a[i].value(), c[i].value());
    torch::NoGradGuard no_grad;
    b[i].value().copy_(a[i].value());
  }
  const Batch batch = usual->make_batch(9);
  torch::manual_seed(4);
  const at::Tensor loss_a = usual->loss(batch);
  loss_a.backward();
  torch::manual_seed(4);
  const at::Tensor loss_b = restored->loss(batch);
  loss_b.backward();
  EXPECT_BITWISE_EQ(loss_a, loss_b);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_BITWISE_EQ(a[i].value().grad(), b[i].value().grad());
}

TEST(Models, BuiltForAReplayTheyHaveTheirParametersUninitializedAndComputeAlike) {
  expect_restorable<TinyGpt>(GptConfig{});
  expect_restorable<LstmLm>(LstmConfig{});
  expect_restorable<Mlp>(MlpConfig{});
}

}  // namespace
}  // namespace retrace::models
