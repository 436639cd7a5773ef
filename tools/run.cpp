// `retrace run [PATHS...]`: flags -> the process pool (scenario_pool.h: each scenario in its own
// child process, in parallel) -> the reporters (reporter.h: the console, and JUnit, JSON and the
// HTML report when asked for).
#include "commands.h"
#include "scenario_pool.h"

#include <retrace/error.h>
#include <retrace/reporter.h>
#include <retrace/runner.h>
#include <retrace/trainer.h>

#include <boost/program_options.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

namespace retrace::cli {

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace {

struct RunFlags {
  std::vector<std::string> paths;
  std::string junit_path, json_path, report_path;
  std::string child, result_path;  // hidden: the pool's child process
  std::string counterfactual;      // hidden: a rank of a data-parallel counterfactual (run_child)
  PoolOptions pool;
  bool list = false;
};

// The flags, checked; nullopt after printing the help.
std::optional<RunFlags> parse_flags(const std::vector<std::string>& args) {
  RunFlags f;
  f.pool.jobs = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  po::options_description opts(
      "retrace run [PATHS...] [options]\n\n"
      "Runs scenarios -- training with injected faults and defenses -- and checks what each\n"
      "expects; every scenario runs in its own process. PATHS are scenario files, folders of\n"
      "them, or builtin:NAME; with none, the built-in suite runs. Prints the outcome matrix\n"
      "(fault x defense -> held / broke, and whether that was expected). On a terminal, a progress\n"
      "bar on stderr shows how many scenarios are done and which are running.\n"
      "Exit code 0 every expectation met, 1 some failed, 2 bad input.\n\n"
      "options");
  opts.add_options()("help,h", "show this help")("jobs,j", po::value<int>(&f.pool.jobs),
                                                 "scenarios run in parallel (default: the number of cores)")(
      "junit", po::value<std::string>(&f.junit_path), "write a JUnit XML report to FILE")(
      "json", po::value<std::string>(&f.json_path), "write every result as JSON to FILE ('-' for stdout)")(
      "report", po::value<std::string>(&f.report_path),
      "write an HTML report to FILE: the outcome matrix and each scenario's loss, gradient-norm, loss-scale and "
      "LR curves with faults, skipped steps and rollbacks marked (one self-contained file, no script)")(
      "threads", po::value<int>(&f.pool.threads),
      "LibTorch intra-op threads per scenario (default: cores / jobs; "
      "oversubscribing the cores slows spinning OpenMP threads badly)")(
      "list", "list the scenarios (with their fault and defense) instead of running them")(
      "bench", "also measure stability figures per scenario: skipped steps, steps to recover, final-loss "
               "delta against the fault-free run, defenses' overhead per step (run one at a time: -j 1)");
  po::options_description hidden;
  hidden.add_options()("paths", po::value<std::vector<std::string>>(&f.paths))(
      "child", po::value<std::string>(&f.child))("result", po::value<std::string>(&f.result_path))(
      "counterfactual", po::value<std::string>(&f.counterfactual));
  po::options_description all;
  all.add(opts).add(hidden);
  po::positional_options_description pos;
  pos.add("paths", -1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(all).positional(pos).run(), vm);
  if (vm.count("help")) {
    std::cout << opts;
    return std::nullopt;
  }
  po::notify(vm);
  f.pool.bench = vm.count("bench") > 0;
  f.list = vm.count("list") > 0;
  if (!f.child.empty()) return f;
  if (f.pool.bench && !vm.count("jobs")) f.pool.jobs = 1;  // timings from scenarios sharing the cores mean little
  if (f.pool.jobs < 1) throw Error("--jobs must be at least 1, got " + std::to_string(f.pool.jobs));
  if (vm.count("threads")) check_threads_flag(f.pool.threads);
  // Every output file's folder, before anything runs: not a run's worth of results lost at the end.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--report", f.report_path},
                                   {"--json", f.json_path},
                                   {"--junit", f.junit_path}}) {
    if (path.empty() && vm.count(flag + 2)) throw Error(std::string(flag) + ": the path is empty; name a file");
    if (path.empty() || path == "-") continue;
    const fs::path parent = fs::path(path).parent_path();
    std::error_code ec;
    if (!parent.empty() && !fs::is_directory(parent, ec)) {
      throw Error(std::string(flag) + ": the folder '" + parent.string() + "' does not exist; create it first");
    }
  }
  return f;
}

// Paths -> scenario sources: files as given, folders' *.yaml in name order, builtin:NAME.
std::vector<std::string> expand(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  if (paths.empty()) {
    if (!default_program().empty()) {  // a user's binary: its own scenarios, not retrace's suite
      throw Error("no scenarios given: pass scenario files or folders (scenarios that name 'program: " +
                  default_program() + "'), or builtin:NAME for one of retrace's built-in scenarios");
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

// Parses every scenario first: a bad file fails the command before anything runs.
std::vector<ScenarioJob> load_jobs(const std::vector<std::string>& paths) {
  std::vector<ScenarioJob> jobs;
  for (const std::string& source : expand(paths)) {
    ScenarioJob job{source, load_scenario(source)};
    // A scenario on a registered program: building it checks the program exists, takes its
    // config and can run the injections -- bad input, refused here like a parse error.
    if (!job.spec.program.empty()) make_scenario_program(job.spec);
    jobs.push_back(std::move(job));
  }
  return jobs;
}

// `path` with its folder resolved (links, "." and ".."): two spellings of one output file compare
// equal. POSIX realpath: std::filesystem's weakly_canonical left "./" in (LibTorch's copy of it).
std::string resolved(const std::string& path) {
  const fs::path p(path);
  const std::string folder = p.has_parent_path() ? p.parent_path().string() : ".";
  char* real = ::realpath(folder.c_str(), nullptr);
  if (!real) return path;
  std::string out = std::string(real) + "/" + p.filename().string();
  std::free(real);
  return out;
}

// A reporter that renders into memory, and how its text is written when the run is over.
struct FileReport {
  std::ostringstream text;
  std::unique_ptr<Reporter> reporter;
  std::function<void(const std::string&)> write;
};

}  // namespace

int run_run(const std::vector<std::string>& args) {
  const std::optional<RunFlags> flags = parse_flags(args);
  if (!flags) return 0;
  if (!flags->child.empty())
    return run_child(flags->child, flags->result_path, flags->pool.threads, flags->pool.bench, flags->counterfactual);
  const std::vector<ScenarioJob> jobs = load_jobs(flags->paths);
  // An output onto a scenario it runs, or two outputs onto one file, would lose one of them.
  std::vector<std::pair<std::string, std::string>> inputs;
  for (const ScenarioJob& j : jobs) inputs.emplace_back(j.source, "the scenario file " + j.source);
  std::map<std::string, const char*> outputs;
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--report", flags->report_path},
                                   {"--json", flags->json_path},
                                   {"--junit", flags->junit_path}}) {
    if (path.empty() || path == "-") continue;
    refuse_output_path(path, flag, inputs);
    std::error_code ec;
    const std::string ext = fs::path(path).extension().string();
    if ((ext == ".yaml" || ext == ".yml") && fs::exists(path, ec)) {
      throw Error(std::string(flag) + " '" + path +
                  "' is a scenario file (a scenario passed after the flag is read as its path); "
                  "choose another path");
    }
    const auto [at, added] = outputs.emplace(resolved(path), flag);
    if (!added)
      throw Error(std::string(flag) + " '" + path + "' is the " + at->second + " file too; choose another path");
  }
  if (flags->list) {
    for (const ScenarioJob& j : jobs) {
      std::cout << j.source << "  fault: " << fault_label(j.spec) << "  defense: " << defense_label(j.spec)
                << (j.spec.expect.diverges ? "  (negative control)" : "") << "\n";
    }
    return 0;
  }

  // With --json -, stdout carries only the JSON; the console's lines go to stderr.
  std::ostream& say = flags->json_path == "-" ? std::cerr : std::cout;
  ConsoleReporter console(say);
  std::vector<Reporter*> reporters = {&console};
  std::vector<std::unique_ptr<FileReport>> files;  // written in this order: JUnit, HTML, JSON
  auto add_file = [&](auto make, std::function<void(const std::string&)> write) {
    auto f = std::make_unique<FileReport>();
    f->reporter = make(f->text);
    f->write = std::move(write);
    reporters.push_back(f->reporter.get());
    files.push_back(std::move(f));
  };
  const RunFlags& fl = *flags;
  if (!fl.junit_path.empty()) {
    add_file([](std::ostream& o) { return std::make_unique<JunitReporter>(o); },
             [&](const std::string& text) { write_file(fl.junit_path, text, "--junit file"); });
  }
  if (!fl.report_path.empty()) {
    add_file([](std::ostream& o) { return std::make_unique<HtmlReporter>(o); },
             [&](const std::string& text) {
               write_file(fl.report_path, text, "--report file");
               say << "wrote the HTML report to " << fl.report_path << "\n";
             });
  }
  if (!fl.json_path.empty()) {
    add_file([](std::ostream& o) { return std::make_unique<JsonReporter>(o); },
             [&](const std::string& text) { write_output(fl.json_path, text, "--json file"); });
  }

  const auto t0 = std::chrono::steady_clock::now();
  SuiteRun run;
  run.results = run_in_children(jobs, flags->pool, [&](const ScenarioResult& r) {
    for (Reporter* x : reporters) x->scenario_done(r);
  });
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.bench = flags->pool.bench;
  for (Reporter* x : reporters) x->suite_done(run);
  for (const auto& f : files) f->write(f->text.str());
  return run.failed() == 0 ? 0 : 1;
}

}  // namespace retrace::cli
