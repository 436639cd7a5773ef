#pragma once
// `retrace run`'s process pool: every scenario runs in a child process of this binary
// (`retrace run --child SOURCE --result FILE`), so that one crash, abort or OOM kill cannot take
// down the suite; the child writes its ScenarioResult as JSON, the parent reads it back.
//
// The children's files (result, log, trace) live in a private folder (mkdtemp, mode 0700) that
// is emptied and removed on the way out, an exception included; children still running then are
// killed and reaped. On a terminal, a progress bar on stderr shows what is done and running.

#include <retrace/runner.h>
#include <retrace/scenario.h>

#include <functional>
#include <string>
#include <vector>

namespace retrace::cli {

struct ScenarioJob {
  std::string source;  // a path or builtin:NAME, as the child loads it
  ScenarioSpec spec;   // parsed by the parent (a bad file fails before anything runs)
};

struct PoolOptions {
  int jobs = 1;        // children at once, >= 1
  int threads = 0;     // LibTorch intra-op threads per child; 0: the cores / the children at once
  bool bench = false;  // the children run bench_scenario (--bench)
};

// Runs every job and returns the results in the jobs' order. `on_done` gets each result as its
// child ends (the progress bar cleared meanwhile): a child that died, exited non-zero or wrote no
// readable result gets a stand-in result that never passes (harness_error, the signal or exit
// code and the last line of its output). Throws retrace::Error when a child cannot be started or
// waited for.
std::vector<ScenarioResult> run_in_children(const std::vector<ScenarioJob>& jobs, const PoolOptions& options,
                                            const std::function<void(const ScenarioResult&)>& on_done);

// The child's side: runs `source` in this process and writes its result as JSON to `result_path`
// (a recorded trace goes beside it, `result_path` + ".trace", removed afterwards). A data-parallel
// scenario's child launches its ranks (this same command in each), merges their results and runs
// the verdict's counterfactual across them; `counterfactual` (a rank of that, "KIND:FIRST:LAST:
// FAULT") runs the plan's variant instead of the scenario. Returns 0.
int run_child(const std::string& source, const std::string& result_path, int threads, bool bench,
              const std::string& counterfactual = "");

}  // namespace retrace::cli
