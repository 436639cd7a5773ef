// The reporters of `retrace run` (reporter.h): each renders the results it is handed, the same
// data in every format; a result's verdict and reasons are computed by the runner, never here.
#include <retrace/report.h>
#include <retrace/reporter.h>
#include <retrace/runner.h>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sstream>
#include <string>

namespace retrace {
namespace {

ScenarioResult passed_result() {
  ScenarioResult r;
  r.name = "grad-nan-skip";
  r.fault = "grad_nonfinite:nan";
  r.defense = "skip_nonfinite";
  r.passed = true;
  r.seconds = 1.25;
  r.checks.push_back({CheckKind::kParamsFinite, "true", "true", true});
  r.notes = {{3, StepNoteKind::kInjected, "grad_nonfinite grad.w: element 4 = nan"},
             {3, StepNoteKind::kSkipped, "non-finite gradients"}};
  return r;
}

ScenarioResult failed_result() {
  ScenarioResult r;
  r.name = "lr-spike";
  r.fault = "lr_spike";
  r.defense = "none";
  r.broke = true;
  r.passed = false;
  r.seconds = 2.0;
  r.checks.push_back({CheckKind::kParamsFinite, "true", "false", false});
  r.checks.push_back({CheckKind::kMaxSkippedSteps, "<= 1", "0", true});
  r.reasons = {"params_finite: expected true, got false", "raised at step 4: boom"};
  r.replay_report = "step 2 differs";
  return r;
}

SuiteRun suite(bool bench = false) {
  SuiteRun run;
  run.results = {passed_result(), failed_result()};
  run.seconds = 3.0;
  run.bench = bench;
  return run;
}

TEST(Reporter, ConsoleSaysEachScenarioAndWhyOneFailed) {
  std::ostringstream out;
  ConsoleReporter console(out);
  console.scenario_done(passed_result());
  EXPECT_EQ(out.str(), "ok     grad-nan-skip  (grad_nonfinite:nan x skip_nonfinite: held, expected held, 1.2 s)\n");
  out.str("");
  console.scenario_done(failed_result());
  EXPECT_EQ(out.str(), "FAILED lr-spike  (lr_spike x none: broke, expected held, 2.0 s)\n"
                       "         - params_finite: expected true, got false\n"
                       "         - raised at step 4: boom\n"
                       "         ! params_finite: expected true, observed false\n"
                       "           max_skipped_steps: expected <= 1, observed 0\n"
                       "         replay: step 2 differs\n");
}

TEST(Reporter, FailureDetailsAreEmptyForAPass) {
  EXPECT_EQ(failure_details(passed_result(), "  "), "");
  // Control: the same result failed has its reasons and checks.
  ScenarioResult r = passed_result();
  r.passed = false;
  r.reasons = {"negative control held: the fault did not bite"};
  EXPECT_EQ(failure_details(r, "  "),
            "  - negative control held: the fault did not bite\n    params_finite: expected true, observed true\n");
}

TEST(Reporter, ConsoleEndsWithTheMatrixAndTheSummary) {
  std::ostringstream out;
  ConsoleReporter(out).suite_done(suite());
  const std::string text = out.str();
  EXPECT_EQ(text, "\n" + outcome_matrix(suite().results) + "\n2 scenarios, 1 as expected, 1 not, in 3.0 s\n");
  EXPECT_EQ(text.find("stability"), std::string::npos);
  // With --bench, the stability table comes between the matrix and the summary.
  std::ostringstream bench;
  ConsoleReporter(bench).suite_done(suite(/*bench=*/true));
  const auto table = bench.str().find("stability (recovery:");
  ASSERT_NE(table, std::string::npos) << bench.str();
  EXPECT_LT(bench.str().find("verdict"), table);
  EXPECT_LT(table, bench.str().find("2 scenarios, 1 as expected"));
  EXPECT_NE(bench.str().find(stability_table(suite().results)), std::string::npos);
}

TEST(Reporter, JsonHoldsEveryResultAsItsOwnJson) {
  std::ostringstream out;
  JsonReporter(out).suite_done(suite());
  const nlohmann::json j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j.at("failed"), 1);
  EXPECT_EQ(j.at("seconds"), 3.0);
  ASSERT_EQ(j.at("scenarios").size(), 2u);
  EXPECT_EQ(j.at("scenarios").at(1), failed_result().to_json());
  EXPECT_EQ(ScenarioResult::from_json(j.at("scenarios").at(0)).notes, passed_result().notes);
  EXPECT_EQ(out.str(), j.dump(2) + "\n");  // indented by 2, one trailing newline
}

TEST(Reporter, JunitAndHtmlRenderTheSameResults) {
  std::ostringstream junit, html;
  JunitReporter(junit).suite_done(suite());
  HtmlReporter(html).suite_done(suite());
  EXPECT_EQ(junit.str(), junit_xml(suite().results, 3.0));
  EXPECT_EQ(html.str(), html_run_report(suite().results, 3.0));
  // The failure's message is its reasons, joined.
  EXPECT_NE(junit.str().find("<failure message=\"params_finite: expected true, got false; raised at step 4: boom\">"),
            std::string::npos)
      << junit.str();
  EXPECT_EQ(junit.str().find("<failure"), junit.str().rfind("<failure"));  // one failure: the passed one has none
  EXPECT_NE(html.str().find("FAILED (params_finite: expected true, got false) (raised at step 4: boom)"),
            std::string::npos);
}

}  // namespace
}  // namespace retrace
