// RETRACE_SCENARIO_TEST: a scenario registered as a GoogleTest test, and the helper's failure
// message on one that fails.
#include <retrace/gtest_scenario.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace retrace {
namespace {

RETRACE_SCENARIO_TEST(ScenarioTest, BuiltinGradNanSkip, "builtin:grad-nan-skip")

TEST(ScenarioTest, FailureMessageNamesTheUnmetExpectations) {
  const ::testing::AssertionResult r = testing::ScenarioPasses("x", "builtin:grad-nan-skip-off");
  // A negative control run as if it were a defense: it passes (it broke, as it should)...
  EXPECT_TRUE(r);
  const std::string path = (std::filesystem::temp_directory_path() / "retrace_gtest_scenario.yaml").string();
  {
    std::ofstream f(path);
    f << "name: t\nmodel: {type: mlp, layers: 2}\ninjections: [{type: grad_nonfinite, step: 2}]\n"
         "training: {steps: 3}\nexpect: {params_finite: true}\n";
  }
  const ::testing::AssertionResult bad = testing::ScenarioPasses("t", path);
  EXPECT_FALSE(bad);
  EXPECT_NE(std::string(bad.message()).find("! params_finite: expected true, observed false"), std::string::npos)
      << bad.message();
  // As `retrace run` prints it (failure_details): the reasons, then every check, two spaces in.
  EXPECT_NE(std::string(bad.message()).find("\n  - params_finite: expected true, got false\n"), std::string::npos)
      << bad.message();
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace retrace
