// The console reporter of `retrace run`: a line per finished scenario (and why it failed), then
// the outcome matrix, the stability table and the summary line.
#include <retrace/reporter.h>

#include <retrace/number.h>

#include <algorithm>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <tuple>

namespace retrace {

std::size_t SuiteRun::failed() const {
  return static_cast<std::size_t>(
      std::count_if(results.begin(), results.end(), [](const ScenarioResult& r) { return !r.passed; }));
}

namespace {
// Widths of the scenario, fault and defense columns the tables share.
std::tuple<std::size_t, std::size_t, std::size_t> column_widths(const std::vector<ScenarioResult>& results) {
  std::size_t wn = 8, wf = 5, wd = 7;
  for (const ScenarioResult& r : results) {
    wn = std::max(wn, r.name.size());
    wf = std::max(wf, r.fault.size());
    wd = std::max(wd, r.defense.size());
  }
  return {wn, wf, wd};
}

// The outcome column: as wide as "outcome" or the widest outcome shown.
int outcome_width(const std::vector<ScenarioResult>& results) {
  std::size_t w = 7;
  for (const ScenarioResult& r : results) w = std::max(w, r.outcome().size());
  return static_cast<int>(w);
}
}  // namespace

std::string failure_details(const ScenarioResult& r, const std::string& indent) {
  if (r.passed) return "";
  std::string out;
  for (const std::string& why : r.reasons) out += indent + "- " + why + "\n";
  for (const ExpectationCheck& c : r.checks) {
    out +=
        indent + (c.passed ? "  " : "! ") + c.name() + ": expected " + c.expected + ", observed " + c.observed + "\n";
  }
  if (!r.replay_report.empty()) out += indent + "replay: " + r.replay_report + "\n";
  return out;
}

std::string outcome_matrix(const std::vector<ScenarioResult>& results) {
  std::size_t wn = 0, wf = 0, wd = 0;  // (not a structured binding: the lambdas below capture them)
  std::tie(wn, wf, wd) = column_widths(results);
  const int wo = outcome_width(results);
  std::ostringstream os;
  auto row = [&](const std::string& n, const std::string& f, const std::string& d, const std::string& o,
                 const std::string& e, const std::string& v) {
    os << std::left << std::setw(static_cast<int>(wn)) << n << "  " << std::setw(static_cast<int>(wf)) << f << "  "
       << std::setw(static_cast<int>(wd)) << d << "  " << std::setw(wo) << o << "  " << std::setw(8) << e << "  " << v
       << "\n";
  };
  row("scenario", "fault", "defense", "outcome", "expected", "verdict");
  for (const ScenarioResult& r : results) {
    row(r.name, r.fault, r.defense, r.outcome(), r.expected_to_break ? "broke" : "held", r.verdict());
  }
  return os.str();
}


std::string stability_table(const std::vector<ScenarioResult>& results) {
  std::size_t wn = 0, wf = 0, wd = 0;  // (not a structured binding: the lambdas below capture them)
  std::tie(wn, wf, wd) = column_widths(results);
  const int wo = outcome_width(results);
  std::ostringstream os;
  os << std::left << std::setw(static_cast<int>(wn)) << "scenario"
     << "  " << std::setw(static_cast<int>(wf)) << "fault"
     << "  " << std::setw(static_cast<int>(wd)) << "defense"
     << "  " << std::setw(wo) << "outcome" << std::right << std::setw(8) << "skipped" << std::setw(10) << "recovery"
     << std::setw(14) << "loss delta" << std::setw(10) << "overhead"
     << "\n";
  for (const ScenarioResult& r : results) {
    os << std::left << std::setw(static_cast<int>(wn)) << r.name << "  " << std::setw(static_cast<int>(wf)) << r.fault
       << "  " << std::setw(static_cast<int>(wd)) << r.defense << "  " << std::setw(wo) << r.outcome() << std::right
       << std::setw(8) << r.skipped_steps;
    if (!r.bench.measured) {
      os << "  (not measured)\n";
      continue;
    }
    const std::string recovery = !r.bench.injected              ? "-"
                                 : r.bench.steps_to_recover < 0 ? "never"
                                                                : std::to_string(r.bench.steps_to_recover) + " st";
    const std::string delta = r.bench.injected ? number_text(r.bench.final_loss_delta) : "-";
    os << std::setw(10) << recovery << std::setw(14) << delta << std::setw(9) << std::fixed << std::setprecision(2)
       << r.bench.overhead << "x" << std::defaultfloat << "\n";
  }
  return os.str();
}


void ConsoleReporter::scenario_done(const ScenarioResult& r) {
  out_ << (r.passed ? "ok     " : "FAILED ") << r.name << "  (" << r.fault << " x " << r.defense << ": " << r.outcome()
       << ", expected " << (r.expected_to_break ? "broke" : "held") << ", " << std::fixed << std::setprecision(1)
       << r.seconds << " s)" << std::defaultfloat << "\n"
       << failure_details(r, "         ");
  out_.flush();
}

void ConsoleReporter::suite_done(const SuiteRun& run) {
  const std::size_t failed = run.failed();
  out_ << "\n" << outcome_matrix(run.results) << "\n";
  if (run.bench) {
    out_ << "stability (recovery: steps from the first disturbed step -- skipped, non-finite, or a loss >10% off the\n"
            "fault-free run's -- to the first undisturbed one;\n"
            "loss delta: final loss minus the fault-free run's; overhead: time per step with the defenses / without):\n"
         << stability_table(run.results) << "\n";
  }
  out_ << run.results.size() << " scenarios, " << run.results.size() - failed << " as expected, " << failed
       << " not, in " << std::fixed << std::setprecision(1) << run.seconds << " s\n"
       << std::defaultfloat;
  out_.flush();
}

}  // namespace retrace
