#pragma once
// The HTML reports of `retrace run --report` and `retrace replay --report`: one self-contained
// file each -- inline CSS and SVG, no script, nothing fetched -- that opens in any browser.
//
// A run report holds the outcome matrix (the text matrix's columns, verdicts coloured) and, per
// scenario, its loss, gradient-norm, loss-scale and learning-rate curves over steps with injected
// faults, skipped steps and rollbacks marked. A replay report holds the replay's verdict, its
// first divergence and first non-finite op with their statistics, and the recorded per-step
// curves with the replayed range, the divergence and the non-finite step marked.
//
// Every text that reaches the page (scenario names, messages, tensor names -- they come from
// users' files and traces) is escaped. Values off a chart's scale (NaN, +-Inf; zero or negative
// on a log axis) are drawn as labelled markers at the chart's edge, never as coordinates.
// Cost: linear in the number of steps; the charts of 44 scenarios are about 1 MB of HTML.

#include <retrace/replayer.h>
#include <retrace/runner.h>
#include <retrace/trace.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace retrace {

// The page for `retrace run --report`: summary line, outcome matrix, then each scenario's charts
// (four per scenario, also for one that ran no step) with its injections, skip reasons, error
// and failed checks. `seconds` is the whole run's wall time.
std::string html_run_report(const std::vector<ScenarioResult>& results, double seconds);

// What a trace recorded step by step (its step_end records), for the replay report.
struct RecordedRun {
  std::string program;                        // the header's program name
  std::vector<StepPoint> steps;               // in step order, one per step_end record
  std::map<std::int64_t, std::string> notes;  // step -> its injections and skip reason
};
// Reads every step_end record of `trace` (their stored tensors are loaded too and dropped).
// Untrusted input: a value of the wrong type reads as NaN, a record that fails its checksum is
// left out; nothing here throws for a trace that opened.
RecordedRun recorded_run(const TraceReader& trace);

// The page for `retrace replay --report`. `trace_name` is shown as given.
std::string html_replay_report(const std::string& trace_name, const ReplayResult& result, const RecordedRun& recorded);

}  // namespace retrace
