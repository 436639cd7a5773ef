#pragma once
// Registering a scenario file as a GoogleTest test (link retrace::report). The test runs the
// scenario in-process and fails with every unmet expectation in its message:
//
//   RETRACE_SCENARIO_TEST(MyDefenses, Fp16Overflow, "scenarios/fp16-overflow.yaml");
//   RETRACE_SCENARIO_TEST(Builtin, GradNanSkip, "builtin:grad-nan-skip");
//
// `retrace run` runs scenarios in child processes (a crash is isolated); this runs them in the
// test's own process, which is what a unit test of your own defenses wants.

#include <retrace/reporter.h>
#include <retrace/runner.h>

#include <gtest/gtest.h>

#include <string>

namespace retrace::testing {

inline ::testing::AssertionResult ScenarioPasses(const char* expr, const std::string& source) {
  const ScenarioResult r = run_scenario(load_scenario(source));
  if (r.passed) return ::testing::AssertionSuccess();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  failure << "scenario " << expr << " (" << r.fault << " x " << r.defense << "): " << r.outcome() << ", expected "
          << (r.expected_to_break ? "broke" : "held");
  std::string details = failure_details(r, "  ");  // as `retrace run` prints it
  if (!details.empty()) details.pop_back();        // its last newline
  failure << "\n" << details;
  return failure;
}

}  // namespace retrace::testing

#define RETRACE_SCENARIO_TEST(suite, name, source) \
  TEST(suite, name) { EXPECT_PRED_FORMAT1(::retrace::testing::ScenarioPasses, source); }
