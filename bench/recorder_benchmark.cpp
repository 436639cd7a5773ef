// Recorder overhead per training step, the trace codec against torch::save and plain zstd, and
// replay time against the original step. Every figure is a ratio measured in the same run.
#include "alternate.h"

#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/io.h>
#include <retrace/trace.h>

#include "core/tensor_codec.h"
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


const char* kBenchScenario = R"(
name: bench
model: {type: tiny_gpt, layers: 8, d_model: 64, heads: 4, seq_len: 32, dropout: 0.1}
data: {batch: 8}
training: {optimizer: adamw, lr: 0.0001, segments: 4}
)";

// The same model (same 4.9 MB of state) over 2048 tokens per step instead of 256: closer to the
// tokens-per-parameter of real training, where per-byte recorder costs weigh less.
const char* kBench2kTokens = R"(
name: bench-2k-tokens
model: {type: tiny_gpt, layers: 8, d_model: 64, heads: 4, seq_len: 128, dropout: 0.1}
data: {batch: 16}
training: {optimizer: adamw, lr: 0.0001, segments: 4}
)";

// GPU: a GPT large enough to keep an H200 busy (12 layers, d_model 768, 1024 tokens a sequence,
// 8 sequences a step), forward under bf16 autocast.
const char* kGpuGpt12 = R"(
name: gpu-gpt12
model: {type: tiny_gpt, layers: 12, d_model: 768, heads: 12, seq_len: 1024, vocab: 8192, dropout: 0.1}
data: {batch: 8}
training: {optimizer: adamw, lr: 0.0001, segments: 12, device: cuda, precision: bf16}
)";

// GPT-2 small's body on the CPU: 12 blocks, d_model 768, 12 heads, 256 tokens (one sequence) a
// step, dropout 0.1, AdamW, every block a checkpointed segment. The vocabulary is 8192 (GPT-2's is
// 50257), which keeps the untied embedding and LM head at 6.3M parameters each: 98M parameters
// in all, 1.2 GB of state with AdamW's moments. A step takes seconds here, so these run a fixed,
// small number of iterations (bench/README.md).
const char* kGpt2Small = R"(
name: gpt2-small
model: {type: tiny_gpt, layers: 12, d_model: 768, heads: 12, seq_len: 256, vocab: 8192, dropout: 0.1}
data: {batch: 1}
training: {optimizer: adamw, lr: 0.0001, segments: 12}
)";

std::string bench_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("retrace_bench_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

using bench::seconds;

// The recorder's calls on the training thread, timed: the segment events and after_backward
// forwarded to it, begin_step and end_step timed by the caller. What the recorded step costs
// beyond these is the writer thread's share of the cores, the device's digest kernels, and what
// the calls leave behind (caches, allocator).
struct TimedCalls : SegmentObserver, StepMonitor {
  // kStateList: the program's state() that begin_step and end_step are handed (a plain step does
  // not build it).
  enum Call { kStateList, kBeginStep, kSegments, kAfterBackward, kEndStep, kCalls };
  explicit TimedCalls(Recorder& r) : recorder(r) {}
  template <class F>
  void timed(Call call, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    seconds[call] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void on_forward(SegmentEvent& e) override {
    timed(kSegments, [&] { recorder.on_forward(e); });
  }
  void on_recompute(SegmentEvent& e) override {
    timed(kSegments, [&] { recorder.on_recompute(e); });
  }
  void on_backward(SegmentEvent& e) override {
    timed(kSegments, [&] { recorder.on_backward(e); });
  }
  void after_backward(const at::Tensor& loss, const std::vector<NamedTensor>& grads) override {
    timed(kAfterBackward, [&] { recorder.after_backward(loss, grads); });
  }
  double total() const {
    double sum = 0;
    for (double s : seconds) sum += s;
    return sum;
  }
  Recorder& recorder;
  double seconds[kCalls] = {};
};

// A plain program and a recorded one stepping in lockstep, each iteration timing one step of
// each in alternating order. One variant per benchmark, so that no variant's memory traffic
// (full mode writes 11 MiB a step) lands on another's timing.
void BM_RecorderOverhead(benchmark::State& state, const char* variant, const char* scenario) {
  register_builtin_programs();
  const bool cuda = std::string(scenario).find("device: cuda") != std::string::npos;
  if (cuda && !torch::cuda::is_available()) {
    state.SkipWithError("no CUDA device is visible");
    return;
  }
  std::string which = variant;
  // "..._in_runs_of_8": each side runs 8 steps per turn and the recorded side waits for its
  // writer once, at the end of the 8: the writer works while the next steps train, as in a run.
  const std::string runs_suffix = "_in_runs_of_8";
  int run_length = 1;
  if (which.size() > runs_suffix.size() &&
      which.compare(which.size() - runs_suffix.size(), runs_suffix.size(), runs_suffix) == 0) {
    which.resize(which.size() - runs_suffix.size());
    run_length = 8;
  }
  RecorderOptions options;
  if (which == "full" || which == "full_2_encode_threads" || which == "full_cached") options.mode = RecordMode::kFull;
  // The whole trace left in the page cache, as before 2026-12-03 (WriterOptions::page_cache_window).
  if (which == "full_cached") options.writer.page_cache_window = 0;
  if (which == "full_2_encode_threads") options.writer.encode_threads = 2;  // "full": the default (1 on 2 cores)
  if (which.rfind("ring4", 0) == 0) options.ring = 4;
  // "ring4": RingCopy::kAuto, the default. Forced either way: the copy in begin_step on the
  // intra-op threads (as before 2026-12-05), or on the recorder's copier while forward and backward run.
  if (which == "ring4_at_begin") options.ring_copy = RingCopy::kAtBeginStep;
  if (which == "ring4_overlapped") options.ring_copy = RingCopy::kOverlapped;
  // "ring4_every4": the ring's snapshots 4 steps apart (RecorderOptions::ring_every), kAuto.
  if (which == "ring4_every4") options.ring_every = 4;
  // The small records by the writer thread, as before 2026-12-03 (SmallRecords: with no core to
  // spare, kAuto writes them on the training thread).
  if (which == "digest_writer_thread") options.small_records = SmallRecords::kWriterThread;
  ScenarioProgram plain(parse_scenario_text(scenario, "bench"));
  ScenarioProgram recorded(parse_scenario_text(scenario, "bench"));
  Recorder recorder(bench_path(which), recorded, options);
  // On a GPU a step is timed to its completion on the device.
  const auto done = [&] {
    if (cuda) torch::cuda::synchronize();
  };
  std::int64_t plain_step_no = 0, recorded_step_no = 0;
  auto plain_step = [&] {
    for (int i = 0; i < run_length; ++i) {
      ++plain_step_no;
      plain.step(plain_step_no, plain.batch(plain_step_no), nullptr);
    }
    done();
  };
  TimedCalls calls(recorder);
  auto recorded_step = [&] {
    for (int i = 0; i < run_length; ++i) {
      const std::int64_t n = ++recorded_step_no;
      const auto batch = recorded.batch(n);
      ObserverScope scope(calls);
      std::vector<NamedTensor> program_state;
      calls.timed(TimedCalls::kStateList, [&] { program_state = recorded.state(); });
      calls.timed(TimedCalls::kBeginStep, [&] { recorder.begin_step(n, program_state, batch, recorded.lr(), 1.0); });
      const StepOutcome o = recorded.step(n, batch, &calls);
      calls.timed(TimedCalls::kStateList, [&] { program_state = recorded.state(); });
      calls.timed(TimedCalls::kEndStep, [&] { recorder.end_step(n, o, program_state); });
    }
    // Count the writer thread's work too (compression on a 2-core machine competes with the
    // step), and keep it from spilling into the plain step's timing.
    recorder.flush();
    done();
  };
  // Warm-up: the first step's full snapshot, and (ring) until the ring is full and its buffers
  // are reused rather than fresh pages. The first snapshot (parameters only, before AdamW has
  // moments) is smaller than the later ones: the buffer it frees fits none of them, so one more
  // snapshot after the ring is full takes the last fresh buffer (before 2026-12-05 that one fell
  // inside the timed steps: 0.06 of a GPT-2 small step in the ring's figures).
  const int warm_up = options.ring > 0 ? (options.ring + 1) * options.ring_every + 1 : 2;
  while (recorded_step_no < warm_up) {
    plain_step();
    recorded_step();
  }
  double t_plain = 0, t_recorded = 0;
  for (double& s : calls.seconds) s = 0;  // the warm-up's calls are not counted
  bool plain_first = true;
  for (auto _ : state) {
    const auto [p, r] = bench::alternate(plain_first, plain_step, recorded_step);
    t_plain += p;
    t_recorded += r;
    state.SetIterationTime(r / run_length);
  }
  recorder.close();
  const RecorderStats s = recorder.stats();
  state.counters["KiB_per_step"] = s.bytes / 1024.0 / static_cast<double>(recorded_step_no);
  state.counters["plain_ms"] = 1e3 * t_plain / state.iterations() / run_length;
  state.counters["recorded_over_plain"] = t_recorded / t_plain;
  // The recorder's calls on the training thread, as a share of the plain step.
  state.counters["calls_over_plain"] = calls.total() / t_plain;
  state.counters["state_list_over_plain"] = calls.seconds[TimedCalls::kStateList] / t_plain;
  state.counters["begin_step_over_plain"] = calls.seconds[TimedCalls::kBeginStep] / t_plain;
  state.counters["segments_over_plain"] = calls.seconds[TimedCalls::kSegments] / t_plain;
  state.counters["after_backward_over_plain"] = calls.seconds[TimedCalls::kAfterBackward] / t_plain;
  state.counters["end_step_over_plain"] = calls.seconds[TimedCalls::kEndStep] / t_plain;
  if (options.ring > 0) {
    state.counters["ring_overlapped"] =
        static_cast<double>(s.ring_copies_overlapped) / static_cast<double>(std::max<std::int64_t>(s.steps, 1));
  }
  state.counters["by_caller"] =
      static_cast<double>(s.records_by_caller) / static_cast<double>(std::max<std::int64_t>(s.records, 1));
  std::filesystem::remove(recorder.path());
}
BENCHMARK_CAPTURE(BM_RecorderOverhead, digest, "digest", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, digest_writer_thread, "digest_writer_thread", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, ring4, "ring4", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, ring4_at_begin, "ring4_at_begin", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, ring4_overlapped, "ring4_overlapped", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, ring4_every4, "ring4_every4", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, full, "full", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, full_cached, "full_cached", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, full_2_encode_threads, "full_2_encode_threads", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, digest_in_runs_of_8, "digest_in_runs_of_8", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, full_in_runs_of_8, "full_in_runs_of_8", kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
// GPU (named Cuda_gpt12* so that scripts/gpu-check runs them in a process of their own; they skip
// without a GPU). Fixed iteration counts bound the run: full mode writes the whole state (about
// 100 M parameters and AdamW's two moments, ~1.2 GB before compression) on each of its 2 + 3 steps.
BENCHMARK_CAPTURE(BM_RecorderOverhead, Cuda_gpt12_digest, "digest", kGpuGpt12)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(12);
// The same in runs of 8 steps, the writer waited for once a run: what the training thread pays,
// without the per-step wait for the writer that the row above counts.
BENCHMARK_CAPTURE(BM_RecorderOverhead, Cuda_gpt12_digest_in_runs_of_8, "digest_in_runs_of_8", kGpuGpt12)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(BM_RecorderOverhead, Cuda_gpt12_full, "full", kGpuGpt12)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_digest, "digest", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_ring4, "ring4", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(8);
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_ring4_at_begin, "ring4_at_begin", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(8);
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_ring4_overlapped, "ring4_overlapped", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(8);
// The snapshot every 4th step: 8 iterations hold 2 of them.
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_ring4_every4, "ring4_every4", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(8);
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_full, "full", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(BM_RecorderOverhead, gpt2_small_full_cached, "full_cached", kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(BM_RecorderOverhead, digest_2k_tokens, "digest", kBench2kTokens)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(6.0);
BENCHMARK_CAPTURE(BM_RecorderOverhead, ring4_2k_tokens, "ring4", kBench2kTokens)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(6.0);

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
      const bool fast = which == "retrace_fast";
      const TensorCodec c = fast                       ? TensorCodec::kBloscBitshuffleLz4
                            : which == "retrace_small" ? TensorCodec::kZstdShuffle
                                                       : TensorCodec::kZstd;
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

// retrace_fast: the default (Blosc bit-shuffle + LZ4); retrace_small:
// byte shuffle + zstd; zstd_plain: zstd without the shuffle.
#define RETRACE_CODEC_BENCH(NAME, TENSOR)                                              \
  void BM_Codec_##NAME(benchmark::State& s, const char* v) { codec(s, TENSOR, v); }    \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, retrace_fast, "retrace_fast")->UseManualTime();   \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, retrace_small, "retrace_small")->UseManualTime(); \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, zstd_plain, "zstd_plain")->UseManualTime();       \
  BENCHMARK_CAPTURE(BM_Codec_##NAME, torch_save, "torch_save")->UseManualTime();

void BM_CodecLevel_WeightsBF16(benchmark::State& s, int level) {
  codec(s, weights(at::kBFloat16), "retrace_small", level);
}
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_minus20, -20)->UseManualTime();
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_minus5, -5)->UseManualTime();
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_1, 1)->UseManualTime();
BENCHMARK_CAPTURE(BM_CodecLevel_WeightsBF16, level_3, 3)->UseManualTime();

RETRACE_CODEC_BENCH(WeightsF32, weights(at::kFloat))
RETRACE_CODEC_BENCH(WeightsBF16, weights(at::kBFloat16))
RETRACE_CODEC_BENCH(WeightsF16, weights(at::kHalf))
RETRACE_CODEC_BENCH(ActivationsF32, activations(at::kFloat))
RETRACE_CODEC_BENCH(ActivationsBF16, activations(at::kBFloat16))
RETRACE_CODEC_BENCH(ActivationsF16, activations(at::kHalf))

// The codec goal in one figure: our default codec against torch::save on the same tensor,
// alternating every iteration (order flipped each time) so that noise hits both alike.
void BM_FastCodecVsTorchSave(benchmark::State& state, at::ScalarType dtype) {
  const at::Tensor t = weights(dtype);
  double ours = 0, theirs = 0;
  std::size_t our_bytes = 0, their_bytes = 0;
  bool ours_first = true;
  for (auto _ : state) {
    const auto [o, t_save] = bench::alternate(
        ours_first, [&] { our_bytes = encode_tensor_payload(t, TensorCodec::kBloscBitshuffleLz4).size(); },
        [&] {
          std::ostringstream os;
          torch::save(t, os);
          their_bytes = os.str().size();
        });
    ours += o;
    theirs += t_save;
    state.SetIterationTime(0.001);
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["encode_time_ours_over_torch_save"] = ours / theirs;
  state.counters["size_torch_save_over_ours"] = static_cast<double>(their_bytes) / static_cast<double>(our_bytes);
  state.counters["ours_GBps"] = n * t.nbytes() / ours / 1e9;
  state.counters["torch_save_GBps"] = n * t.nbytes() / theirs / 1e9;
}
BENCHMARK_CAPTURE(BM_FastCodecVsTorchSave, bf16_weights, at::kBFloat16)->UseManualTime()->MinTime(2.0);
BENCHMARK_CAPTURE(BM_FastCodecVsTorchSave, fp16_weights, at::kHalf)->UseManualTime()->MinTime(2.0);
BENCHMARK_CAPTURE(BM_FastCodecVsTorchSave, fp32_weights, at::kFloat)->UseManualTime()->MinTime(2.0);

// Durable writes: encode, write to a file and fsync, as a trace writer (or a checkpoint saver)
// must. The codec's smaller output competes with torch::save's faster encoding.
void BM_DurableWrite(benchmark::State& state, const char* variant) {
  const std::string which = variant;
  const at::Tensor t = weights(at::kBFloat16);
  const std::string path = bench_path(std::string("durable_") + variant);
  double total = 0;
  std::size_t bytes = 0;
  for (auto _ : state) {
    const double dt = seconds([&] {
      std::string encoded;
      if (which == "torch_save") {
        std::ostringstream os;
        torch::save(t, os);
        encoded = os.str();
      } else {
        encoded = encode_tensor_payload(
            t, which == "retrace_small" ? TensorCodec::kZstdShuffle : TensorCodec::kBloscBitshuffleLz4);
      }
      bytes = encoded.size();
      auto file = io::posix_file_system().create(path);
      file->append(encoded.data(), encoded.size());
      file->sync();
      file->close();
    });
    total += dt;
    state.SetIterationTime(dt);
  }
  state.counters["GBps_of_tensor"] = static_cast<double>(state.iterations()) * t.nbytes() / total / 1e9;
  state.counters["file_MiB"] = bytes / 1048576.0;
  std::filesystem::remove(path);
}
BENCHMARK_CAPTURE(BM_DurableWrite, retrace_fast_bf16_weights, "retrace_fast")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DurableWrite, retrace_small_bf16_weights, "retrace_small")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_DurableWrite, torch_save_bf16_weights, "torch_save")
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Files that keep nothing: BM_WriterEncodeThreads times the writer's own work, not the page cache.
class DiscardFile : public io::WritableFile {
 public:
  void append(const void*, std::size_t n) override { size_ += n; }
  void sync() override {}
  void close() override {}
  std::uint64_t size() const override { return size_; }

 private:
  std::uint64_t size_ = 0;
};
class DiscardFileSystem : public io::FileSystem {
 public:
  std::unique_ptr<io::ReadableFile> open(const std::string& path) override {
    throw Error("DiscardFileSystem: nothing to read at " + path);
  }
  std::unique_ptr<io::WritableFile> create(const std::string&) override { return std::make_unique<DiscardFile>(); }
  void rename(const std::string&, const std::string&) override {}
  void sync_directory(const std::string&) override {}
  void remove(const std::string&) override {}
};

// The writer's encode threads (WriterOptions::encode_threads): a full-mode-like record -- two of
// GPT-2 small's blocks' weights and AdamW moments (fp32, 24 tensors, 162 MiB) -- appended again
// and again by a writer with one encode thread and by one with `threads`, alternating, each writer
// (with its pool) made once, as the recorder's is. The files keep nothing (DiscardFileSystem):
// what is timed is the writer's work -- hashing, encoding, moving the pieces together, the
// record's checksum -- which the threads share; the write into the page cache is the kernel's.
void BM_WriterEncodeThreads(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  torch::manual_seed(0);
  std::vector<TensorToWrite> record;
  const std::vector<std::vector<std::int64_t>> shapes = {{2304, 768}, {768, 768}, {3072, 768}, {768, 3072}};
  for (int block = 0; block < 2; ++block) {
    for (const auto& shape : shapes) {
      record.push_back({"w", torch::randn(shape) * 0.02, true, std::nullopt});
      record.push_back({"exp_avg", torch::randn(shape) * 1e-4, true, std::nullopt});
      record.push_back({"exp_avg_sq", torch::rand(shape) * 1e-8, true, std::nullopt});
    }
  }
  DiscardFileSystem discard;
  WriterOptions one_options, many_options;
  one_options.fs = many_options.fs = &discard;
  one_options.encode_threads = 1;
  many_options.encode_threads = threads;
  const nlohmann::json header = {{"program", {{"name", "bench"}, {"config", ""}}}};
  TraceWriter one("one", header, one_options), many("many", header, many_options);
  const nlohmann::json meta = {{"step", 1}, {"full", true}};
  double t_one = 0, t_many = 0;
  bool one_first = true;
  for (auto _ : state) {
    const auto [a, b] = bench::alternate(
        one_first, [&] { one.append(RecordType::kStepBegin, meta, record); },
        [&] { many.append(RecordType::kStepBegin, meta, record); });
    t_one += a;
    t_many += b;
    state.SetIterationTime(a);
  }
  if (one.bytes_written() != many.bytes_written()) state.SkipWithError("the two writers wrote different sizes");
  std::size_t raw = 0;
  for (const TensorToWrite& w : record) raw += w.tensor.nbytes();
  state.counters["many_over_one"] = t_many / t_one;
  state.counters["one_GBps"] = static_cast<double>(state.iterations()) * raw / t_one / 1e9;
  state.counters["many_GBps"] = static_cast<double>(state.iterations()) * raw / t_many / 1e9;
  state.counters["MiB_raw"] = raw / 1048576.0;
}
BENCHMARK(BM_WriterEncodeThreads)->Arg(2)->Arg(4)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(3.0);

// A 2-step full-mode trace of `scenario`, at a benchmark path named `name`.
std::string record_two_full_steps(const char* scenario, const std::string& name) {
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(scenario, "bench"));
  const std::string path = bench_path(name);
  RecorderOptions full;
  full.mode = RecordMode::kFull;
  Recorder recorder(path, program, full);
  record_run(program, recorder, 2);
  recorder.close();
  return path;
}

// Replaying a recorded step (open the trace, restore, re-execute, compare) against the step.
void BM_ReplayVsStep(benchmark::State& state, const char* scenario) {
  const std::string path = record_two_full_steps(scenario, "replay");
  ScenarioProgram plain(parse_scenario_text(scenario, "bench"));
  double t_step = 0, t_replay = 0, t_open = 0, t_build = 0;
  std::int64_t s = 0;
  for (auto _ : state) {
    ++s;
    const auto batch = plain.batch(s);
    t_step += seconds([&] { plain.step(s, batch, nullptr); });
    const auto t0 = std::chrono::steady_clock::now();
    const TraceReader trace(path);
    const auto t1 = std::chrono::steady_clock::now();
    auto p = program_from_trace(trace, BuildFor::kReplay);
    const auto t2 = std::chrono::steady_clock::now();
    ReplayOptions o;
    o.step = 2;
    if (!Replayer(trace, *p).run(o).reproduced) state.SkipWithError("replay diverged");
    const auto t3 = std::chrono::steady_clock::now();
    t_open += std::chrono::duration<double>(t1 - t0).count();
    t_build += std::chrono::duration<double>(t2 - t1).count();
    const double r = std::chrono::duration<double>(t3 - t0).count();
    t_replay += r;
    state.SetIterationTime(r);
  }
  state.counters["replay_over_step"] = t_replay / t_step;
  state.counters["open_over_step"] = t_open / t_step;
  state.counters["build_over_step"] = t_build / t_step;
  state.counters["step_ms"] = 1e3 * t_step / s;
  state.counters["trace_MiB"] = static_cast<double>(std::filesystem::file_size(path)) / (1 << 20);
  std::filesystem::remove(path);
}
BENCHMARK_CAPTURE(BM_ReplayVsStep, tiny_gpt, kBenchScenario)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_ReplayVsStep, gpt2_small, kGpt2Small)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

// Opening a trace: every record's checksum verified, its metadata and tensor table parsed and
// checked (a 2-step full-mode trace of the tiny GPT, 20 MB). Replay pays this once per trace.
void BM_TraceOpen(benchmark::State& state) {
  const std::string path = record_two_full_steps(kBenchScenario, "open");
  std::size_t records = 0;
  for (auto _ : state) {
    const TraceReader trace(path);
    records = trace.records().size();
    benchmark::DoNotOptimize(records);
  }
  state.counters["records"] = static_cast<double>(records);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(std::filesystem::file_size(path)));
  std::filesystem::remove(path);
}
BENCHMARK(BM_TraceOpen)->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace
}  // namespace retrace
