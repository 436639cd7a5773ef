#include "rank_launcher.h"

#include <retrace/error.h>
#include <retrace/io.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <sys/prctl.h>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace retrace::cli {

namespace fs = std::filesystem;

bool launched_as_rank() {
  const char* w = std::getenv("WORLD_SIZE");
  return w != nullptr && *w != '\0';
}

std::vector<std::string> without_ranks_flag(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--ranks") {
      ++i;  // and its value
      continue;
    }
    if (args[i].rfind("--ranks=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  return out;
}

std::string rank_trace_path(const std::string& path, int rank) {
  const fs::path p(path);
  const std::string tag = ".rank" + std::to_string(rank);
  if (p.has_extension() && p.stem() != "")
    return (p.parent_path() / (p.stem().string() + tag + p.extension().string())).string();
  return path + tag;
}

int launch_ranks(int ranks, const std::vector<std::string>& args) {
  char dir_template[] = "/tmp/retrace-ranks-XXXXXX";
  if (!::mkdtemp(dir_template))
    throw Error(std::string("cannot make the ranks' store folder: ") + std::strerror(errno));
  const std::string dir = dir_template;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { io::remove_tree(dir); }
  } cleanup{dir};
  std::random_device rd;
  std::ostringstream run_id;
  run_id << std::hex << std::chrono::system_clock::now().time_since_epoch().count() << "-" << rd();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, cores / ranks);

  // The environment minus what each rank gets of its own.
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" ||
        key == "RETRACE_STORE" || key == "RETRACE_RUN_ID" || key == "OMP_NUM_THREADS")
      continue;
    base.push_back(kv);
  }
  std::map<pid_t, int> running;
  std::vector<int> status(static_cast<std::size_t>(ranks), 0);
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> env = base;
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(ranks));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(ranks));  // all on this host (torchrun's name)
    env.push_back("RETRACE_STORE=" + dir + "/store");
    env.push_back("RETRACE_RUN_ID=" + run_id.str());
    env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
    std::vector<char*> envp;
    for (std::string& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_s = {"retrace"};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    // fork + exec rather than posix_spawn: a rank must die with its launcher (PR_SET_PDEATHSIG), or
    // a launcher killed by `retrace run`'s cleanup would leave its ranks training. Between fork and
    // exec only async-signal-safe calls.
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the launcher died before the prctl
      ::execve("/proc/self/exe", argv.data(), envp.data());
      ::_exit(127);
    }
    if (pid < 0) {
      const int err = errno;
      for (const auto& [p, rank] : running) ::kill(p, SIGKILL);
      throw Error("cannot start rank " + std::to_string(r) + ": " + std::strerror(err));
    }
    running[pid] = r;
  }
  // Each rank bounds its own waits (RETRACE_DIST_TIMEOUT): a rank whose peer died times out. One
  // that does not (stopped, or stuck outside any collective) is killed once the first rank has been
  // gone that long and 10 s more (red-team finding: a rank held by SIGSTOP kept its launcher in
  // waitpid for good). The ranks check the variable themselves; a malformed one is theirs to refuse.
  long timeout_s = 60;
  if (const char* t = std::getenv("RETRACE_DIST_TIMEOUT")) {
    char* end = nullptr;
    const long v = std::strtol(t, &end, 10);
    if (end != t && *end == '\0' && v > 0) timeout_s = v;
  }
  std::optional<std::chrono::steady_clock::time_point> deadline;
  std::vector<char> killed(static_cast<std::size_t>(ranks), 0);
  while (!running.empty()) {
    int st = 0;
    const pid_t pid = ::waitpid(-1, &st, deadline ? WNOHANG : 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      throw Error(std::string("waiting for the ranks failed: ") + std::strerror(errno));
    }
    if (pid == 0) {  // some rank is still running past the first one's end
      if (std::chrono::steady_clock::now() < *deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      for (const auto& [p, rank] : running) {
        if (killed[static_cast<std::size_t>(rank)]) continue;
        killed[static_cast<std::size_t>(rank)] = 1;
        std::cerr << "retrace: rank " << rank << " was still running " << timeout_s + 10
                  << " s after another rank ended (RETRACE_DIST_TIMEOUT " << timeout_s
                  << " s, and 10 s more); killed\n";
        ::kill(p, SIGKILL);
      }
      deadline.reset();  // the killed ranks are reaped next, with a blocking wait
      continue;
    }
    auto it = running.find(pid);
    if (it == running.end()) continue;
    status[static_cast<std::size_t>(it->second)] = st;
    running.erase(it);
    // The first rank to end (none killed yet) starts the others' grace.
    if (!deadline && !running.empty() && std::none_of(killed.begin(), killed.end(), [](char k) { return k != 0; }))
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s + 10);
  }
  int code = 0;
  for (int r = 0; r < ranks; ++r) {
    const int st = status[static_cast<std::size_t>(r)];
    if (WIFSIGNALED(st)) {
      std::cerr << "retrace: rank " << r << " died by signal " << WTERMSIG(st) << " (" << strsignal(WTERMSIG(st))
                << ")\n";
      code = std::max(code, 1);
    } else if (WEXITSTATUS(st) != 0) {
      std::cerr << "retrace: rank " << r << " exited with code " << WEXITSTATUS(st) << "\n";
      code = std::max(code, WEXITSTATUS(st) == 2 ? 2 : 1);
    }
  }
  return code;
}

}  // namespace retrace::cli
