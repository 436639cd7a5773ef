// `retrace replay TRACE`: re-executes recorded steps and compares them bit for bit.
#include "commands.h"

#include <retrace/rank_attribution.h>
#include <retrace/records.h>
#include <retrace/replayer.h>
#include <retrace/report.h>

#include <ATen/Parallel.h>

#include <boost/program_options.hpp>

#include <algorithm>
#include <iostream>

namespace retrace::cli {

namespace po = boost::program_options;

namespace {

// Runs the replay under the trace's intra-op thread count unless told otherwise (`threads` > 0):
// the count is part of what bitwise replay needs (the library refuses another one unless forced).
void set_threads(const TraceReader& trace, int threads) {
  if (threads > 0) {
    at::set_num_threads(threads);
    return;
  }
  const Environment recorded = TraceHeader::decode(trace).environment;
  const auto it = recorded.bitwise.find("intra_op_threads");
  if (it == recorded.bitwise.end()) return;
  try {
    const int n = std::stoi(it->second);
    if (n >= 1 && n <= 4096 && n != at::get_num_threads()) at::set_num_threads(n);
  } catch (const std::exception&) {
    // A garbled count: the environment check names it.
  }
}

void print_result(std::ostream& out, const ReplayResult& result, const std::string& who) {
  for (const std::string& note : result.notes) out << "note: " << note << "\n";
  for (const auto& d : result.environment)
    out << "warning: forced despite " << d.field << " " << d.recorded << " -> " << d.current << "\n";
  out << who << "replayed steps " << result.from_step << ".." << result.to_step;
  if (result.to_step < result.target_step) out << " of " << result.from_step << ".." << result.target_step;
  out << ": "
      << (result.reproduced          ? "reproduced bitwise"
          : result.not_shown.empty() ? "DIVERGED"
                                     : "NOT SHOWN (nothing recorded to compare: " + result.not_shown + ")")
      << "\n";
  if (!result.ended_early.empty()) {
    out << "the replay ended before step " << result.target_step << ": " << result.ended_early << "; ";
    if (result.to_step + 1 == result.target_step) out << "step " << result.target_step << " was not replayed\n";
    else out << "steps " << result.to_step + 1 << ".." << result.target_step << " were not replayed\n";
  }
  if (result.first_divergence) out << "first divergence: " << result.first_divergence->message() << "\n";
  if (result.first_nonfinite) out << result.first_nonfinite->message() << "\n";
}

// `retrace replay RANK_TRACE...`: names the culprit rank and replays it alone to its first
// non-finite op (each rank the culprit names); with no culprit, replays every rank alone.
int replay_ranks(const std::vector<std::string>& paths, ReplayOptions options, int threads,
                 const std::string& json_path) {
  std::vector<TraceReader> traces;
  for (const std::string& p : paths) traces.emplace_back(p);
  std::vector<const TraceReader*> ptrs;
  for (const TraceReader& t : traces) ptrs.push_back(&t);
  const RankAttribution a = attribute_ranks(ptrs);
  std::ostream& out = json_path == "-" ? std::cerr : std::cout;
  for (const std::string& n : a.notes) out << "note: " << n << "\n";
  out << a.verdict() << "\n";
  std::vector<std::size_t> which;
  if (a.culprit) {
    // Every rank it names (two ranks apart with no majority: both; it had been the first alone).
    const std::vector<int>& named = a.culprit->ranks;
    for (std::size_t i = 0; i < traces.size(); ++i) {
      if (std::count(named.begin(), named.end(), TraceHeader::decode(traces[i]).ranks->rank) > 0) which.push_back(i);
    }
    if (which.empty()) {  // the culprit's trace was not given
      out << "not replayed: the culprit's trace is not given; give it to replay it\n";
      return 1;
    }
    // Up to the step it went bad in; a rank that stopped is replayed to its last complete step.
    if (!options.step && a.culprit->kind != CulpritRank::Kind::kStopped) options.step = a.culprit->step;
  } else {
    for (std::size_t i = 0; i < traces.size(); ++i) which.push_back(i);
  }
  nlohmann::json doc = {{"attribution", a.to_json()}, {"replays", nlohmann::json::array()}};
  bool all = true;
  for (std::size_t i : which) {
    set_threads(traces[i], threads);
    std::unique_ptr<Program> program = program_from_trace(traces[i], BuildFor::kReplay);
    const ReplayResult result = Replayer(traces[i], *program).run(options);
    print_result(out, result, "rank " + std::to_string(TraceHeader::decode(traces[i]).ranks->rank) + " alone: ");
    doc["replays"].push_back({{"trace", paths[i]}, {"result", result.to_json()}});
    all = all && result.reproduced;
  }
  if (!json_path.empty()) write_output(json_path, doc.dump(2) + "\n", "--json file");
  return all ? 0 : 1;
}

}  // namespace

int run_replay(const std::vector<std::string>& args) {
  std::string trace_path, json_path, report_path;
  std::vector<std::string> paths;
  std::int64_t step = -1, from = -1;
  int threads = 0;
  po::options_description opts(
      "retrace replay TRACE [options]\n"
      "retrace replay RANK_TRACE RANK_TRACE... [options]\n\n"
      "Restores the state before a recorded step and re-executes up to it, comparing every\n"
      "recorded digest or tensor in order. A step that raised is a verdict too: reproduced when the\n"
      "replay raises the same message at the same step. A rank of a data-parallel run replays alone,\n"
      "its collectives served from its trace. Given several rank traces of one run, names the rank\n"
      "that went bad first (retrace inspect) and replays it to its first non-finite op; with none,\n"
      "replays every rank. Exit code 0 reproduced bitwise, 1 diverged (or raised where the\n"
      "recorded run did not, or the other way round) or not shown (the trace holds no outcome of\n"
      "the steps replayed: the run died in the one step asked for), 2 bad input.\n\n"
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
      "no-provenance", "do not look for the first non-finite op")(
      "threads", po::value<int>(&threads),
      "LibTorch intra-op threads (default: the trace's recorded count, which bitwise replay needs)");
  const auto parsed = parse_arguments(args, opts, "trace", &paths);
  if (!parsed) return 0;
  const po::variables_map& vm = *parsed;
  if (paths.empty()) throw Error("missing TRACE: the trace to replay");
  std::vector<std::pair<std::string, std::string>> traces;
  for (const std::string& t : paths) traces.push_back({t, "the trace"});
  refuse_output_path(json_path, "--json", traces);
  refuse_output_path(report_path, "--report", traces);
  if (vm.count("threads")) check_threads_flag(threads);
  ReplayOptions options;
  if (vm.count("step")) options.step = step;
  if (vm.count("from")) options.from = from;
  options.force = vm.count("force") > 0;
  options.provenance = vm.count("no-provenance") == 0;
  if (paths.size() > 1) {
    if (!report_path.empty()) throw Error("--report is for one trace; replay the culprit rank's trace alone for it");
    return replay_ranks(paths, options, threads, json_path);
  }
  trace_path = paths.front();

  const TraceReader trace(trace_path);
  set_threads(trace, threads);
  std::unique_ptr<Program> program = program_from_trace(trace, BuildFor::kReplay);
  const ReplayResult result = Replayer(trace, *program).run(options);

  std::ostream& out = json_path == "-" ? std::cerr : std::cout;
  print_result(out, result, "");
  if (!report_path.empty()) {
    write_file(report_path, html_replay_report(trace_path, result, recorded_run(trace)), "--report file");
    out << "wrote the HTML report to " << report_path << "\n";
  }
  if (!json_path.empty()) write_output(json_path, result.to_json().dump(2) + "\n", "--json file");
  return result.reproduced ? 0 : 1;
}

}  // namespace retrace::cli
