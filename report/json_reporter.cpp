// The JSON reporter of `retrace run --json`.
#include <retrace/reporter.h>

#include <ostream>

namespace retrace {

nlohmann::json JsonReporter::to_json(const SuiteRun& run) {
  nlohmann::json scenarios = nlohmann::json::array();
  for (const ScenarioResult& r : run.results) scenarios.push_back(r.to_json());
  return {{"scenarios", scenarios}, {"failed", run.failed()}, {"seconds", run.seconds}};
}

void JsonReporter::suite_done(const SuiteRun& run) { out_ << to_json(run).dump(2) << "\n"; }

}  // namespace retrace
