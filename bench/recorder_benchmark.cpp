// Recorder overhead per training step, the trace codec against torch::save and plain zstd, and
// replay time against the original step. Every figure is a ratio measured in the same run.
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <benchmark/benchmark.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <unistd.h>

namespace retrace {
namespace {

using Clock = std::chrono::steady_clock;

const char* kBenchScenario = R"(
name: bench
model: {type: tiny_gpt, layers: 8, d_model: 64, heads: 4, seq_len: 32, dropout: 0.1}
data: {batch: 8}
training: {optimizer: adamw, lr: 0.0001, segments: 4}
)";

std::string bench_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("retrace_bench_" + std::to_string(::getpid()) + "_" + name)).string();
}

double seconds(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One program per variant, all stepping in lockstep; each iteration times one step of each, in
// rotating order.
void BM_RecorderOverhead(benchmark::State& state) {
  register_builtin_programs();
  struct Variant {
    const char* name;
    std::unique_ptr<ScenarioProgram> program;
    std::unique_ptr<Recorder> recorder;
    double total = 0;
    std::int64_t step = 0;
  };
  std::vector<Variant> variants;
  auto add = [&](const char* name, std::optional<RecorderOptions> options) {
    Variant v{name, std::make_unique<ScenarioProgram>(parse_scenario_text(kBenchScenario, "bench")), nullptr};
    if (options) v.recorder = std::make_unique<Recorder>(bench_path(name), *v.program, *options);
    variants.push_back(std::move(v));
  };
  add("off", std::nullopt);
  add("digest", RecorderOptions{});
  RecorderOptions full;
  full.mode = RecordMode::kFull;
  add("full", full);
  RecorderOptions ring;
  ring.ring = 4;
  add("ring4", ring);

  auto one_step = [](Variant& v) {
    const std::int64_t s = ++v.step;
    const auto batch = v.program->batch(s);
    if (!v.recorder) {
      v.program->step(s, batch, nullptr);
      return;
    }
    ObserverScope scope(*v.recorder);
    v.recorder->begin_step(s, v.program->state(), batch, v.program->lr(), 1.0);
    const StepOutcome o = v.program->step(s, batch, v.recorder.get());
    v.recorder->end_step(s, o, v.program->state());
    // Count the writer thread's work too (compression on a 2-core machine competes with the
    // step), and keep it from spilling into the next variant's timing.
    v.recorder->flush();
  };
  for (Variant& v : variants) one_step(v);  // warm-up
  std::size_t rotate = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < variants.size(); ++i) {
      Variant& v = variants[(i + rotate) % variants.size()];
      const double t = seconds([&] { one_step(v); });
      v.total += t;
      if (v.name == std::string("digest")) state.SetIterationTime(t);
    }
    ++rotate;
  }
  for (Variant& v : variants) {
    if (v.recorder) {
      v.recorder->close();
      const RecorderStats s = v.recorder->stats();
      state.counters[std::string(v.name) + "_KiB_per_step"] = s.bytes / 1024.0 / static_cast<double>(v.step);
      if (s.backpressure_waits) state.counters[std::string(v.name) + "_backpressure"] = s.backpressure_waits;
      std::filesystem::remove(v.recorder->path());
    }
  }
  const double plain = variants[0].total;
  state.counters["plain_ms"] = 1e3 * plain / state.iterations();
  for (std::size_t i = 1; i < variants.size(); ++i) state.counters[std::string(variants[i].name) + "_ratio"] = variants[i].total / plain;
}
BENCHMARK(BM_RecorderOverhead)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(3.0);

// Codec: size and speed of our payload codec against torch::save and zstd without shuffling.
at::Tensor weights(at::ScalarType dtype) {
  torch::manual_seed(0);
  return (torch::randn({1024, 1024}) * 0.02).to(dtype);
}
at::Tensor activations(at::ScalarType dtype) {
  torch::manual_seed(1);
  return at::gelu(torch::randn({1024, 1024})).to(dtype);
}

void codec(benchmark::State& state, const at::Tensor& t, const char* variant, int level = WriterOptions{}.zstd_level) {
  const std::string which = variant;
  std::string encoded;
  double enc = 0, dec = 0;
  at::Tensor out = at::empty_like(t);
  for (auto _ : state) {
    const double enc_before = enc;
    if (which == "torch_save") {
      std::ostringstream os;
      enc += seconds([&] { torch::save(t, os); });
      encoded = os.str();
      std::istringstream is(encoded);
      at::Tensor back;
      dec += seconds([&] { torch::load(back, is); });
      benchmark::DoNotOptimize(back.data_ptr());
    } else {
      const TensorCodec c = which == "retrace_shuffle" ? TensorCodec::kZstdShuffle : TensorCodec::kZstd;
      enc += seconds([&] { encoded = encode_tensor_payload(t, c, level); });
      dec += seconds([&] { decode_tensor_payload(encoded.data(), encoded.size(), c, out); });
    }
    state.SetIterationTime(enc - enc_before);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["ratio_raw_to_stored"] = static_cast<double>(t.nbytes()) / static_cast<double>(encoded.size());
  state.counters["stored_MiB"] = encoded.size() / 1048576.0;
  state.counters["encode_GBps"] = n * t.nbytes() / enc / 1e9;
  state.counters["decode_GBps"] = n * t.nbytes() / dec / 1e9;
}

#define RETRACE_CODEC_BENCH(NAME, TENSOR)                                                   \
  void BM_Codec_##NAME(benchmark::State& s, const char* v) { codec(s, TENSOR, v); }       \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, retrace_shuffle, "retrace_shuffle")->UseManualTime(); \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, zstd_plain, "zstd_plain")->UseManualTime();           \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, torch_save, "torch_save")->UseManualTime();

void BM_CodecLevel_WeightsBF16(benchmark::State& s, int level) { codec(s, weights(at::kBFloat16), "retrace_shuffle", level); }
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_1, 1)->UseManualTime();
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_minus1, -1)->UseManualTime();
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_3, 3)->UseManualTime();

RETRACE_CODEC_BENCH(WeightsF32, weights(at::kFloat))
RETRACE_CODEC_BENCH(WeightsBF16, weights(at::kBFloat16))
RETRACE_CODEC_BENCH(WeightsF16, weights(at::kHalf))
RETRACE_CODEC_BENCH(ActivationsF32, activations(at::kFloat))
RETRACE_CODEC_BENCH(ActivationsBF16, activations(at::kBFloat16))
RETRACE_CODEC_BENCH(ActivationsF16, activations(at::kHalf))

// Replaying a recorded step (open the trace, restore, re-execute, compare) against the step.
void BM_ReplayVsStep(benchmark::State& state) {
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(kBenchScenario, "bench"));
  const std::string path = bench_path("replay");
  {
    RecorderOptions full;
    full.mode = RecordMode::kFull;
    Recorder recorder(path, program, full);
    record_run(program, recorder, 2);
    recorder.close();
  }
  ScenarioProgram plain(parse_scenario_text(kBenchScenario, "bench"));
  double t_step = 0, t_replay = 0;
  std::int64_t s = 0;
  for (auto _ : state) {
    ++s;
    const auto batch = plain.batch(s);
    t_step += seconds([&] { plain.step(s, batch, nullptr); });
    const double r = seconds([&] {
      const TraceReader trace(path);
      auto p = program_from_trace(trace);
      ReplayOptions o;
      o.step = 2;
      if (!Replayer(trace, *p).run(o).reproduced) state.SkipWithError("replay diverged");
    });
    t_replay += r;
    state.SetIterationTime(r);
  }
  state.counters["replay_over_step"] = t_replay / t_step;
  std::filesystem::remove(path);
}
BENCHMARK(BM_ReplayVsStep)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);

}  // namespace
}  // namespace retrace
