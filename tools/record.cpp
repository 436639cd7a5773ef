// `retrace record SCENARIO.yaml -o TRACE`: trains as the scenario says, recording a trace.
#include "commands.h"
#include "rank_launcher.h"

#include <retrace/runner.h>

#include <retrace/determinism.h>
#include <retrace/number.h>
#include <retrace/recorder.h>
#include <retrace/scenario.h>
#include <retrace/trainer.h>

#include <ATen/Parallel.h>
#include <boost/program_options.hpp>

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>

namespace retrace::cli {

namespace po = boost::program_options;


// The program to record: the scenario's (a file, or builtin:NAME as `run` and `diagnose` take),
// or the binary's own program with the text of its --config file.
std::unique_ptr<Program> program_to_record(const std::string& scenario, const std::string& config_path) {
  if (!scenario.empty() && !config_path.empty()) {
    throw Error("--config is for the binary's own program without a scenario; a scenario carries its program's "
                "config (its 'config:' section)");
  }
  if (!scenario.empty()) return make_scenario_program(load_scenario(scenario));
  if (!default_program().empty()) {
    const std::string config = config_path.empty() ? "" : read_text_file(config_path, "--config file");
    try {
      return make_program(default_program(), config);
    } catch (const Error& e) {  // say which file
      throw Error((config_path.empty() ? std::string("no --config given") : "--config " + config_path) + ": " +
                  e.what());
    }
  }
  if (!config_path.empty()) {
    throw Error(
        "--config needs a binary with its own program (retrace::main with a factory); this one records scenarios");
  }
  throw Error("missing SCENARIO.yaml: the scenario to record (see examples/scenarios/ for examples)");
}

// One line per step, then what was recorded. Returns whether the run stayed finite: every step
// finite or skipped by a defense (handled) with a finite step after it (the run recovered), and
// the parameters finite at the end.
bool print_summary(const std::vector<StepOutcome>& outcomes, bool params_finite, const RecorderStats& stats,
                   const std::string& output, const std::string& mode) {
  bool finite = true;
  std::size_t stuck_from = outcomes.size();  // the first of the skipped non-finite steps that end the run
  for (std::size_t i = outcomes.size(); i > 0 && !outcomes[i - 1].finite() && outcomes[i - 1].skipped; --i)
    stuck_from = i - 1;
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    const StepOutcome& o = outcomes[i];
    // A non-finite step that a defense skipped is handled, not a failure of the run.
    const bool handled = !o.finite() && o.skipped;
    std::cout << "step " << std::setw(4) << i + 1 << "  loss " << number_text(o.loss) << "  grad norm "
              << number_text(o.grad_norm)
              << (o.finite() ? ""
                  : handled  ? "  non-finite, skipped: " + o.skip_reason
                             : "  NON-FINITE")
              << "\n";
    for (const std::string& inj : o.injected) std::cout << "           injected: " << inj << "\n";
    finite = finite && (o.finite() || handled);
  }
  std::cout << "recorded " << outcomes.size() << " steps to " << output << " (" << mode << " mode, " << stats.records
            << " records, " << stats.bytes / 1024 << " KiB";
  if (stats.ring_dumps) std::cout << ", flight ring dumped";
  if (stats.ring_snapshots_lost) {
    std::cout << ", " << stats.ring_snapshots_lost
              << " ring snapshot(s) lost: the state changed in place while the ring copied it (docs/replay.md)";
  }
  if (stats.backpressure_waits) std::cout << ", writer backpressure " << stats.backpressure_waits << "x";
  if (stats.state_check.status == StateCheckResult::Status::kPassed) {
    std::cout << ", state() round-trip checked at step " << stats.state_check.step;
  }
  std::cout << ")\n";
  if (!stats.write_error.empty()) {
    std::cerr << binary_name() << " record: recording stopped (" << stats.write_error
              << "); training went on; what was written "
              << "before is " << output << ".incomplete\n";
  }
  if (finite && stuck_from < outcomes.size()) {
    finite = false;
    std::cout << "the run did not recover: every step from step " << stuck_from + 1
              << " on was non-finite and skipped, so nothing trained after it\n";
  }
  if (!params_finite) {
    finite = false;
    std::cout << "the parameters are non-finite at the end of the run\n";
  }
  if (!finite)
    std::cout << "the run went non-finite; replay it with: " << binary_name() << " replay " << output << "\n";
  return finite;
}

// The scenario's injection entries that never fired (`fired[i]` is 0): the trace holds a run
// without them. Returns whether all fired.
bool report_unfired(const std::vector<char>& fired, const Defenses* defenses, std::int64_t n) {
  bool all_fired = true;
  for (std::size_t i = 0; i < fired.size(); ++i) {
    const InjectionSpec& in = defenses->injector().specs()[i];
    // Another rank's: that rank's trace holds it (red-team finding: every rank: injection was
    // reported as never fired by the others, and record exited 1).
    if (fired[i] || (in.rank >= 0 && in.rank != defenses->injector().rank())) continue;
    all_fired = false;
    std::cerr << binary_name() << " record: injections[" << i << "] (" << to_string(in.type) << ", step " << in.step
              << ") never fired" << (in.step > n ? "; the run stopped at step " + std::to_string(n) + " (--steps)" : "")
              << ": the trace holds a run without it\n";
  }
  return all_fired;
}

int run_record(const std::vector<std::string>& args) {
  std::string scenario, output, mode = "digest", compression = "fast", on_write_error = "stop", config_path,
                                ring_copy = "auto";
  int every = 0, ring = 0, ring_every = 1, ranks = 0, threads = 0, encode_threads = 0;
  std::int64_t steps = 0, page_cache_mib = static_cast<std::int64_t>(WriterOptions{}.page_cache_window >> 20);
  po::options_description opts(
      "retrace record [SCENARIO.yaml | builtin:NAME] -o TRACE [options]\n\n"
      "Trains as SCENARIO.yaml says and records a trace; in a binary built on retrace::main with\n"
      "its own program and no SCENARIO, records that program (its config from --config FILE).\n"
      "Exit code 0 when every step stayed\n"
      "finite, 1 when the run went non-finite (a step not skipped, skipped steps that end the run,\n"
      "or non-finite parameters at the end; the trace then holds the flight ring), one of the\n"
      "scenario's injections never fired (e.g. --steps stopped before it) or the state self-check\n"
      "found the program's state() incomplete, 2 for bad input.\n\n"
      "options");
  opts.add_options()("help,h", "show this help")("output,o", po::value<std::string>(&output),
                                                 "trace to write (TRACE.incomplete while recording)")(
      "mode", po::value<std::string>(&mode)->default_value("digest"), "digest (hashes only) or full (tensors)")(
      "every", po::value<int>(&every)->default_value(0), "digest mode: also a full snapshot every K steps")(
      "ring", po::value<int>(&ring)->default_value(0),
      "flight ring: keep the last K full snapshots, dump them on NaN/Inf, exception or SIGTERM/SIGINT")(
      "ring-every", po::value<int>(&ring_every)->default_value(1),
      "the ring's snapshots S steps apart (a step costs 1/S of a copy; K snapshots span K x S steps, and replay "
      "re-executes up to S - 1 steps more from the newest one before the step asked for)")(
      "ring-copy", po::value<std::string>(&ring_copy)->default_value("auto"),
      "where the ring copies each step's state: overlapped (a thread of its own, while forward and backward run; "
      "checked by the tensors' version counters), at-begin-step, or auto (overlapped when a core is free); use "
      "at-begin-step for a program that writes its state's memory outside ATen during a step")(
      "write-ahead", "write each step's full snapshot to disk (fsync) before the step runs")(
      "on-write-error", po::value<std::string>(&on_write_error)->default_value("stop"),
      "when a trace write fails (disk full, I/O error): stop training, or continue training without recording")(
      "compression", po::value<std::string>(&compression)->default_value("fast"),
      "stored tensors: fast (Blosc bit-shuffle + LZ4) or small (byte shuffle + zstd, ~10% smaller, ~4x slower)")(
      "encode-threads", po::value<int>(&encode_threads)->default_value(0),
      "threads compressing a record's stored tensors (full mode, snapshots, ring dumps): 0 = a quarter of the cores "
      "(1 to 8), or 1 to 64; the trace is the same whatever the count")(
      "page-cache-mib", po::value<std::int64_t>(&page_cache_mib)->default_value(page_cache_mib),
      "the trace's newest N MiB left in the page cache; older ones are written back and dropped from it as the "
      "trace grows (0: off, the kernel decides)")("steps", po::value<std::int64_t>(&steps),
                                                  "steps to run (overrides the scenario's training.steps)")(
      "config", po::value<std::string>(&config_path),
      "without SCENARIO: the config FILE handed to the binary's own program")(
      "keep-going", "continue after a non-finite step instead of stopping")(
      "no-state-check",
      "skip the state round-trip self-check (step 2 re-run on a copy of the program restored from its "
      "state(), which must end it bitwise equal; a failure exits 1)")(
      "deterministic",
      "deterministic algorithms on, cuDNN benchmark off, cuBLAS workspace configured (replay then does the same)")(
      "threads", po::value<int>(&threads),
      "LibTorch intra-op threads (default: LibTorch's, one per core; each rank's with --ranks: cores / ranks); the "
      "trace records the count and replay runs under it")(
      "ranks", po::value<int>(&ranks),
      "data parallel: run N ranks as processes of this binary (default: the scenario's world_size), each writing "
      "its own trace, TRACE with .rankR before its extension (run.trace -> run.rank0.trace, run.rank1.trace)");
  const auto parsed = parse_arguments(args, opts, "scenario", &scenario);
  if (!parsed) return 0;
  const po::variables_map& vm = *parsed;
  if (output.empty()) throw Error("missing -o TRACE: where to write the trace");
  refuse_output_path(output, "-o", {{scenario, "the scenario file"}, {config_path, "the --config file"}});
  if (vm.count("steps") && steps < 1) throw Error("--steps must be at least 1, got " + std::to_string(steps));
  if (every < 0 || ring < 0) throw Error("--every and --ring must not be negative");
  if (every > 0 && parse_record_mode(mode) == RecordMode::kFull) {
    throw Error("--every " + std::to_string(every) +
                " is for digest mode: --mode full stores every step's full state already; drop one of them");
  }
  if (ring_every < 1)
    throw Error("--ring-every must be at least 1 (a snapshot every step), got " + std::to_string(ring_every));
  if (on_write_error != "stop" && on_write_error != "continue") {
    throw Error("--on-write-error must be stop or continue, got '" + on_write_error + "'");
  }
  if (compression != "fast" && compression != "small") {
    throw Error("--compression must be fast or small, got '" + compression + "'");
  }
  const RingCopy ring_copy_how = parse_ring_copy(ring_copy);  // before any rank or file is made
  if (encode_threads < 0 || encode_threads > 64) {
    throw Error("--encode-threads must be 0 (automatic) to 64, got " + std::to_string(encode_threads));
  }
  if (page_cache_mib < 0 || page_cache_mib > (std::int64_t{1} << 30)) {
    throw Error("--page-cache-mib must be 0 (off) to 2^30, got " + std::to_string(page_cache_mib));
  }
  if (vm.count("threads")) check_threads_flag(threads);
  if (vm.count("ranks") && (ranks < 1 || ranks > kMaxScenarioRanks)) {
    throw Error("--ranks must be 1 to " + std::to_string(kMaxScenarioRanks) + ", got " + std::to_string(ranks));
  }
  if (!launched_as_rank()) {
    int world = vm.count("ranks") ? ranks : 1;
    if (!scenario.empty()) {
      const int asked = load_scenario(scenario).world_size;
      if (vm.count("ranks") && ranks != asked) {
        throw Error("--ranks " + std::to_string(ranks) + " but the scenario's world_size is " + std::to_string(asked) +
                    "; drop --ranks, or change world_size in the scenario");
      }
      world = asked;
    }
    if (world > 1) {
      std::vector<std::string> rank_args = {"record"};
      for (const std::string& a : without_ranks_flag(args)) rank_args.push_back(a);
      return launch_ranks(world, rank_args);
    }
  }
  const auto parent = std::filesystem::path(output).parent_path();
  if (!parent.empty() && !std::filesystem::is_directory(parent)) {
    throw Error("the output folder '" + parent.string() + "' does not exist; create it first");
  }

  if (vm.count("threads")) at::set_num_threads(threads);
  std::optional<DeterministicGuard> deterministic;
  if (vm.count("deterministic")) deterministic.emplace();
  std::unique_ptr<Program> program = program_to_record(scenario, config_path);
  if (const RankInfo r = program->ranks(); r.distributed()) output = rank_trace_path(output, r.rank);
  RecorderOptions options;
  options.mode = parse_record_mode(mode);
  options.every = every;
  options.ring = ring;
  options.ring_every = ring_every;
  options.ring_copy = ring_copy_how;
  options.write_ahead = vm.count("write-ahead") > 0;
  options.writer.compression = compression == "fast" ? Compression::kFast : Compression::kSmall;
  options.writer.encode_threads = encode_threads;
  options.writer.page_cache_window = static_cast<std::uint64_t>(page_cache_mib) << 20;
  options.on_write_error = on_write_error == "continue" ? OnWriteError::kContinue : OnWriteError::kStop;
  options.state_check = vm.count("no-state-check") == 0;
  const std::int64_t n = vm.count("steps") ? steps : program->default_steps();

  Recorder recorder(output, *program, options);
  // Which of the scenario's injection entries fired: one that never did recorded a run without
  // the fault the scenario describes (e.g. --steps stopped before its step).
  const Defenses* defenses = program->defenses();
  std::vector<char> fired(defenses ? defenses->injector().specs().size() : 0, 0);
  std::vector<StepOutcome> outcomes;
  try {
    outcomes = record_run(*program, recorder, n, vm.count("keep-going") == 0, [&](std::int64_t, const StepOutcome&) {
      if (defenses) {
        for (const InjectionEvent& e : defenses->injector().fired()) fired.at(e.entry) = 1;
      }
    });
  } catch (const DefenseRefusal& e) {
    // A defense refusing to go on (clip.error_if_nonfinite) is the run's outcome, not bad input:
    // the trace holds the steps up to it and the raise, which a replay raises again.
    recorder.close();
    std::cerr << binary_name() << " record: a defense stopped the run: " << e.what() << "\n";
    std::cerr << binary_name() << " record: " << output
              << " holds the steps up to it and the raise; 'retrace replay' raises it again\n";
    return 1;
  } catch (const StateCheckError& e) {
    // A check that failed, not bad input: record_run closed the trace after the checked step.
    std::cerr << binary_name() << " record: " << e.what() << "\n";
    std::cerr << binary_name() << " record: stopped after step " << e.result().step << "; " << output
              << " holds the steps up to it, and replays from a snapshot of a later step would not reproduce\n";
    return 1;
  }
  recorder.close();
  const RecorderStats stats = recorder.stats();
  if (stats.batch_drew_rng_step > 0) {
    std::cerr << binary_name() << " record: warning: Program::batch() drew from the global generator ("
              << stats.batch_drew_rng << ") at step " << stats.batch_drew_rng_step
              << ": a batch must be deterministic in (config, step) -- draw it from a generator of its own seeded "
                 "from the step; a replay re-executes the recorded batches, but a rerun from a snapshot (diagnose) "
                 "trains on other ones\n";
  }
  if (stats.state_check.status == StateCheckResult::Status::kSkipped) {
    std::cerr << binary_name() << " record: " << stats.state_check.message << "\n";
  }
  const bool params_finite = parameters_finite(*program);
  const bool finite = print_summary(outcomes, params_finite, stats, output, mode);
  // A run cut short by a NaN was reported above; one that ran every step must have fired every injection.
  bool all_fired = true;
  if (finite && static_cast<std::int64_t>(outcomes.size()) == n) all_fired = report_unfired(fired, defenses, n);
  return finite && all_fired && stats.write_error.empty() ? 0 : 1;
}

}  // namespace retrace::cli
