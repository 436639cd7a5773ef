// Record then replay: bitwise reproduction in digest and full modes, the first divergence of a
// perturbed trace, the flight ring of a run forced to NaN and the op that went non-finite first.
#include <retrace/diagnose.h>
#include <retrace/gtest.h>
#include <retrace/recorder.h>
#include <retrace/records.h>
#include <retrace/replayer.h>
#include <retrace/runner.h>
#include <retrace/trainer.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace retrace {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("retrace_replay_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

const char* kGpt = R"(
name: gpt
model: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, dropout: 0.1}
data: {batch: 4, seed: 3}
training: {steps: 3, optimizer: adamw, lr: 0.001, segments: 2}
)";

const char* kLstm = R"(
name: lstm
model: {type: lstm, layers: 2, hidden: 32, dropout: 0.1}
training: {steps: 3, optimizer: adam, lr: 0.002, segments: 2}
)";

const char* kExplode = R"(
name: explode
model: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, dropout: 0.1}
training: {steps: 20, optimizer: sgd, lr: 50000, segments: 2}
)";

struct Recorded {
  std::string path;
  std::vector<StepOutcome> outcomes;
  RecorderStats stats;
};

Recorded record(const char* yaml, const std::string& name, RecorderOptions options, std::int64_t steps = -1) {
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(yaml, name));
  Recorded r;
  r.path = temp_path(name);
  Recorder recorder(r.path, program, options);
  r.outcomes = record_run(program, recorder, steps > 0 ? steps : program.default_steps());
  recorder.close();
  r.stats = recorder.stats();
  return r;
}

ReplayResult replay(const std::string& path, ReplayOptions options = {}) {
  const TraceReader trace(path);
  std::unique_ptr<Program> program = program_from_trace(trace);
  return Replayer(trace, *program).run(options);
}

// Re-encodes a trace, letting `edit_header` change the header and `edit` the records.
void rewrite(const std::string& from, const std::string& to,
             const std::function<void(Record&, std::vector<TensorToWrite>&)>& edit,
             const std::function<void(nlohmann::json&)>& edit_header = nullptr) {
  const TraceReader in(from);
  nlohmann::json header = in.header();
  header.erase("format_version");
  header.erase("writer");
  if (edit_header) edit_header(header);
  TraceWriter out(to, header);
  for (std::size_t i = 0; i < in.records().size(); ++i) {
    Record rec = in.read(i);
    std::vector<TensorToWrite> tensors;
    for (const TensorEntry& e : rec.tensors) {
      if (e.has_data()) {
        tensors.push_back({e.name, in.decode(rec, e), true, std::nullopt});
      } else {
        TensorToWrite w;
        w.name = e.name;
        w.digest = e.digest;
        w.dtype = e.dtype;
        w.shape = e.shape;
        tensors.push_back(std::move(w));
      }
    }
    edit(rec, tensors);
    rec.meta.erase("tensors");
    out.append(rec.type, rec.meta, tensors);
  }
  out.close();
}

// diagnose on a trace: the recorded failure comes back from the replayed state (persistent) and
// loss scaling or fp32 avoid it. The same trace with the injection taken out of its program
// config no longer fails when the step is re-executed: transient.
TEST(Diagnose, TraceFailureIsPersistentAndWithoutItsCauseTransient) {
  ScenarioSpec spec = load_scenario("builtin:fp16-overflow-loss-scaling-off");
  spec.expect = ExpectSpec{};
  spec.origin = "test";
  register_builtin_programs();
  ScenarioProgram program(spec);
  const std::string path = temp_path("diagnose");
  {
    Recorder recorder(path, program);
    record_run(program, recorder, spec.training.steps);
    recorder.close();
  }
  const Diagnosis d = diagnose_trace(path, DiagnoseOptions{3, 1});
  EXPECT_EQ(d.failing_step, 4);
  EXPECT_EQ(d.classification.kind, "persistent") << d.classification.detail;
  EXPECT_EQ(d.from_step, 3);
  EXPECT_EQ(d.to_step, 5);
  bool scaling_fixes = false;
  for (const VariantResult& v : d.variants) scaling_fixes = scaling_fixes || (v.name == "loss scaling" && v.fixes);
  EXPECT_TRUE(scaling_fixes) << d.report();

  const std::string cured = temp_path("diagnose-cured");
  rewrite(path, cured, [](Record&, std::vector<TensorToWrite>&) {}, [&](nlohmann::json& h) {
    ScenarioSpec clean = spec;
    clean.injections.clear();
    h["program"]["config"] = to_yaml(clean);
  });
  const Diagnosis t = diagnose_trace(cured, DiagnoseOptions{3, 1});
  EXPECT_EQ(t.classification.kind, "transient") << t.classification.detail;
  fs::remove(path);
  fs::remove(cured);
}

// A non-finite step that a defense skipped does not end the replay: it goes on verifying every
// later step, and says which faults were injected.
TEST(Replay, ContinuesPastAStepADefenseSkipped) {
  ScenarioSpec spec = load_scenario("builtin:grad-nan-skip");
  spec.expect = ExpectSpec{};
  register_builtin_programs();
  ScenarioProgram program(spec);
  const std::string path = temp_path("handled");
  {
    Recorder recorder(path, program);
    record_run(program, recorder, spec.training.steps, /*stop_on_nonfinite=*/false);
    recorder.close();
  }
  const ReplayResult r = replay(path);
  EXPECT_TRUE(r.reproduced);
  EXPECT_EQ(r.to_step, spec.training.steps);  // not 3, the skipped step
  bool tagged = false;
  for (const std::string& n : r.notes) tagged = tagged || n.find("step 3 carries injected faults (not real ones): grad_nonfinite") == 0;
  EXPECT_TRUE(tagged);
  fs::remove(path);
}

// I/O faults (LevelDB's fault-injecting Env is the model): the Nth file operation -- create,
// append, sync, rename, directory sync -- fails with EIO or ENOSPC, an append failing halfway
// (a short write). For N = 1, 2, ... until a run completes: the failure surfaces as one clear
// retrace::Error, no partial file is ever presented as a finished trace, and whatever is left in
// PATH.incomplete reads as a (truncated) trace or fails with a typed error -- never a crash.
class FaultyFileSystem : public io::FileSystem {
 public:
  explicit FaultyFileSystem(int fail_at) : fail_at_(fail_at) {}
  int operations() const { return count_; }
  bool fired() const { return fired_; }
  std::uint64_t synced_bytes() const { return synced_bytes_; }  // the file's size at its last good fsync
  int good_syncs() const { return good_syncs_; }

  std::unique_ptr<io::WritableFile> create(const std::string& path) override {
    hit("create " + path);
    struct File : io::WritableFile {
      FaultyFileSystem* fs;
      std::unique_ptr<io::WritableFile> f;
      void append(const void* d, std::size_t n) override {
        if (fs->next()) {
          f->append(d, n / 2);  // a short write, then the error
          fs->fired_ = true;
          throw Error("injected ENOSPC: no space left on device (append of " + std::to_string(n) + " bytes)");
        }
        f->append(d, n);
      }
      void sync() override {
        fs->hit("fsync");
        f->sync();
        fs->synced_bytes_ = f->size();
        ++fs->good_syncs_;
      }
      void close() override { f->close(); }
      std::uint64_t size() const override { return f->size(); }
    };
    auto file = std::make_unique<File>();
    file->fs = this;
    file->f = io::posix_file_system().create(path);
    return file;
  }
  void rename(const std::string& a, const std::string& b) override {
    hit("rename");
    io::posix_file_system().rename(a, b);
  }
  void sync_directory(const std::string& d) override {
    hit("directory fsync");
    io::posix_file_system().sync_directory(d);
  }
  void remove(const std::string& p) override { io::posix_file_system().remove(p); }
  std::unique_ptr<io::ReadableFile> open(const std::string& p) override { return io::posix_file_system().open(p); }

 private:
  bool next() { return ++count_ == fail_at_; }
  void hit(const std::string& what) {
    if (next()) {
      fired_ = true;
      throw Error("injected EIO: input/output error on " + what);
    }
  }
  int fail_at_;
  int count_ = 0;
  bool fired_ = false;
  std::uint64_t synced_bytes_ = 0;
  int good_syncs_ = 0;
};

TEST(IoFaults, EveryFailingOperationIsReportedAndNoPartialTraceLooksFinished) {
  register_builtin_programs();
  int runs = 0;
  for (int n = 1; n < 500; ++n) {
    SCOPED_TRACE("failing operation " + std::to_string(n));
    FaultyFileSystem faulty(n);
    RecorderOptions options;
    options.mode = RecordMode::kFull;
    options.writer.fs = &faulty;
    ScenarioProgram program(parse_scenario_text(kGpt, "io"));
    const std::string path = temp_path("io_" + std::to_string(n));
    std::string error;
    try {
      Recorder recorder(path, program, options);
      record_run(program, recorder, 2);
      recorder.close();
    } catch (const Error& e) {
      error = e.what();
    }
    ++runs;
    if (!faulty.fired()) {  // every operation of a whole run succeeded: done
      EXPECT_TRUE(error.empty()) << error;
      EXPECT_TRUE(TraceReader(path).complete());
      fs::remove(path);
      break;
    }
    EXPECT_NE(error.find("injected"), std::string::npos) << "the failure was not reported: '" << error << "'";
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
    if (fs::exists(path)) {
      // Only a failing directory fsync comes after the rename: the file is then whole.
      const TraceReader finished(path);
      EXPECT_TRUE(finished.complete()) << "a partial trace was presented as finished";
      EXPECT_FALSE(finished.truncated());
      fs::remove(path);
    }
    if (fs::exists(path + ".incomplete")) {
      try {
        // Whole content (the failure was the final fsync or the rename) or a truncated tail,
        // either way still named .incomplete; reading it must not crash.
        const TraceReader left(path + ".incomplete");
        if (left.complete()) {
          EXPECT_TRUE(error.find("fsync") != std::string::npos || error.find("rename") != std::string::npos) << error;
        }
      } catch (const Error&) {
        // A typed error (e.g. the header itself was cut) is an acceptable answer too.
      }
      fs::remove(path + ".incomplete");
    }
  }
  EXPECT_GT(runs, 10);  // a two-step full-mode run does dozens of file operations
}

// The same faults under OnWriteError::kContinue: training runs every step whatever fails,
// stats().write_error says what did, no partial file is presented as finished, and a crash right
// after the failure -- everything not fsynced lost -- still leaves every write-ahead step readable.
TEST(IoFaults, UnderContinueTrainingGoesOnAndSyncedStepsSurviveLosingUnsyncedData) {
  register_builtin_programs();
  int runs = 0;
  for (int n = 1; n < 500; ++n) {
    SCOPED_TRACE("failing operation " + std::to_string(n));
    FaultyFileSystem faulty(n);
    RecorderOptions options;
    options.mode = RecordMode::kFull;
    options.write_ahead = true;  // an fsync after every step_begin
    options.on_write_error = OnWriteError::kContinue;
    options.writer.fs = &faulty;
    ScenarioProgram program(parse_scenario_text(kGpt, "io"));
    const std::string path = temp_path("io_continue_" + std::to_string(n));
    std::vector<StepOutcome> outcomes;
    RecorderStats stats;
    std::unique_ptr<Recorder> recorder;
    try {
      recorder = std::make_unique<Recorder>(path, program, options);
    } catch (const Error& e) {
      // Creating the trace (file and header record) fails at once, whatever the policy: a
      // recorder that never started is a configuration error to see before training.
      EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
      fs::remove(path + ".incomplete");
      ++runs;
      continue;
    }
    outcomes = record_run(program, *recorder, 3);  // never throws for a write failure
    recorder->close();
    stats = recorder->stats();
    recorder.reset();
    ++runs;
    ASSERT_EQ(outcomes.size(), 3u) << "training stopped";
    EXPECT_TRUE(program.defenses()->parameters_finite());
    if (!faulty.fired()) {
      EXPECT_TRUE(stats.write_error.empty()) << stats.write_error;
      EXPECT_TRUE(TraceReader(path).complete());
      fs::remove(path);
      break;
    }
    EXPECT_NE(stats.write_error.find("injected"), std::string::npos) << "'" << stats.write_error << "'";
    if (fs::exists(path)) {  // only when the directory fsync after the rename failed
      EXPECT_NE(stats.write_error.find("directory fsync"), std::string::npos) << stats.write_error;
      EXPECT_TRUE(TraceReader(path).complete());
      fs::remove(path);
      continue;
    }
    const std::string left = path + ".incomplete";
    if (!fs::exists(left)) continue;  // the create itself failed
    // A crash now: whatever was not fsynced is gone.
    fs::resize_file(left, faulty.synced_bytes());
    if (faulty.good_syncs() == 0) {
      fs::remove(left);
      continue;
    }
    const TraceReader r(left);
    int step_begins = 0;
    for (std::size_t i = 0; i < r.records().size(); ++i) {
      const Record rec = r.read(i);
      for (const TensorEntry& e : rec.tensors) {
        if (e.has_data()) r.decode(rec, e);  // every surviving record decodes
      }
      step_begins += rec.type == RecordType::kStepBegin;
    }
    EXPECT_GE(step_begins, std::min(faulty.good_syncs(), 3)) << "a step that was fsynced was lost";
    fs::remove(left);
  }
  EXPECT_GT(runs, 10);
}

class ModesAndModels : public ::testing::TestWithParam<std::tuple<const char*, RecordMode>> {};

TEST_P(ModesAndModels, RecordThenReplayIsBitwise) {
  const auto [yaml, mode] = GetParam();
  RecorderOptions options;
  options.mode = mode;
  const Recorded rec = record(yaml, mode == RecordMode::kFull ? "full" : "digest", options);
  ASSERT_EQ(rec.outcomes.size(), 3u);
  // From step 1: every step re-executed and compared.
  ReplayOptions all;
  all.from = 1;
  const ReplayResult result = replay(rec.path, all);
  EXPECT_TRUE(result.reproduced) << (result.first_divergence ? result.first_divergence->message() : "");
  EXPECT_EQ(result.from_step, 1);
  EXPECT_EQ(result.to_step, 3);
  EXPECT_FALSE(result.first_nonfinite.has_value());
  // By default from the nearest full snapshot: step 1 in digest mode, the target in full mode.
  const ReplayResult nearest = replay(rec.path);
  EXPECT_TRUE(nearest.reproduced);
  EXPECT_EQ(nearest.from_step, mode == RecordMode::kFull ? 3 : 1);
  // Any recorded step can be the target.
  ReplayOptions two;
  two.step = 2;
  EXPECT_TRUE(replay(rec.path, two).reproduced);
  fs::remove(rec.path);
}

INSTANTIATE_TEST_SUITE_P(Replay, ModesAndModels,
                         ::testing::Combine(::testing::Values(kGpt, kLstm),
                                            ::testing::Values(RecordMode::kDigest, RecordMode::kFull)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == kGpt ? "TinyGpt" : "Lstm") +
                                  (std::get<1>(info.param) == RecordMode::kFull ? "Full" : "Digest");
                         });

TEST(Replay, FullModeReplaysAnyStepFromItsOwnSnapshot) {
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  const Recorded rec = record(kGpt, "anystep", options);
  ReplayOptions three;
  three.step = 3;
  const ReplayResult r = replay(rec.path, three);
  EXPECT_TRUE(r.reproduced);
  EXPECT_EQ(r.from_step, 3);  // its own full step_begin, not step 1
  fs::remove(rec.path);
}

TEST(Replay, SampledSnapshotsAnchorTheReplay) {
  RecorderOptions options;
  options.every = 2;
  const Recorded rec = record(kGpt, "sampled", options, 4);
  ReplayOptions three;
  three.step = 3;
  const ReplayResult r = replay(rec.path, three);
  EXPECT_TRUE(r.reproduced);
  EXPECT_EQ(r.from_step, 2);
  fs::remove(rec.path);
}

// Negative control: one changed parameter element is caught at the segment that uses it.
class Perturbed : public ::testing::TestWithParam<RecordMode> {};
TEST_P(Perturbed, OneParameterElementDivergesAtItsSegmentAndPhase) {
  RecorderOptions options;
  options.mode = GetParam();
  const Recorded rec = record(kGpt, "perturb_src", options, 2);
  const std::string copy = temp_path("perturbed");
  rewrite(rec.path, copy, [](Record& r, std::vector<TensorToWrite>& tensors) {
    if (r.type != RecordType::kStepBegin || r.meta["step"] != 1) return;
    for (TensorToWrite& t : tensors) {
      if (t.name == "state.param.block2.fc.weight") {
        t.tensor = t.tensor.clone();
        t.tensor.view(-1)[5] += 0.25;
      }
    }
  });
  ReplayOptions first_step;
  first_step.step = 1;
  const ReplayResult r = replay(copy, first_step);
  EXPECT_FALSE(r.reproduced);
  ASSERT_TRUE(r.first_divergence.has_value());
  const Divergence& d = *r.first_divergence;
  EXPECT_EQ(d.step, 1);
  EXPECT_EQ(d.segment, "block2..block3");
  EXPECT_EQ(d.phase, "forward");
  EXPECT_EQ(d.tensor, "output.0");
  EXPECT_NE(d.recorded, d.replayed);
  EXPECT_EQ(d.diff.has_value(), GetParam() == RecordMode::kFull);  // values only in full mode
  if (d.diff) EXPECT_GT(d.diff->differing, 0);
  fs::remove(rec.path);
  fs::remove(copy);
}
// A recorded tensor the replay does not produce is a divergence too (e.g. an optimizer state the
// replayed program lost).
TEST(Replay, RecordedTensorMissingFromTheReplayDiverges) {
  const Recorded rec = record(kGpt, "extra_src", {}, 2);
  const std::string copy = temp_path("extra");
  rewrite(rec.path, copy, [](Record& r, std::vector<TensorToWrite>& tensors) {
    if (r.type == RecordType::kStepEnd && r.meta["step"] == 1) {
      tensors.push_back(TensorToWrite::digest_only("state.optim.ghost.exp_avg", torch::zeros({2}), digest(torch::zeros({2}))));
    }
  });
  const ReplayResult r = replay(copy);
  ASSERT_TRUE(r.first_divergence.has_value());
  EXPECT_EQ(r.first_divergence->step, 1);
  EXPECT_EQ(r.first_divergence->phase, "optimizer");
  EXPECT_EQ(r.first_divergence->tensor, "state.optim.ghost.exp_avg");
  fs::remove(rec.path);
  fs::remove(copy);
}

INSTANTIATE_TEST_SUITE_P(Replay, Perturbed, ::testing::Values(RecordMode::kDigest, RecordMode::kFull),
                         [](const auto& info) { return info.param == RecordMode::kFull ? "Full" : "Digest"; });

TEST(Replay, NanRunDumpsItsFlightRingAndReplayNamesTheFirstNonFiniteOp) {
  RecorderOptions options;
  options.ring = 3;
  const Recorded rec = record(kExplode, "nan", options);
  ASSERT_FALSE(rec.outcomes.empty());
  EXPECT_FALSE(rec.outcomes.back().finite());
  EXPECT_LT(rec.outcomes.size(), 20u);  // stopped at the first non-finite step
  EXPECT_EQ(rec.stats.ring_dumps, 1);
  const TraceReader trace(rec.path);
  int ring_snapshots = 0;
  bool dump_event = false;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read(i);
    ring_snapshots += r.meta.value("ring", false);
    dump_event = dump_event || r.meta.value("event", "") == "ring_dump";
  }
  EXPECT_EQ(ring_snapshots, std::min<int>(3, static_cast<int>(rec.outcomes.size())));
  EXPECT_TRUE(dump_event);

  const ReplayResult r = replay(rec.path);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->step, static_cast<std::int64_t>(rec.outcomes.size()));
  EXPECT_EQ(r.first_nonfinite->op, "aten::native_layer_norm");
  EXPECT_EQ(r.first_nonfinite->segment, "block0..block1");
  EXPECT_EQ(r.first_nonfinite->phase, "forward");
  ASSERT_FALSE(r.first_nonfinite->inputs.empty());
  EXPECT_EQ(r.first_nonfinite->inputs[0].nonfinite.nan, 0);  // finite but huge inputs...
  EXPECT_GT(r.first_nonfinite->inputs[0].abs_max, 1e19);     // ...whose variance overflows
  EXPECT_GT(r.first_nonfinite->outputs[0].nonfinite.nan, 0);
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j["first_nonfinite"]["op"], "aten::native_layer_norm");
  EXPECT_TRUE(j["first_divergence"].is_null());
  fs::remove(rec.path);
}

TEST(Replay, EnvironmentThatBreaksBitwiseEqualityIsRefusedUnlessForced) {
  const Recorded rec = record(kGpt, "env_src", {}, 2);
  const std::string copy = temp_path("env");
  rewrite(rec.path, copy, [](Record&, std::vector<TensorToWrite>&) {},
          [](nlohmann::json& header) { header["environment"]["bitwise"]["intra_op_threads"] = "64"; });
  try {
    replay(copy);
    ADD_FAILURE() << "an incompatible environment was accepted";
  } catch (const EnvironmentMismatch& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("intra_op_threads was 64"), std::string::npos) << what;
    EXPECT_NE(what.find("OMP_NUM_THREADS=64"), std::string::npos) << what;
    EXPECT_NE(what.find("--force"), std::string::npos) << what;
  }
  ReplayOptions force;
  force.force = true;
  const ReplayResult forced = replay(copy, force);
  EXPECT_TRUE(forced.reproduced);
  ASSERT_EQ(forced.environment.size(), 1u);
  EXPECT_EQ(forced.environment[0].field, "intra_op_threads");
  fs::remove(rec.path);
  fs::remove(copy);
}

// The POSIX file system with the background writer held on its first record, so the training
// thread certainly pushes again while the writer is busy. (A fixed 40 ms per append had let a
// step slowed by a loaded machine fall behind the writer, and then the test saw no wait.) The
// header is written on the thread that made the file system and is not held; the hold is a
// bound far above the gap between two pushes of one step (one segment's forward), not a timing.
class SlowFileSystem : public io::FileSystem {
 public:
  std::unique_ptr<io::WritableFile> create(const std::string& path) override {
    struct Slow : io::WritableFile {
      std::unique_ptr<io::WritableFile> f;
      std::thread::id owner = std::this_thread::get_id();
      bool held = false;
      void append(const void* d, std::size_t n) override {
        if (!held && std::this_thread::get_id() != owner) {
          held = true;  // only the writer thread appends after the header
          std::this_thread::sleep_for(std::chrono::seconds(2));
        }
        f->append(d, n);
      }
      void sync() override { f->sync(); }
      void close() override { f->close(); }
      std::uint64_t size() const override { return f->size(); }
    };
    auto slow = std::make_unique<Slow>();
    slow->f = io::posix_file_system().create(path);
    return slow;
  }
  void rename(const std::string& a, const std::string& b) override { io::posix_file_system().rename(a, b); }
  void sync_directory(const std::string& d) override { io::posix_file_system().sync_directory(d); }
  void remove(const std::string& p) override { io::posix_file_system().remove(p); }
  std::unique_ptr<io::ReadableFile> open(const std::string& p) override { return io::posix_file_system().open(p); }
};

TEST(Recorder, FullQueueAppliesBackpressureAndDropsNothing) {
  SlowFileSystem slow;
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  options.queue_bytes = 1;  // every push waits for the writer
  options.writer.fs = &slow;
  const Recorded rec = record(kGpt, "backpressure", options, 2);
  EXPECT_GT(rec.stats.backpressure_waits, 0);
  const TraceReader trace(rec.path);
  EXPECT_EQ(static_cast<std::int64_t>(trace.records().size()), rec.stats.records);
  EXPECT_TRUE(replay(rec.path).reproduced);
  fs::remove(rec.path);

  // Control: the same held writer under the default bound never makes the training thread wait.
  SlowFileSystem slow_again;
  options.queue_bytes = RecorderOptions{}.queue_bytes;
  options.writer.fs = &slow_again;
  const Recorded unbounded = record(kGpt, "backpressure-control", options, 2);
  EXPECT_EQ(unbounded.stats.backpressure_waits, 0);
  EXPECT_EQ(static_cast<std::int64_t>(TraceReader(unbounded.path).records().size()), unbounded.stats.records);
  fs::remove(unbounded.path);
}

// A program whose step throws: the exception is noted in the trace and the ring dumped.
class Throwing : public ScenarioProgram {
 public:
  using ScenarioProgram::ScenarioProgram;
  StepOutcome step(std::int64_t s, const std::vector<NamedTensor>& b, StepMonitor* m) override {
    if (s == 3) throw std::runtime_error("data loader died");
    return ScenarioProgram::step(s, b, m);
  }
};

TEST(Recorder, ExceptionLeavingAStepDumpsTheRing) {
  Throwing program(parse_scenario_text(kGpt, "throwing"));
  const std::string path = temp_path("throwing");
  RecorderOptions options;
  options.ring = 2;
  Recorder recorder(path, program, options);
  EXPECT_THROW(record_run(program, recorder, 5), std::runtime_error);
  const TraceReader trace(path);  // closed by record_run
  bool noted = false;
  int ring = 0;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read(i);
    noted = noted || (r.meta.value("event", "") == "exception" && r.meta.value("what", "") == "data loader died");
    ring += r.meta.value("ring", false);
  }
  EXPECT_TRUE(noted);
  EXPECT_EQ(ring, 2);  // steps 2 and 3
  fs::remove(path);
}

// A scenario whose step 3 raises: an Inf gradient that clipping with error_if_nonfinite refuses.
// `raises` false: the same run without the error, so step 3 completes (non-finite).
ScenarioSpec clip_error_spec(bool raises) {
  ScenarioSpec spec = load_scenario("builtin:grad-inf-clip-error");
  spec.expect = ExpectSpec{};
  spec.defenses.clip.error_if_nonfinite = raises;
  return spec;
}

std::string record_spec(const ScenarioSpec& spec, const std::string& name) {
  register_builtin_programs();
  ScenarioProgram program(spec);
  const std::string path = temp_path(name);
  Recorder recorder(path, program);
  try {
    record_run(program, recorder, spec.training.steps);
  } catch (const Error&) {
    // the step's exception: noted in the trace, which record_run closed
  }
  recorder.close();
  return path;
}

// A trace with its program config replaced: the same records, another program to replay them.
std::string with_config(const std::string& path, const ScenarioSpec& spec, const std::string& name) {
  const std::string copy = temp_path(name);
  rewrite(path, copy, [](Record&, std::vector<TensorToWrite>&) {},
          [&](nlohmann::json& h) { h["program"]["config"] = to_yaml(spec); });
  return copy;
}

// A step that raised gets a verdict like any other: the replay raises the same message at the
// same step, and the result says so (no rethrow).
TEST(Replay, StepThatRaisedReproducesItsException) {
  const std::string path = record_spec(clip_error_spec(true), "raised");
  const TraceReader trace(path);
  std::optional<ExceptionEvent> event;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    if (trace.records()[i].type != RecordType::kEvent) continue;
    if (auto e = EventRecord::decode(trace.read(i), trace.path()).exception) event = e;
  }
  ASSERT_TRUE(event.has_value()) << "the recorder noted no exception";
  EXPECT_EQ(event->step, 3);
  EXPECT_TRUE(event->raised_by_step);
  EXPECT_NE(event->what.find("clipping refuses it"), std::string::npos) << event->what;

  const ReplayResult r = replay(path);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
  EXPECT_EQ(r.to_step, 3);
  ASSERT_TRUE(r.raised.has_value());
  EXPECT_EQ(r.raised->step, 3);
  EXPECT_EQ(r.raised->what, event->what);
  EXPECT_EQ(r.raised->recorded, event->what);
  bool noted = false;
  for (const std::string& n : r.notes) noted = noted || n.find("step 3 raised, as the recorded run did: ") == 0;
  EXPECT_TRUE(noted);
  // What went non-finite before it raised: the gradient norm over the injected Inf, after the
  // program handed over its gradients.
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->step, 3);
  EXPECT_EQ(r.first_nonfinite->phase, "optimizer") << r.first_nonfinite->message();
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j["raised"]["step"], 3);
  EXPECT_EQ(j["raised"]["what"], event->what);
  EXPECT_TRUE(j["first_divergence"].is_null());

  // A trace from before raised_by_step: the step is re-executed and noted, as a run that died.
  const std::string old = temp_path("raised_old");
  rewrite(path, old, [](Record& rec, std::vector<TensorToWrite>&) { rec.meta.erase("raised_by_step"); });
  const ReplayResult o = replay(old);
  EXPECT_TRUE(o.reproduced);
  ASSERT_TRUE(o.raised.has_value());
  EXPECT_FALSE(o.raised->recorded.has_value());
  bool died = false;
  for (const std::string& n : o.notes) died = died || n.find("step 3 has no recorded outcome") == 0;
  EXPECT_TRUE(died);
  fs::remove(path);
  fs::remove(old);
}

// Negative controls: another message, a raise the recorded run did not have, and a recorded raise
// the replay does not repeat are each a divergence at step 3.
TEST(Replay, StepThatRaisedOtherwiseThanRecordedDiverges) {
  const std::string raising = record_spec(clip_error_spec(true), "raising");
  const std::string completing = record_spec(clip_error_spec(false), "completing");
  ASSERT_TRUE(replay(completing).reproduced);  // the control's own trace replays

  const std::string other = temp_path("other_message");
  rewrite(raising, other, [](Record& rec, std::vector<TensorToWrite>&) {
    if (rec.meta.value("event", "") == "exception") rec.meta["what"] = "step 3: out of memory";
  });
  const ReplayResult m = replay(other);
  EXPECT_FALSE(m.reproduced);
  ASSERT_TRUE(m.first_divergence.has_value());
  EXPECT_EQ(m.first_divergence->step, 3);
  EXPECT_NE(m.first_divergence->detail.find("the recorded run raised 'step 3: out of memory'"), std::string::npos)
      << m.first_divergence->message();
  EXPECT_NE(m.first_divergence->detail.find("clipping refuses it"), std::string::npos);
  ASSERT_TRUE(m.raised.has_value());
  EXPECT_EQ(m.raised->recorded, "step 3: out of memory");

  // The recorded run completed step 3; the replayed program raises there.
  const std::string raises_now = with_config(completing, clip_error_spec(true), "raises_now");
  const ReplayResult n = replay(raises_now);
  EXPECT_FALSE(n.reproduced);
  ASSERT_TRUE(n.first_divergence.has_value());
  EXPECT_EQ(n.first_divergence->step, 3);
  EXPECT_EQ(n.first_divergence->phase, "optimizer");  // clipping runs after after_backward
  EXPECT_NE(n.first_divergence->detail.find("; the recorded run completed the step"), std::string::npos)
      << n.first_divergence->message();

  // The recorded run raised at step 3; the replayed program completes it.
  const std::string completes_now = with_config(raising, clip_error_spec(false), "completes_now");
  const ReplayResult c = replay(completes_now);
  EXPECT_FALSE(c.reproduced);
  EXPECT_FALSE(c.raised.has_value());
  ASSERT_TRUE(c.first_divergence.has_value());
  EXPECT_EQ(c.first_divergence->step, 3);
  EXPECT_NE(c.first_divergence->detail.find("the replay completed it"), std::string::npos) << c.first_divergence->message();
  for (const std::string& f : {raising, completing, other, raises_now, completes_now}) fs::remove(f);
}

// The CLI on those traces: a verdict, --json and --report written, exit 0 when the exception
// reproduced and 1 when it did not (never the 2 of bad input, whatever the exception's type).
TEST(ReplayCli, StepThatRaisedHasAVerdictJsonReportAndExitCode) {
  // RETRACE_BIN, or the retrace binary next to this one (ctest hands a discovered test only the
  // first entry of RETRACE_TEST_ENV).
  const char* env = std::getenv("RETRACE_BIN");
  const std::string bin = env ? env : (fs::read_symlink("/proc/self/exe").parent_path() / "retrace").string();
  if (!fs::exists(bin)) GTEST_SKIP() << "no retrace binary: the CLI is not built";
  const std::string raising = record_spec(clip_error_spec(true), "cli_raising");
  const std::string other = temp_path("cli_other");
  rewrite(raising, other, [](Record& rec, std::vector<TensorToWrite>&) {
    if (rec.meta.value("event", "") == "exception") rec.meta["what"] = "step 3: out of memory";
  });
  for (const auto& [trace, code] : {std::pair{raising, 0}, std::pair{other, 1}}) {
    SCOPED_TRACE(trace);
    const std::string json = trace + ".json", report = trace + ".html";
    const std::string command = bin + " replay '" + trace + "' --json '" + json + "' --report '" + report +
                                "' >/dev/null 2>&1";
    const int status = std::system(command.c_str());
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), code);
    std::ifstream in(json);
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_EQ(j["reproduced"], code == 0);
    EXPECT_EQ(j["raised"]["step"], 3);
    EXPECT_EQ(j["first_divergence"].is_null(), code == 0);
    EXPECT_GT(fs::file_size(report), 1000u);
    fs::remove(json);
    fs::remove(report);
  }
  fs::remove(raising);
  fs::remove(other);
}

// An op after backward and before the program hands over its gradients -- here an injected NaN
// gradient -- is post-backward, not forward (the forward control: NanRunDumpsItsFlightRing...,
// whose LayerNorm overflow stays forward).
TEST(Replay, GradientFaultIsPostBackward) {
  ScenarioSpec spec = load_scenario("builtin:grad-nan-skip-off");
  spec.expect = ExpectSpec{};
  const std::string path = record_spec(spec, "post_backward");
  const ReplayResult r = replay(path);
  EXPECT_TRUE(r.reproduced);
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->step, 3);
  EXPECT_EQ(r.first_nonfinite->op, "aten::fill_");
  EXPECT_EQ(r.first_nonfinite->segment, "");
  EXPECT_EQ(r.first_nonfinite->phase, "post-backward") << r.first_nonfinite->message();
  fs::remove(path);
}

// A program of single ops, to pin down what provenance reports about them. config: "copy" (a
// NaN from the batch copied into zeros: the first non-finite op is in-place), "sqrt" (the square
// root of a negative parameter), "all-nan" (an op on an all-NaN batch, whose loss is -nan).
class OpProgram : public Program {
 public:
  explicit OpProgram(std::string config) : config_(std::move(config)) {}
  std::string name() const override { return "test.ops"; }
  std::string config() const override { return config_; }
  std::vector<NamedTensor> state() override { return {{"param.w", w_}}; }
  void load_state(const std::vector<NamedTensor>& state) override {
    for (const NamedTensor& n : state) {
      if (n.name == "param.w") w_.copy_(n.tensor);
    }
  }
  std::vector<NamedTensor> batch(std::int64_t) override {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    if (config_ == "all-nan") return {{"input", torch::full({3}, -nan)}};  // -nan: sign bit set
    return {{"input", torch::tensor({1.0f, nan, 2.0f, 3.0f})}};
  }
  StepOutcome step(std::int64_t, const std::vector<NamedTensor>& batch, StepMonitor*) override {
    torch::NoGradGuard no_grad;
    at::Tensor y;
    if (config_ == "copy") {
      y = torch::zeros({4});
      y.copy_(batch[0].tensor);
    } else if (config_ == "sqrt") {
      y = w_.sqrt();
    } else if (config_ == "mse") {
      y = torch::mse_loss(w_ * 1e20f, torch::zeros({3}));  // squares past float's range inside mse_loss
    } else {
      y = batch[0].tensor.mul(2);
    }
    StepOutcome out;
    out.loss = y.sum().item<double>();
    out.grad_norm = 0;
    return out;
  }

 private:
  std::string config_;
  at::Tensor w_ = torch::tensor({4.0f, -1.0f, 9.0f});
};

ReplayResult record_and_replay_ops(const std::string& config, bool drop_step_end = false, StepOutcome* recorded = nullptr) {
  register_program("test.ops", [](const std::string& c) { return std::make_unique<OpProgram>(c); });
  OpProgram program(config);
  const std::string path = temp_path("ops_" + config);
  {
    Recorder recorder(path, program);
    const std::vector<StepOutcome> outcomes = record_run(program, recorder, 1);
    if (recorded && !outcomes.empty()) *recorded = outcomes.front();
    recorder.close();
  }
  std::string replayed = path;
  if (drop_step_end) {  // as if the run had died in the step
    replayed = temp_path("ops_died_" + config);
    const TraceReader in(path);
    TraceWriter out(replayed, [&] {
      nlohmann::json h = in.header();
      h.erase("format_version");
      h.erase("writer");
      return h;
    }());
    for (std::size_t i = 0; i < in.records().size(); ++i) {
      Record rec = in.read(i);
      if (rec.type == RecordType::kStepEnd) continue;
      std::vector<TensorToWrite> tensors;
      for (const TensorEntry& e : rec.tensors) {
        EXPECT_TRUE(e.has_data()) << "a one-step trace stores every tensor of its step_begin";
        if (e.has_data()) tensors.push_back({e.name, in.decode(rec, e), true, std::nullopt});
      }
      rec.meta.erase("tensors");
      out.append(rec.type, rec.meta, tensors);
    }
    out.close();
  }
  ReplayResult r = replay(replayed);
  fs::remove(path);
  if (replayed != path) fs::remove(replayed);
  return r;
}

// An in-place op's inputs are reported as they were before it: the destination of copy_ held
// zeros (its output holds the NaN), the source the NaN. Control: the output, read after the op,
// does hold it -- the report of input 0 would too if it were taken after the op.
TEST(Provenance, InPlaceOpShowsItsInputsBeforeTheOp) {
  const ReplayResult r = record_and_replay_ops("copy");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::copy_");
  ASSERT_EQ(o.inputs.size(), 2u);
  EXPECT_EQ(o.inputs[0].nonfinite.nan, 0) << o.message();
  EXPECT_EQ(o.inputs[0].min, 0);
  EXPECT_EQ(o.inputs[0].max, 0);
  EXPECT_EQ(o.inputs[1].nonfinite.nan, 1);
  ASSERT_EQ(o.outputs.size(), 1u);
  EXPECT_EQ(o.outputs[0].nonfinite.nan, 1);  // the control: the same tensor after the op
}

// The text line names the min and max of each input: the -1 that sqrt turned into NaN. Control:
// an input with no such value (all finite and positive) would show min > 0.
TEST(Provenance, TextLineNamesTheInputsMinAndMax) {
  const ReplayResult r = record_and_replay_ops("sqrt");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::sqrt");
  ASSERT_EQ(o.inputs.size(), 1u);
  EXPECT_EQ(o.inputs[0].min, -1);
  EXPECT_EQ(o.inputs[0].max, 9);
  const std::string text = o.message();
  EXPECT_NE(text.find("input 0 Float[3] min -1 max 9 |max| 9 nan=0 inf=0"), std::string::npos) << text;
  EXPECT_EQ(o.to_json()["inputs"][0]["min"], -1.0);
}

// An op that makes the value inside its own kernel and hands it to nested ops (mse_loss squares,
// then sums and divides) is named, not the nested op that first returned it. Control: the nested
// op was handed the infinity (its input is non-finite), so naming it would blame the wrong op.
TEST(Provenance, AnOpThatMakesTheValueInsideItIsNamedNotItsInnerOp) {
  const ReplayResult r = record_and_replay_ops("mse");
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.op, "aten::mse_loss") << o.message();
  EXPECT_FALSE(o.inner_op.empty()) << o.message();
  ASSERT_EQ(o.inputs.size(), 2u);  // mse_loss's own inputs: finite
  EXPECT_EQ(o.inputs[0].nonfinite.pos_inf + o.inputs[0].nonfinite.nan, 0) << o.message();
  EXPECT_NE(o.message().find("(made inside it, first returned by its inner aten::"), std::string::npos) << o.message();
  EXPECT_EQ(o.to_json()["inner_op"], o.inner_op);
}

// An all-NaN tensor has no min or max: NaN, not 0, in text and JSON; and a loss of -nan prints as
// nan. Control: the partly-NaN source of copy_ keeps its finite min and max (1 and 3), and the
// recorded loss really is negative (so printing it with << would say -nan).
TEST(Provenance, AllNanTensorHasNanStatsAndNegativeNanPrintsAsNan) {
  StepOutcome recorded;
  const ReplayResult r = record_and_replay_ops("all-nan", /*drop_step_end=*/true, &recorded);
  ASSERT_TRUE(std::isnan(recorded.loss));
  ASSERT_TRUE(std::signbit(recorded.loss));
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  ASSERT_FALSE(o.inputs.empty());
  EXPECT_TRUE(std::isnan(o.inputs[0].min));
  EXPECT_TRUE(std::isnan(o.inputs[0].max));
  EXPECT_TRUE(std::isnan(o.inputs[0].abs_max));
  const std::string text = o.message();
  EXPECT_NE(text.find("input 0 Float[3] (no finite element) nan=3"), std::string::npos) << text;
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j["first_nonfinite"]["inputs"][0]["min"], "nan");
  EXPECT_EQ(j["first_nonfinite"]["inputs"][0]["abs_max"], "nan");
  EXPECT_EQ(j.dump().find("-nan"), std::string::npos) << j.dump();
  bool noted = false;
  for (const std::string& n : r.notes) {
    EXPECT_EQ(n.find("-nan"), std::string::npos) << n;
    noted = noted || n.find("re-executed from its snapshot: loss nan, grad norm 0") != std::string::npos;
  }
  EXPECT_TRUE(noted);

  const ReplayResult control = record_and_replay_ops("copy");
  ASSERT_TRUE(control.first_nonfinite.has_value());
  ASSERT_EQ(control.first_nonfinite->inputs.size(), 2u);
  EXPECT_EQ(control.first_nonfinite->inputs[1].min, 1);
  EXPECT_EQ(control.first_nonfinite->inputs[1].max, 3);
}

}  // namespace
}  // namespace retrace
