// `retrace diagnose TRACE|SCENARIO`: re-runs a failing run's steps under each stability variant
// from the last good state and ranks the variants that avoid the failure; classifies the failing
// step as persistent, transient or nondeterministic.
#include "commands.h"

#include <retrace/diagnose.h>
#include <retrace/error.h>
#include <retrace/runner.h>

#include <boost/program_options.hpp>

#include <iostream>

namespace retrace::cli {

namespace po = boost::program_options;

int run_diagnose(const std::vector<std::string>& args) {
  std::string source, json_path;
  DiagnoseOptions options;
  po::options_description opts(
      "retrace diagnose TRACE|SCENARIO [options]\n\n"
      "From the state before the first failing step, re-runs the following steps under each\n"
      "variant -- checkpointing off, clip 1.0 and 0.5, LR / 10 with warmup, fp32, loss scaling,\n"
      "skipping non-finite steps, more and fewer segments, half batch -- and ranks the variants\n"
      "that avoid the failure by their cost. Classifies the failing step as persistent,\n"
      "transient or nondeterministic by re-executing it from its state. A run with no failing\n"
      "step that misses an expectation (a final loss too high) is diagnosed from step 1.\n"
      "SCENARIO is a .yaml file or builtin:NAME; TRACE a trace recorded from a scenario.\n"
      "Exit code 0 a variant avoids the failure (or nothing failed), 1 none does, 2 bad input.\n\n"
      "options");
  opts.add_options()("help,h", "show this help")("steps", po::value<std::int64_t>(&options.steps),
                                                 "steps re-run per variant (default: to the end of the run)")(
      "lookback", po::value<std::int64_t>(&options.lookback),
      "start this many steps before the failing step (default 1)")(
      "threads", po::value<int>(&options.threads),
      "LibTorch intra-op threads while variants run (default 1: timings comparable)")(
      "repeats", po::value<int>(&options.repeats),
      "timed runs per variant, after a warm-up; its cost is their median (default 5)")(
      "json", po::value<std::string>(&json_path), "write the diagnosis as JSON to FILE ('-' for stdout)");
  const auto parsed = parse_arguments(args, opts, "source", &source);
  if (!parsed) return 0;
  if (source.empty()) throw Error("missing TRACE or SCENARIO: what to diagnose");
  if (parsed->count("steps") && options.steps < 1) {
    throw Error("--steps must be at least 1, got " + std::to_string(options.steps) +
                " (leave it out to re-run to the end of the run)");
  }
  if (options.lookback < 0) throw Error("--lookback must be 0 or more, got " + std::to_string(options.lookback));
  check_threads_flag(options.threads);
  if (options.repeats < 1) throw Error("--repeats must be at least 1, got " + std::to_string(options.repeats));
  const bool scenario = source.rfind("builtin:", 0) == 0 ||
                        (source.size() > 5 && (source.compare(source.size() - 5, 5, ".yaml") == 0 ||
                                               source.compare(source.size() - 4, 4, ".yml") == 0));
  const Diagnosis d = scenario ? diagnose_scenario(load_scenario(source), options) : diagnose_trace(source, options);
  std::ostream& out = json_path == "-" ? std::cerr : std::cout;
  out << d.report();
  if (!json_path.empty()) write_output(json_path, d.to_json().dump(2) + "\n", "--json file");
  if (d.variants.empty()) return 0;  // nothing failed
  for (const VariantResult& v : d.variants) {
    if (v.fixes) return 0;
  }
  return 1;
}

}  // namespace retrace::cli
