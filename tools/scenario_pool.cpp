#include "scenario_pool.h"

#include "commands.h"
#include "progress.h"
#include "rank_launcher.h"

#include <retrace/error.h>
#include <retrace/io.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <spawn.h>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace retrace::cli {

namespace fs = std::filesystem;

namespace {

// A job's child process and its files.
struct Child {
  std::string result_path, log_path;
  pid_t pid = -1;
  std::chrono::steady_clock::time_point started;
};

std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

ScenarioResult crashed(const ScenarioJob& job, const Child& child, int status) {
  ScenarioResult r;
  r.name = job.spec.name.empty() ? job.source : job.spec.name;
  r.origin = job.source;
  r.fault = fault_label(job.spec);
  r.defense = defense_label(job.spec);
  r.raised = true;
  if (WIFSIGNALED(status)) {
    r.error = "the scenario's process died by signal " + std::to_string(WTERMSIG(status)) + " (" +
              strsignal(WTERMSIG(status)) + ")";
  } else {
    r.error = "the scenario's process exited with code " + std::to_string(WEXITSTATUS(status)) + " and no result";
  }
  const std::string tail = last_line(child.log_path);
  if (!tail.empty()) r.error += ": " + tail;
  r.params_finite = false;
  r.expected_to_break = job.spec.expect.diverges;
  r.broke = true;
  // Never a pass, not even for a negative control: a process that died tells nothing of whether
  // the fault bit (it may be the harness, the machine or the OOM killer).
  r.harness_error = true;
  r.reasons = {"harness error: " + r.error};
  r.passed = false;
  return r;
}

// The result in `path`, or nullopt when the file is missing, truncated or garbled.
std::optional<ScenarioResult> read_result_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().empty()) return std::nullopt;
  try {
    return ScenarioResult::from_json(nlohmann::json::parse(text.str()));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The child's result, or nullopt when it did not exit 0 or its file is missing, truncated or garbled.
std::optional<ScenarioResult> read_result(const Child& child, int status) {
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return read_result_file(child.result_path);
}

// One result of a data-parallel scenario from its ranks' results, judged as one run: rank 0's
// result with what the other ranks add -- their failed checks (observed "rank K: ..."), breakage
// of kinds rank 0 did not show, a raise, non-finite parameters, a harness error or no result at
// all -- and the ranks' state split when they end apart; then the verdict decided on that
// (decide_verdict), as for a run in one process. A rank that held alone does not make a control
// fail when the combined run broke, and an injection for rank 1 that never fired makes the run
// not exercised.
ScenarioResult merge_ranks(const ScenarioSpec& spec, const std::string& source,
                           const std::vector<std::optional<ScenarioResult>>& ranks) {
  ScenarioResult r;
  if (ranks.front()) r = *ranks.front();
  else {
    r.name = spec.name.empty() ? source : spec.name;
    r.origin = source;
    r.fault = fault_label(spec);
    r.defense = defense_label(spec);
  }
  r.world_size = spec.world_size;
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const std::string who = "rank " + std::to_string(k);
    if (!ranks[k]) {
      r.harness_error = true;
      if (r.error.empty()) r.error = who + " left no result (it died, or its rendezvous failed)";
      continue;
    }
    if (k == 0) continue;
    const ScenarioResult& x = *ranks[k];
    for (ExpectationCheck c : x.checks) {
      if (c.passed) continue;
      c.observed = who + ": " + c.observed;
      r.checks.push_back(std::move(c));
    }
    for (const Breakage& b : x.breakage) {
      if (std::none_of(r.breakage.begin(), r.breakage.end(), [&](const Breakage& y) { return y.kind == b.kind; })) {
        r.breakage.push_back(b);
        r.breakage.back().detail = who + ": " + b.detail;
      }
    }
    // Its injections: an entry for this rank is accounted in its result alone; what fired here
    // that rank 0 did not note, noted as this rank's.
    for (std::size_t i = 0; i < spec.injections.size() && i < x.injections.size() && i < r.injections.size(); ++i) {
      if (spec.injections[i].rank == static_cast<int>(k)) r.injections[i] = x.injections[i];
    }
    for (const StepNote& n : x.notes) {
      if (n.kind != StepNoteKind::kInjected) continue;
      if (std::find(r.notes.begin(), r.notes.end(), n) != r.notes.end()) continue;
      r.notes.push_back({n.step, n.kind, who + ": " + n.text});
    }
    for (StepPoint& p : r.steps) {
      for (const StepPoint& q : x.steps) {
        if (q.step == p.step && q.injected) p.injected = true;
      }
    }
    if (x.raised && !r.raised) {
      r.raised_at_step = x.raised_at_step;
      r.raised_by_defense = x.raised_by_defense;
    }
    r.raised = r.raised || x.raised;
    r.harness_error = r.harness_error || x.harness_error;
    r.params_finite = r.params_finite && x.params_finite;
    if (r.nonfinite_state.empty() && !x.nonfinite_state.empty()) {
      r.nonfinite_state = who + ": " + x.nonfinite_state;
      r.nonfinite_state_kind = x.nonfinite_state_kind;
    }
    if (r.error.empty() && !x.error.empty()) r.error = who + ": " + x.error;
    // The ranks' state is one (replicated; a split is judged below): rank 0's, or the first's that has one.
    if (r.optimizer_state_scale.empty()) r.optimizer_state_scale = x.optimizer_state_scale;
  }
  std::stable_sort(r.notes.begin(), r.notes.end(), [](const StepNote& a, const StepNote& b) {
    return a.step != b.step ? a.step < b.step : a.kind < b.kind;  // a step's injections before its skip
  });
  // raises speaks of the run: a rank whose own raise is the one expected (its check passed) is the
  // run's raise, whatever its peers raised after it (red-team finding: rank 1 crashed with "index out
  // of range", rank 0 then raised "Connection closed by peer", and rank 0's error was the run's: a
  // control's crash could pass only on rank 0).
  if (spec.expect.raises) {
    for (std::size_t k = 0; k < ranks.size(); ++k) {
      if (!ranks[k] || !ranks[k]->raised) continue;
      const ScenarioResult& x = *ranks[k];
      const auto passed = std::find_if(x.checks.begin(), x.checks.end(), [](const ExpectationCheck& c) {
        return c.kind == CheckKind::kRaises && c.passed;
      });
      if (passed == x.checks.end()) continue;
      const std::string who = "rank " + std::to_string(k);
      r.checks.erase(std::remove_if(r.checks.begin(), r.checks.end(),
                                    [](const ExpectationCheck& c) { return c.kind == CheckKind::kRaises; }),
                     r.checks.end());
      ExpectationCheck c = *passed;
      if (k > 0) c.observed = who + ": " + c.observed;
      r.checks.push_back(std::move(c));
      r.error = k > 0 ? who + ": " + x.error : x.error;
      r.raised_by_defense = x.raised_by_defense;
      r.raised_at_step = x.raised_at_step;
      // Its raise is the run's breakage (a control's evidence), not the peer's that followed.
      r.breakage.erase(std::remove_if(r.breakage.begin(), r.breakage.end(),
                                      [](const Breakage& b) { return b.kind == BreakKind::kRaised; }),
                       r.breakage.end());
      for (const Breakage& b : x.breakage) {
        if (b.kind != BreakKind::kRaised) continue;
        r.breakage.push_back(b);
        if (k > 0) r.breakage.back().detail = who + ": " + b.detail;
      }
      break;
    }
  }
  // injections_fired speaks of the run, every rank's injections: each rank counted its own (an
  // injection for rank 1 had made rank 0's check say "0 fired", and the run "not exercised").
  if (const std::optional<bool> want = spec.expect.injections_fired) {
    r.checks.erase(std::remove_if(r.checks.begin(), r.checks.end(),
                                  [](const ExpectationCheck& c) { return c.kind == CheckKind::kInjectionsFired; }),
                   r.checks.end());
    const std::size_t fired = r.notes_of(StepNoteKind::kInjected).size();
    r.checks.push_back({CheckKind::kInjectionsFired, *want ? "true" : "false",
                        std::to_string(fired) + " fired (every rank's)", (fired == 0) != *want});
  }
  // Ranks in step end with the same state. One that ends otherwise (its own update: an LR spike or
  // a bit flip on one rank) split the run, which no rank sees alone: the run broke.
  // A run whose ranks all raised in the same step is judged too: each stopped before that step's
  // update (a defense refusing the shared gradient norm on every rank; a crash on one, its peers'
  // collective closed), and their state is that of the step before (red-team finding: an LR spike on
  // rank 1 split all 30 parameters, then a clip refusing at step 5 made it "held, ok").
  const bool raised_together = std::all_of(ranks.begin(), ranks.end(), [&](const std::optional<ScenarioResult>& x) {
    return x && x->raised && x->raised_at_step == ranks.front()->raised_at_step;
  });
  std::string split;
  if (ranks.front() && (!r.raised || raised_together) && !r.harness_error) {
    const auto& base = ranks.front()->state_digests;
    for (std::size_t k = 1; k < ranks.size() && split.empty(); ++k) {
      const auto& other = ranks[k]->state_digests;
      if (other == base) continue;
      std::size_t differing = 0;
      std::string first;
      for (std::size_t i = 0; i < std::min(base.size(), other.size()); ++i) {
        if (base[i] == other[i]) continue;
        if (first.empty()) first = base[i].first == other[i].first ? base[i].first : other[i].first;
        ++differing;
      }
      split = base.size() != other.size()
                  ? "the ranks' state split: rank " + std::to_string(k) + " holds " + std::to_string(other.size()) +
                        " tensors, rank 0 " + std::to_string(base.size())
                  : "the ranks' state split: rank " + std::to_string(k) + "'s differs from rank 0's in " +
                        std::to_string(differing) + " of " + std::to_string(base.size()) + " tensors (first " + first +
                        ") at the end";
      r.breakage.push_back({BreakKind::kRanksSplit, r.last_step, split, r.last_step >= r.fault_step});
    }
  }
  decide_verdict(spec.expect, r);
  if (!split.empty() && !spec.expect.diverges) {  // no check says it: the combined run's own breakage
    r.broke = true;
    r.reasons.push_back(split);
    r.passed = false;
  }
  return r;
}

// A counterfactual plan on the command line of the ranks that run it: "KIND:FIRST:LAST:FAULT:MOVEMENT_FROM".
std::string plan_flag(const CounterfactualPlan& p) {
  return std::string(to_string(p.kind)) + ":" + std::to_string(p.first_step) + ":" + std::to_string(p.last_step) + ":" +
         std::to_string(p.fault_step) + ":" + std::to_string(p.movement_from);
}

CounterfactualPlan parse_plan_flag(const std::string& text) {
  CounterfactualPlan p;
  std::istringstream in(text);
  std::string kind;
  char c1 = 0, c2 = 0, c3 = 0, c4 = 0;
  if (std::getline(in, kind, ':') &&
      in >> p.first_step >> c1 >> p.last_step >> c2 >> p.fault_step >> c3 >> p.movement_from && c1 == ':' &&
      c2 == ':' && c3 == ':' && !(in >> c4)) {
    for (CounterfactualKind k :
         {CounterfactualKind::kFaultFree, CounterfactualKind::kUndefended, CounterfactualKind::kBare}) {
      if (kind == to_string(k)) {
        p.kind = k;
        return p;
      }
    }
  }
  throw Error("--counterfactual: expected fault_free|undefended|bare:FIRST:LAST:FAULT:MOVEMENT_FROM, got '" + text +
              "'");
}

// Launches the ranks of `source` (`retrace run --child` in each, with `extra` flags) and merges
// the results they write beside `result_path` (read and removed).
ScenarioResult run_ranks(const ScenarioSpec& spec, const std::string& source, const std::string& result_path,
                         int threads, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"run", "--child", source, "--result", result_path};
  if (threads > 0) {
    args.push_back("--threads");
    args.push_back(std::to_string(std::max(1, threads / spec.world_size)));
  }
  args.insert(args.end(), extra.begin(), extra.end());
  launch_ranks(spec.world_size, args);  // each rank's verdict is in its result file
  std::vector<std::optional<ScenarioResult>> ranks;
  for (int k = 0; k < spec.world_size; ++k) {
    const std::string path = rank_trace_path(result_path, k);
    ranks.push_back(read_result_file(path));
    ::unlink(path.c_str());
  }
  return merge_ranks(spec, source, ranks);
}

}  // namespace

int run_child(const std::string& source, const std::string& result_path, int threads, bool bench,
              const std::string& counterfactual) {
  const ScenarioSpec spec = load_scenario(source);
  if (spec.world_size > 1 && bench) {
    ScenarioResult r;
    r.name = spec.name.empty() ? source : spec.name;
    r.origin = source;
    r.fault = fault_label(spec);
    r.defense = defense_label(spec);
    r.harness_error = r.broke = r.raised = true;
    r.error = "--bench does not measure data-parallel scenarios (world_size " + std::to_string(spec.world_size) +
              "); run it without --bench";
    r.reasons = {"harness error: " + r.error};
    write_file(result_path, r.to_json().dump() + "\n", "the result file");
    return 0;
  }
  if (spec.world_size > 1 && !launched_as_rank()) {
    // This child launches the scenario's ranks, combines their results, and runs the verdict's
    // counterfactual the same way: the ranks again, on the variant.
    ScenarioResult r = run_ranks(spec, source, result_path, threads, {});
    r.counterfactual = Counterfactual{};  // each rank's why_not: left to this launcher
    for (CounterfactualPlan plan = plan_counterfactual(spec, RunOptions{}, r);
         plan.kind != CounterfactualKind::kNone;) {
      const ScenarioResult c = run_ranks(counterfactual_spec(spec, plan.kind), source, result_path + ".counterfactual",
                                         threads, {"--counterfactual", plan_flag(plan)});
      plan = weigh_counterfactual(spec, plan, c, r);
    }
    write_file(result_path, r.to_json().dump() + "\n", "the result file");
    return 0;
  }
  if (threads > 0) torch::set_num_threads(threads);
  std::string own_result = result_path;
  if (spec.world_size > 1) {
    const char* rank = std::getenv("RANK");
    own_result = rank_trace_path(result_path, rank ? std::atoi(rank) : 0);
  }
  // A recorded run's trace lives beside the result, in the parent's private folder, which the
  // parent empties even when this process is killed mid-run.
  RunOptions options;
  options.trace_path = own_result + ".trace";
  const ScenarioResult r = !counterfactual.empty() ? run_counterfactual(spec, parse_plan_flag(counterfactual), options)
                           : bench                 ? bench_scenario(spec)
                                                   : run_scenario(spec, options);
  ::unlink(options.trace_path.c_str());
  write_file(own_result, r.to_json().dump() + "\n", "the result file");
  return 0;
}

std::vector<ScenarioResult> run_in_children(const std::vector<ScenarioJob>& jobs, const PoolOptions& options,
                                            const std::function<void(const ScenarioResult&)>& on_done) {
  // A private folder of our own (mkdtemp: unpredictable name, mode 0700).
  std::string work_template = (fs::temp_directory_path() / "retrace_run_XXXXXX").string();
  if (::mkdtemp(work_template.data()) == nullptr) {
    throw Error("cannot create a temporary folder in " + fs::temp_directory_path().string() + ": " +
                std::strerror(errno));
  }
  const fs::path work = work_template;
  std::vector<Child> children(jobs.size());
  std::map<pid_t, std::size_t> running;
  // On any exception from here on, stop and reap the children and remove their files.
  struct Cleanup {
    std::map<pid_t, std::size_t>& running;
    std::string dir;
    ~Cleanup() {
      for (const auto& [pid, i] : running) {
        ::kill(pid, SIGKILL);
        int st = 0;
        ::waitpid(pid, &st, 0);
      }
      // Every file of the folder, the ranks' results and traces of a data-parallel job included.
      io::remove_tree(dir);
    }
  } cleanup{running, work.string()};

  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int per_child_threads =
      options.threads > 0
          ? options.threads
          : std::max(1, cores / std::max(1, std::min<int>(options.jobs, static_cast<int>(jobs.size()))));
  const std::string self = "/proc/self/exe";
  auto start = [&](std::size_t i) {
    Child& child = children[i];
    child.result_path = (work / (std::to_string(i) + ".json")).string();
    child.log_path = (work / (std::to_string(i) + ".log")).string();
    std::vector<std::string> argv_s = {"retrace",   "run",
                                       "--child",   jobs[i].source,
                                       "--result",  child.result_path,
                                       "--threads", std::to_string(per_child_threads)};
    if (options.bench) argv_s.push_back("--bench");
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, child.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw Error(std::string("cannot start a scenario process: ") + std::strerror(rc));
    child.pid = pid;
    child.started = std::chrono::steady_clock::now();
    running[pid] = i;
  };

  // On a terminal, the bar: polled every 100 ms so its clock moves; elsewhere a blocking wait.
  ProgressBar bar(jobs.size());
  auto running_names = [&] {
    std::string names;
    for (const auto& [pid, i] : running) {
      const ScenarioJob& j = jobs[i];
      names += (names.empty() ? "" : ", ") + (j.spec.name.empty() ? j.source : j.spec.name);
    }
    return names;
  };
  std::vector<ScenarioResult> results(jobs.size());
  std::size_t next = 0, done = 0;
  // Processes at work: a data-parallel job counts its world_size (its ranks run at once); one
  // wider than -j runs alone.
  int busy = 0;
  const auto width = [&](std::size_t i) { return std::max(1, jobs[i].spec.world_size); };
  while (done < jobs.size()) {
    while (next < jobs.size() && (running.empty() || busy + width(next) <= options.jobs)) {
      busy += width(next);
      start(next++);
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, bar.enabled() ? WNOHANG : 0);
    if (pid == 0) {
      bar.update(done, running_names());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      throw Error(std::string("waiting for scenario processes failed: ") + std::strerror(errno));
    }
    auto it = running.find(pid);
    if (it == running.end()) continue;
    const std::size_t i = it->second;
    running.erase(it);
    busy -= width(i);
    std::optional<ScenarioResult> r = read_result(children[i], status);
    if (!r) {
      r = crashed(jobs[i], children[i], status);
      r->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - children[i].started).count();
    }
    ++done;
    bar.clear();
    on_done(*r);
    results[i] = std::move(*r);
    if (done < jobs.size()) bar.update(done, running_names());
  }
  bar.clear();
  return results;
}

}  // namespace retrace::cli
