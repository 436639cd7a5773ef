// The built-in models' constructors check their configs: one retrace::Error naming the field,
// not a LibTorch error from inside a module constructor.
#include <retrace/error.h>
#include <retrace/models.h>

#include <gtest/gtest.h>

#include <functional>
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

}  // namespace
}  // namespace retrace::models
