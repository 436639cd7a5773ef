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

// One result of a data-parallel scenario from its ranks' results: rank 0's, failing when a rank
// has no result, any rank failed, or the ranks disagree on held/broke; with the failed checks of
// the other ranks (observed "rank K: ..."), so that the outcome says what any rank's did (an
// injection for rank 1 that never fired: not exercised).
ScenarioResult merge_ranks(const ScenarioSpec& spec, const std::string& source,
                           const std::vector<std::optional<ScenarioResult>>& ranks) {
  ScenarioResult r;
  if (ranks.front()) r = *ranks.front();
  else {
    r.name = spec.name.empty() ? source : spec.name;
    r.origin = source;
    r.fault = fault_label(spec);
    r.defense = defense_label(spec);
    r.expected_to_break = spec.expect.diverges;
    r.broke = true;
    r.harness_error = true;
  }
  r.world_size = spec.world_size;
  std::vector<std::string> reasons;
  bool all_passed = true;
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const std::string who = "rank " + std::to_string(k);
    if (!ranks[k]) {
      reasons.push_back("harness error: " + who + " left no result (it died, or its rendezvous failed)");
      all_passed = false;
      r.harness_error = true;
      continue;
    }
    for (const std::string& why : ranks[k]->reasons) reasons.push_back(who + ": " + why);
    if (k > 0) {
      for (ExpectationCheck c : ranks[k]->checks) {
        if (c.passed) continue;
        c.observed = who + ": " + c.observed;
        r.checks.push_back(std::move(c));
      }
    }
    all_passed = all_passed && ranks[k]->passed;
    // What any rank saw holds for the run: a rank that broke, raised or hit a harness error.
    r.broke = r.broke || ranks[k]->broke;
    r.raised = r.raised || ranks[k]->raised;
    r.harness_error = r.harness_error || ranks[k]->harness_error;
    if (r.error.empty() && !ranks[k]->error.empty()) r.error = who + ": " + ranks[k]->error;
    if (ranks[k]->broke != ranks.front().value_or(*ranks[k]).broke) {
      reasons.push_back("the ranks disagree: rank 0 " + std::string(ranks.front()->broke ? "broke" : "held") + ", " +
                        who + " " + (ranks[k]->broke ? "broke" : "held"));
      all_passed = false;
    }
  }
  // Ranks in step end with the same state. One that ends otherwise (its own update: an LR spike or
  // a bit flip on one rank) split the run, which no rank sees alone: the run broke.
  if (ranks.front() && !r.raised && !r.harness_error) {
    const auto& base = ranks.front()->state_digests;
    for (std::size_t k = 1; k < ranks.size(); ++k) {
      const auto& other = ranks[k]->state_digests;
      if (other == base) continue;
      std::size_t differing = 0;
      std::string first;
      for (std::size_t i = 0; i < std::min(base.size(), other.size()); ++i) {
        if (base[i] == other[i]) continue;
        if (first.empty()) first = base[i].first == other[i].first ? base[i].first : other[i].first;
        ++differing;
      }
      const std::string detail = base.size() != other.size()
                                     ? "the ranks' state split: rank " + std::to_string(k) + " holds " +
                                           std::to_string(other.size()) + " tensors, rank 0 " +
                                           std::to_string(base.size())
                                     : "the ranks' state split: rank " + std::to_string(k) +
                                           "'s differs from rank 0's in " + std::to_string(differing) + " of " +
                                           std::to_string(base.size()) + " tensors (first " + first + ") at the end";
      r.breakage.push_back({BreakKind::kRanksSplit, r.last_step, detail, true});
      r.broke = true;
      if (!spec.expect.diverges) {
        reasons.push_back(detail);
        all_passed = false;
      }
    }
  }
  r.passed = all_passed;
  r.reasons = reasons;
  return r;
}

}  // namespace

int run_child(const std::string& source, const std::string& result_path, int threads, bool bench) {
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
    // This child launches the scenario's ranks and combines their results.
    std::vector<std::string> args = {"run", "--child", source, "--result", result_path};
    if (threads > 0) {
      args.push_back("--threads");
      args.push_back(std::to_string(std::max(1, threads / spec.world_size)));
    }
    launch_ranks(spec.world_size, args);  // each rank's verdict is in its result file
    std::vector<std::optional<ScenarioResult>> ranks;
    for (int k = 0; k < spec.world_size; ++k) {
      const std::string path = rank_trace_path(result_path, k);
      ranks.push_back(read_result_file(path));
      ::unlink(path.c_str());
    }
    write_file(result_path, merge_ranks(spec, source, ranks).to_json().dump() + "\n", "the result file");
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
  const ScenarioResult r = bench ? bench_scenario(spec) : run_scenario(spec, options);
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
