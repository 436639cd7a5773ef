// `retrace run [PATHS...]`: runs scenarios, each in its own child process so that one crash
// cannot take down the suite, in parallel; prints the outcome matrix (with a progress bar on a
// terminal), writes JUnit, JSON and the HTML report.
#include "commands.h"
#include "progress.h"

#include <retrace/error.h>
#include <retrace/report.h>
#include <retrace/reporter.h>
#include <retrace/runner.h>
#include <retrace/trainer.h>

#include <boost/program_options.hpp>
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
#include <iomanip>
#include <iostream>
#include <map>
#include <spawn.h>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace retrace::cli {

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace {

struct Job {
  std::string source;  // path or builtin:NAME
  ScenarioSpec spec;
  std::string result_path, log_path;
  pid_t pid = -1;
  std::chrono::steady_clock::time_point started;
};

// Paths -> scenario sources: files as given, folders' *.yaml in name order, builtin:NAME.
std::vector<std::string> expand(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  if (paths.empty()) {
    if (!default_program().empty()) {  // a user's binary: its own scenarios, not retrace's suite
      throw Error("no scenarios given: pass scenario files or folders (scenarios that name 'program: " + default_program() +
                  "'), or builtin:NAME for one of retrace's built-in scenarios");
    }
    for (const BuiltinScenario& b : builtin_suite()) out.push_back("builtin:" + b.name);
    return out;
  }
  for (const std::string& p : paths) {
    if (p.rfind("builtin:", 0) == 0) {
      out.push_back(p);
      continue;
    }
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(p)) {
        if (e.path().extension() == ".yaml" || e.path().extension() == ".yml") files.push_back(e.path().string());
      }
      std::sort(files.begin(), files.end());
      if (files.empty()) throw Error(p + ": the folder holds no .yaml scenario files");
      out.insert(out.end(), files.begin(), files.end());
    } else {
      out.push_back(p);
    }
  }
  return out;
}

std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

ScenarioResult crashed(const Job& job, int status) {
  ScenarioResult r;
  r.name = job.spec.name.empty() ? job.source : job.spec.name;
  r.origin = job.source;
  r.fault = fault_label(job.spec);
  r.defense = defense_label(job.spec);
  r.raised = true;
  if (WIFSIGNALED(status)) {
    r.error = "the scenario's process died by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  } else {
    r.error = "the scenario's process exited with code " + std::to_string(WEXITSTATUS(status)) + " and no result";
  }
  const std::string tail = last_line(job.log_path);
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

int run_child(const std::string& source, const std::string& result_path, int threads, bool bench) {
  if (threads > 0) torch::set_num_threads(threads);
  const ScenarioSpec spec = load_scenario(source);
  // A recorded run's trace lives beside the result, in the parent's private folder, which the
  // parent empties even when this process is killed mid-run.
  RunOptions options;
  options.trace_path = result_path + ".trace";
  const ScenarioResult r = bench ? bench_scenario(spec) : run_scenario(spec, options);
  ::unlink(options.trace_path.c_str());
  write_file(result_path, r.to_json().dump() + "\n", "the result file");
  return 0;
}

}  // namespace

int run_run(const std::vector<std::string>& args) {
  std::vector<std::string> paths;
  std::string junit_path, json_path, report_path, child, result_path;
  int jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int threads = 0;
  po::options_description opts(
      "retrace run [PATHS...] [options]\n\n"
      "Runs scenarios -- training with injected faults and defenses -- and checks what each\n"
      "expects; every scenario runs in its own process. PATHS are scenario files, folders of\n"
      "them, or builtin:NAME; with none, the built-in suite runs. Prints the outcome matrix\n"
      "(fault x defense -> held / broke, and whether that was expected). On a terminal, a progress\n"
      "bar on stderr shows how many scenarios are done and which are running.\n"
      "Exit code 0 every expectation met, 1 some failed, 2 bad input.\n\n"
      "options");
  opts.add_options()("help,h", "show this help")(
      "jobs,j", po::value<int>(&jobs), "scenarios run in parallel (default: the number of cores)")(
      "junit", po::value<std::string>(&junit_path), "write a JUnit XML report to FILE")(
      "json", po::value<std::string>(&json_path), "write every result as JSON to FILE ('-' for stdout)")(
      "report", po::value<std::string>(&report_path),
      "write an HTML report to FILE: the outcome matrix and each scenario's loss, gradient-norm, loss-scale and "
      "LR curves with faults, skipped steps and rollbacks marked (one self-contained file, no script)")(
      "threads", po::value<int>(&threads), "LibTorch intra-op threads per scenario (default: cores / jobs; "
                                            "oversubscribing the cores slows spinning OpenMP threads badly)")(
      "list", "list the scenarios (with their fault and defense) instead of running them")(
      "bench", "also measure stability figures per scenario: skipped steps, steps to recover, final-loss "
               "delta against the fault-free run, defenses' overhead per step (run one at a time: -j 1)");
  po::options_description hidden;
  hidden.add_options()("paths", po::value<std::vector<std::string>>(&paths))(
      "child", po::value<std::string>(&child))("result", po::value<std::string>(&result_path));
  po::options_description all;
  all.add(opts).add(hidden);
  po::positional_options_description pos;
  pos.add("paths", -1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  if (vm.count("help")) {
    std::cout << opts;
    return 0;
  }
  po::notify(vm);
  const bool bench = vm.count("bench") > 0;
  if (!child.empty()) return run_child(child, result_path, threads, bench);
  if (bench && !vm.count("jobs")) jobs = 1;  // timings from scenarios sharing the cores mean little
  if (jobs < 1) throw Error("--jobs must be at least 1, got " + std::to_string(jobs));
  if (vm.count("threads") && threads < 1) throw Error("--threads must be at least 1, got " + std::to_string(threads));
  if (!report_path.empty()) {
    const fs::path parent = fs::path(report_path).parent_path();
    std::error_code ec;
    if (!parent.empty() && !fs::is_directory(parent, ec)) {
      throw Error("--report: the folder '" + parent.string() + "' does not exist; create it first");
    }
  }

  // Parse everything first: a bad file fails the command before anything runs.
  std::vector<Job> pending;
  for (const std::string& source : expand(paths)) {
    Job job;
    job.source = source;
    job.spec = load_scenario(source);
    // A scenario on a registered program: building it checks the program exists, takes its
    // config and can run the injections -- bad input, refused here like a parse error.
    if (!job.spec.program.empty()) make_scenario_program(job.spec);
    pending.push_back(std::move(job));
  }
  if (vm.count("list")) {
    for (const Job& j : pending) {
      std::cout << j.source << "  fault: " << fault_label(j.spec) << "  defense: " << defense_label(j.spec)
                << (j.spec.expect.diverges ? "  (negative control)" : "") << "\n";
    }
    return 0;
  }

  // A private folder of our own (mkdtemp: unpredictable name, mode 0700).
  std::string work_template = (fs::temp_directory_path() / "retrace_run_XXXXXX").string();
  if (::mkdtemp(work_template.data()) == nullptr) {
    throw Error("cannot create a temporary folder in " + fs::temp_directory_path().string() + ": " + std::strerror(errno));
  }
  const fs::path work = work_template;
  // On any exception from here on, stop and reap the children and remove their files.
  struct Cleanup {
    std::map<pid_t, std::size_t>* running;
    std::vector<Job>* jobs;
    std::string dir;
    ~Cleanup() {
      for (const auto& [pid, i] : *running) {
        ::kill(pid, SIGKILL);
        int st = 0;
        ::waitpid(pid, &st, 0);
      }
      for (const Job& job : *jobs) {
        if (!job.result_path.empty()) ::unlink(job.result_path.c_str());
        if (!job.log_path.empty()) ::unlink(job.log_path.c_str());
        if (!job.result_path.empty()) {
          ::unlink((job.result_path + ".trace").c_str());
          ::unlink((job.result_path + ".trace.incomplete").c_str());
        }
      }
      ::rmdir(dir.c_str());
    }
  };
  const int per_child_threads =
      threads > 0 ? threads
                  : std::max(1, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) /
                                    std::min<int>(jobs, static_cast<int>(pending.size())));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<ScenarioResult> results(pending.size());
  std::map<pid_t, std::size_t> running;
  Cleanup cleanup{&running, &pending, work.string()};
  std::size_t next = 0, done = 0;
  std::string self = "/proc/self/exe";

  auto start = [&](std::size_t i) {
    Job& job = pending[i];
    job.result_path = (work / (std::to_string(i) + ".json")).string();
    job.log_path = (work / (std::to_string(i) + ".log")).string();
    std::vector<std::string> argv_s = {"retrace", "run", "--child", job.source, "--result", job.result_path,
                                       "--threads", std::to_string(per_child_threads)};
    if (bench) argv_s.push_back("--bench");
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, job.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw Error(std::string("cannot start a scenario process: ") + std::strerror(rc));
    job.pid = pid;
    job.started = std::chrono::steady_clock::now();
    running[pid] = i;
  };

  // With --json -, stdout carries only the JSON; progress and the matrix go to stderr.
  std::ostream& say = json_path == "-" ? std::cerr : std::cout;
  // On a terminal, the bar: polled every 100 ms so its clock moves; elsewhere a blocking wait.
  ProgressBar bar(pending.size());
  auto running_names = [&] {
    std::string names;
    for (const auto& [pid, i] : running) {
      const Job& j = pending[i];
      names += (names.empty() ? "" : ", ") + (j.spec.name.empty() ? j.source : j.spec.name);
    }
    return names;
  };
  while (done < pending.size()) {
    while (next < pending.size() && static_cast<int>(running.size()) < jobs) start(next++);
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
    const Job& job = pending[i];
    ScenarioResult r;
    std::ifstream in(job.result_path);
    std::stringstream text;
    text << in.rdbuf();
    bool parsed = false;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && !text.str().empty()) {
      try {
        r = ScenarioResult::from_json(nlohmann::json::parse(text.str()));
        parsed = true;
      } catch (const std::exception&) {
        // A truncated or garbled result file: report the scenario as crashed below.
      }
    }
    if (!parsed) {
      r = crashed(job, status);
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - job.started).count();
    }
    ++done;
    bar.clear();
    say << (r.passed ? "ok     " : "FAILED ") << r.name << "  (" << r.fault << " x " << r.defense << ": " << r.outcome()
              << ", expected " << (r.expected_to_break ? "broke" : "held") << ", " << std::fixed << std::setprecision(1)
              << r.seconds << " s)" << std::defaultfloat << "\n";
    if (!r.passed) {
      // The reasons, then every check: `!` marks one that failed (for a control, an evidence
      // check that failed is the fault biting, and the reasons say whether that counted).
      for (const std::string& why : r.reasons) say << "         - " << why << "\n";
      for (const ExpectationCheck& c : r.checks) {
        say << "         " << (c.passed ? "  " : "! ") << c.name << ": expected " << c.expected << ", observed " << c.observed << "\n";
      }
      if (!r.replay_report.empty()) say << "         replay: " << r.replay_report << "\n";
    }
    say.flush();
    results[i] = std::move(r);
    if (done < pending.size()) bar.update(done, running_names());
  }
  bar.clear();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The files go with `cleanup` (file by file: libtorch.so exports its own
  // std::filesystem::remove_all, which crashes here).

  std::size_t failed = 0;
  for (const ScenarioResult& r : results) failed += r.passed ? 0 : 1;
  say << "\n" << outcome_matrix(results) << "\n";
  if (bench) say << "stability (recovery: steps from the first disturbed step -- skipped, non-finite, or a loss >10% off the\n"
                          "fault-free run's -- to the first undisturbed one;\n"
                          "loss delta: final loss minus the fault-free run's; overhead: time per step with the defenses / without):\n"
                       << stability_table(results) << "\n";
  say
            << results.size() << " scenarios, " << results.size() - failed << " as expected, " << failed << " not, in "
            << std::fixed << std::setprecision(1) << seconds << " s\n";
  if (!junit_path.empty()) write_file(junit_path, junit_xml(results, seconds), "--junit file");
  if (!report_path.empty()) {
    write_file(report_path, html_run_report(results, seconds), "--report file");
    say << "wrote the HTML report to " << report_path << "\n";
  }
  if (!json_path.empty()) {
    nlohmann::json all_results = nlohmann::json::array();
    for (const ScenarioResult& r : results) all_results.push_back(r.to_json());
    const std::string out = nlohmann::json{{"scenarios", all_results}, {"failed", failed}, {"seconds", seconds}}.dump(2) + "\n";
    write_output(json_path, out, "--json file");
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace retrace::cli
