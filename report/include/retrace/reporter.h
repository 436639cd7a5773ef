#pragma once
// The outputs of a suite run (`retrace run`), as google/benchmark's reporters: the runner computes
// each ScenarioResult once -- outcome, checks, breakage, reasons, step notes -- and every format
// only renders it. The console (per-scenario lines, the outcome matrix, the stability table, the
// summary), JSON, JUnit XML and the HTML report are each a Reporter; `retrace run` hands every
// finished result to each of the reporters it was asked for, then the whole run.
//
// A reporter writes to the stream it was given and nothing else: it opens no file, reads no
// clock and decides nothing about a verdict. Texts from scenario files and messages are escaped
// by the formats that need it (XML, HTML); the console and JSON write them as they are.

#include <retrace/runner.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <iosfwd>
#include <string>
#include <vector>

namespace retrace {

// A whole suite run, as its reporters see it at the end.
struct SuiteRun {
  std::vector<ScenarioResult> results;  // in the order the scenarios were given
  double seconds = 0;                   // the whole run's wall time
  bool bench = false;                   // --bench: the results carry stability figures
  std::size_t failed() const;           // results that did not pass
};

class Reporter {
 public:
  virtual ~Reporter() = default;
  // One scenario finished; results arrive in the order they finish (not the suite's order).
  virtual void scenario_done(const ScenarioResult& result) {}
  // Every scenario finished.
  virtual void suite_done(const SuiteRun& run) = 0;
};

// The console: per finished scenario one line (`ok     NAME  (FAULT x DEFENSE: OUTCOME, expected
// E, 1.2 s)`, `FAILED ` for one that did not pass, then its failure_details); at the end the
// outcome matrix, the stability table with --bench, and the summary line.
class ConsoleReporter : public Reporter {
 public:
  explicit ConsoleReporter(std::ostream& out) : out_(out) {}
  void scenario_done(const ScenarioResult& result) override;
  void suite_done(const SuiteRun& run) override;

 private:
  std::ostream& out_;
};

// `{"failed": N, "scenarios": [ScenarioResult::to_json...], "seconds": S}`, indented by 2.
class JsonReporter : public Reporter {
 public:
  explicit JsonReporter(std::ostream& out) : out_(out) {}
  void suite_done(const SuiteRun& run) override;
  static nlohmann::json to_json(const SuiteRun& run);

 private:
  std::ostream& out_;
};

// JUnit XML: junit_xml(run.results, run.seconds).
class JunitReporter : public Reporter {
 public:
  explicit JunitReporter(std::ostream& out) : out_(out) {}
  void suite_done(const SuiteRun& run) override;

 private:
  std::ostream& out_;
};

// The HTML page of report.h: html_run_report(run.results, run.seconds).
class HtmlReporter : public Reporter {
 public:
  explicit HtmlReporter(std::ostream& out) : out_(out) {}
  void suite_done(const SuiteRun& run) override;

 private:
  std::ostream& out_;
};

// --- The renderings on their own (RETRACE_SCENARIO_TEST prints failure_details) ----------

// Why a result did not pass, as lines each starting with `indent`: its reasons (`- WHY`), every
// check (`! ` marks one that failed; for a control, a failed evidence check is its fault biting,
// and the reasons say whether that counted), and the replay's report when there is one. Empty
// for a result that passed.
std::string failure_details(const ScenarioResult& result, const std::string& indent);
// The outcome matrix: one row per result (fault, defense, outcome, expected, verdict), as text.
std::string outcome_matrix(const std::vector<ScenarioResult>& results);
// The stability table: one row per scenario with skipped steps, steps to recover, final-loss
// delta and overhead.
std::string stability_table(const std::vector<ScenarioResult>& results);
// JUnit XML (one testsuite, a testcase per scenario, failures with their checks).
std::string junit_xml(const std::vector<ScenarioResult>& results, double seconds);

}  // namespace retrace
