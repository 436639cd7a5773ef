// `retrace replay TRACE`: re-executes recorded steps and compares them bit for bit.
#include "commands.h"

#include <retrace/replayer.h>
#include <retrace/report.h>

#include <boost/program_options.hpp>

#include <iostream>

namespace retrace::cli {

namespace po = boost::program_options;

int run_replay(const std::vector<std::string>& args) {
  std::string trace_path, json_path, report_path;
  std::int64_t step = -1, from = -1;
  po::options_description opts(
      "retrace replay TRACE [options]\n\n"
      "Restores the state before a recorded step and re-executes up to it, comparing every\n"
      "recorded digest or tensor in order. A step that raised is a verdict too: reproduced when the\n"
      "replay raises the same message at the same step. Exit code 0 reproduced bitwise, 1 diverged\n"
      "(or raised where the recorded run did not, or the other way round), 2 bad input.\n\n"
      "options");
  opts.add_options()("help,h", "show this help")("step", po::value<std::int64_t>(&step),
                                                 "last step to replay (default: the last recorded)")(
      "from", po::value<std::int64_t>(&from),
      "replay from the latest full snapshot at or before this step (default: nearest to --step)")(
      "json", po::value<std::string>(&json_path), "write the result as JSON to FILE ('-' for stdout)")(
      "report", po::value<std::string>(&report_path),
      "write an HTML report to FILE: the first divergence, the first non-finite op with its inputs' statistics, "
      "and the recorded loss, gradient-norm, loss-scale and LR curves (one self-contained file, no script)")(
      "force", "replay even where the environment differs in a way that breaks bitwise equality")(
      "no-provenance", "do not look for the first non-finite op");
  const auto parsed = parse_arguments(args, opts, "trace", &trace_path);
  if (!parsed) return 0;
  const po::variables_map& vm = *parsed;
  if (trace_path.empty()) throw Error("missing TRACE: the trace to replay");

  const TraceReader trace(trace_path);
  std::unique_ptr<Program> program = program_from_trace(trace);
  ReplayOptions options;
  if (vm.count("step")) options.step = step;
  if (vm.count("from")) options.from = from;
  options.force = vm.count("force") > 0;
  options.provenance = vm.count("no-provenance") == 0;
  const ReplayResult result = Replayer(trace, *program).run(options);

  std::ostream& out = json_path == "-" ? std::cerr : std::cout;
  for (const std::string& note : result.notes) out << "note: " << note << "\n";
  for (const auto& d : result.environment)
    out << "warning: forced despite " << d.field << " " << d.recorded << " -> " << d.current << "\n";
  out << "replayed steps " << result.from_step << ".." << result.to_step << ": "
      << (result.reproduced ? "reproduced bitwise" : "DIVERGED") << "\n";
  if (result.first_divergence) out << "first divergence: " << result.first_divergence->message() << "\n";
  if (result.first_nonfinite) out << result.first_nonfinite->message() << "\n";
  if (!report_path.empty()) {
    write_file(report_path, html_replay_report(trace_path, result, recorded_run(trace)), "--report file");
    out << "wrote the HTML report to " << report_path << "\n";
  }
  if (!json_path.empty()) write_output(json_path, result.to_json().dump(2) + "\n", "--json file");
  return result.reproduced ? 0 : 1;
}

}  // namespace retrace::cli
