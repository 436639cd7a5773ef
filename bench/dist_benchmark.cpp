// Data-parallel recording overhead: 2 ranks (this process and a peer it starts, the same binary
// with RANK=1), tiny GPT at 256 tokens per rank and step, gradients all-reduced over Gloo. Each
// rank trains two programs in lockstep, each in its own group: one plain, one recorded (digest
// mode, or the flight ring of 4); one step of each per iteration, their order flipped each time
// (alternate.h). Fixed iteration counts, so that both ranks run the same collectives.
#include "alternate.h"

#include <retrace/collectives.h>
#include <retrace/recorder.h>
#include <retrace/scenario.h>
#include <retrace/trainer.h>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <spawn.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace retrace {
namespace {

const char* kDpScenario = R"(
name: bench-dp
world_size: 2
model: {type: tiny_gpt, layers: 8, d_model: 64, heads: 4, seq_len: 32, dropout: 0.1}
data: {batch: 8}
training: {optimizer: adamw, lr: 0.0001, segments: 4}
)";

constexpr int kIterations = 60;

// Joins a group of its own: each program's store is its own file in `dir`.
std::unique_ptr<ScenarioProgram> join(const std::string& dir, const std::string& name) {
  ::setenv("RETRACE_STORE", (dir + "/" + name + ".store").c_str(), 1);
  return std::make_unique<ScenarioProgram>(parse_scenario_text(kDpScenario, "bench"));
}

void BM_DataParallelRecording(benchmark::State& state, const char* variant) {
  register_builtin_programs();
  const bool peer = std::getenv("RANK") != nullptr;
  const std::string dir = peer ? std::getenv("RETRACE_BENCH_DIR")
                               : (std::filesystem::temp_directory_path() /
                                  ("retrace_bench_dp_" + std::to_string(::getpid()) + "_" + variant))
                                     .string();
  pid_t child = -1;
  if (!peer) {
    std::filesystem::create_directories(dir);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("LOCAL_WORLD_SIZE", "2", 1);  // both ranks on this host, as torchrun says
    ::setenv("RANK", "0", 1);
    ::setenv("RETRACE_RUN_ID", "bench", 1);
    const std::string filter = std::string("--benchmark_filter=BM_DataParallelRecording/") + variant + "/";
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e) env_s.push_back(*e);
    env_s.push_back("RETRACE_BENCH_DIR=" + dir);
    for (std::string& s : env_s) {
      if (s == "RANK=0") s = "RANK=1";
    }
    std::vector<char*> envp, argv;
    for (std::string& s : env_s) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string self = "retrace_bench", quiet = "--benchmark_out=/dev/null";
    std::string filter_arg = filter;
    argv = {self.data(), filter_arg.data(), quiet.data(), nullptr};
    posix_spawn_file_actions_t quiet_peer;  // rank 0 reports; the peer's own report goes nowhere
    posix_spawn_file_actions_init(&quiet_peer);
    posix_spawn_file_actions_addopen(&quiet_peer, 1, "/dev/null", O_WRONLY, 0);
    const int rc = ::posix_spawn(&child, "/proc/self/exe", &quiet_peer, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&quiet_peer);
    if (rc != 0) {
      state.SkipWithError("cannot start the peer rank");
      return;
    }
  }
  at::set_num_threads(1);  // two ranks on this machine's cores
  {
    auto plain = join(dir, "plain");
    auto recorded = join(dir, "recorded");
    RecorderOptions options;
    if (std::string(variant) == "ring4") options.ring = 4;
    // The small records by the writer thread, as before 2026-12-03 (SmallRecords).
    if (std::string(variant) == "digest_writer_thread") options.small_records = SmallRecords::kWriterThread;
    options.state_check = false;
    Recorder recorder(dir + "/rank" + (peer ? "1" : "0") + ".trace", *recorded, options);
    std::int64_t step = 0;
    auto plain_step = [&] { plain->step(step, plain->batch(step), nullptr); };
    auto recorded_step = [&] {
      const auto batch = recorded->batch(step);
      ObserverScope scope(recorder);
      CollectiveObserverScope collectives(recorder);
      recorder.begin_step(step, recorded->state(), batch, recorded->lr(), 1.0);
      const StepOutcome o = recorded->step(step, batch, &recorder);
      recorder.end_step(step, o, recorded->state());
      recorder.flush();
    };
    for (int i = 0; i < 2; ++i) {  // warm-up, the first step's full snapshot included
      ++step;
      plain_step();
      recorded_step();
    }
    double t_plain = 0, t_recorded = 0;
    bool plain_first = true;
    for (auto _ : state) {
      ++step;
      const auto [p, r] = bench::alternate(plain_first, plain_step, recorded_step);
      t_plain += p;
      t_recorded += r;
      state.SetIterationTime(r);
    }
    recorder.close();
    state.counters["plain_ms"] = 1e3 * t_plain / static_cast<double>(state.iterations());
    state.counters["recorded_over_plain"] = t_recorded / t_plain;
    state.counters["KiB_per_step"] = recorder.stats().bytes / 1024.0 / static_cast<double>(step);
    state.counters["by_caller"] = static_cast<double>(recorder.stats().records_by_caller) /
                                  static_cast<double>(std::max<std::int64_t>(recorder.stats().records, 1));
  }
  if (!peer) {
    int status = 0;
    ::waitpid(child, &status, 0);
    ::unsetenv("RANK");
    ::unsetenv("WORLD_SIZE");
    ::unsetenv("LOCAL_WORLD_SIZE");
    for (const auto& e : std::filesystem::directory_iterator(dir)) ::unlink(e.path().c_str());
    ::rmdir(dir.c_str());
  }
}
BENCHMARK_CAPTURE(BM_DataParallelRecording, digest, "digest")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(kIterations);
BENCHMARK_CAPTURE(BM_DataParallelRecording, digest_writer_thread, "digest_writer_thread")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(kIterations);
BENCHMARK_CAPTURE(BM_DataParallelRecording, ring4, "ring4")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(kIterations);

}  // namespace
}  // namespace retrace
