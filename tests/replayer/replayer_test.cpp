// Record then replay: bitwise reproduction in digest and full modes, the first divergence of a
// perturbed trace, the flight ring of a run forced to NaN, steps that raised.
#include "../support/recording.h"

#include <retrace/records.h>
#include <retrace/error.h>
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/runner.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <limits>
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
  for (const std::string& n : r.notes) tagged = tagged || n.find("step 3 carries injected faults: grad_nonfinite") == 0;
  EXPECT_TRUE(tagged);
  fs::remove(path);
}

// What replay() threw, or "" when it did not.
std::string replay_error(const std::string& path, const ReplayOptions& options) {
  try {
    replay(path, options);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
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
  // A start after the last step to replay is refused, not clamped to it (step 3 would be
  // replayed, as if from step 4): past the trace's end, and past the step asked for.
  ReplayOptions past_end;
  past_end.from = 4;
  EXPECT_EQ(replay_error(rec.path, past_end),
            "replay from step 4: the trace's last step is 3 (it has steps 1..3; see retrace inspect)");
  ReplayOptions after_target;
  after_target.from = 3;
  after_target.step = 2;
  EXPECT_EQ(replay_error(rec.path, after_target),
            "replay from step 3 is after the last step to replay, 2: give a start at or before it");
  // The control: a start at the target is a replay of that one step.
  after_target.from = 2;
  const ReplayResult at_target = replay(rec.path, after_target);
  EXPECT_TRUE(at_target.reproduced);
  EXPECT_EQ(at_target.to_step, 2);
  fs::remove(rec.path);
}

INSTANTIATE_TEST_SUITE_P(Replay, ModesAndModels,
                         ::testing::Combine(::testing::Values(kGpt, kLstm),
                                            ::testing::Values(RecordMode::kDigest, RecordMode::kFull)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == kGpt ? "TinyGpt" : "Lstm") +
                                  (std::get<1>(info.param) == RecordMode::kFull ? "Full" : "Digest");
                         });

// One element of block2's fc weight (a state tensor) moved by 0.25 in a record being rewritten.
void perturb_fc_weight(std::vector<TensorToWrite>& tensors) {
  for (TensorToWrite& t : tensors) {
    if (t.name == "state.param.block2.fc.weight") {
      t.tensor = t.tensor.clone();
      t.tensor.view(-1)[5] += 0.25;
    }
  }
}

TEST(Replay, FullModeReplaysAnyStepFromItsOwnSnapshot) {
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  const Recorded rec = record(kGpt, "anystep", options);
  ReplayOptions three;
  three.step = 3;
  const ReplayResult r = replay(rec.path, three);
  EXPECT_TRUE(r.reproduced);
  EXPECT_EQ(r.from_step, 3);  // its own step_begin (whose state step_end 2 stored), not step 1
  fs::remove(rec.path);
}

// Full mode stores the state once between two steps: a step_begin whose state is bit for bit the
// previous step_end's stored state points at it (state_as_step_end) and stores none, and replay
// restores from that step_end. Controls: a perturbed element of step_end 2's stored state makes
// the replay of step 3 diverge (the anchor really is read from there), and a state changed
// between two steps is stored in full again.
TEST(Replay, FullModeStoresTheStateOnceBetweenSteps) {
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  const Recorded rec = record(kGpt, "once", options, 3);
  {
    const TraceReader trace(rec.path);
    for (std::size_t i = 0; i < trace.records().size(); ++i) {
      const Record r = trace.read_table(i);
      std::size_t state = 0, stored = 0;
      for (const TensorEntry& e : r.tensors) {
        if (!tensor_names::state_name(e.name)) continue;
        ++state;
        stored += e.has_data() ? 1 : 0;
      }
      if (r.type == RecordType::kStepBegin) {
        const StepBeginRecord b = StepBeginRecord::decode(r, trace.path());
        SCOPED_TRACE("step_begin " + std::to_string(b.step));
        EXPECT_EQ(b.full, b.step == 1);
        EXPECT_EQ(b.state_as_step_end, b.step == 1 ? std::nullopt : std::optional<std::int64_t>(b.step - 1));
        EXPECT_EQ(state, b.step == 1 ? stored : 0u);
        if (b.step == 1) {
          EXPECT_GT(stored, 0u);
        }
      } else if (r.type == RecordType::kStepEnd) {
        EXPECT_GT(state, 0u);
        EXPECT_EQ(stored, state) << "a full-mode step_end stores its state";
      }
    }
  }
  ReplayOptions three;
  three.step = 3;
  const ReplayResult r = replay(rec.path, three);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
  EXPECT_EQ(r.from_step, 3);

  const std::string perturbed = temp_path("once_perturbed");
  rewrite(rec.path, perturbed, [](Record& rec, std::vector<TensorToWrite>& tensors) {
    if (rec.type != RecordType::kStepEnd || rec.meta["step"] != 2) return;
    perturb_fc_weight(tensors);
  });
  const ReplayResult bad = replay(perturbed, three);
  EXPECT_FALSE(bad.reproduced);
  ASSERT_TRUE(bad.first_divergence.has_value());
  EXPECT_EQ(bad.first_divergence->step, 3);
  EXPECT_EQ(bad.first_divergence->segment, "block2..block3");
  EXPECT_EQ(bad.first_divergence->phase, "forward");

  // Control: bits changed between two steps are stored again, and replay starts there.
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(kGpt, "changed"));
  const std::string changed = temp_path("once_changed");
  {
    Recorder recorder(changed, program, options);
    ObserverScope scope(recorder);
    for (std::int64_t s = 1; s <= 2; ++s) {
      if (s == 2) {
        at::NoGradGuard no_grad;
        program.state().front().tensor.view(-1)[0].add_(1.0);
      }
      const std::vector<NamedTensor> batch = program.batch(s);
      recorder.begin_step(s, program.state(), batch, program.lr(), program.loss_scale());
      const StepOutcome o = program.step(s, batch, &recorder);
      recorder.end_step(s, o, program.state());
    }
    recorder.close();
  }
  const TraceReader trace(changed);
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    if (trace.records()[i].type != RecordType::kStepBegin) continue;
    const StepBeginRecord b = StepBeginRecord::decode(trace.read_table(i), trace.path());
    EXPECT_TRUE(b.full) << "step " << b.step;
    EXPECT_FALSE(b.state_as_step_end.has_value()) << "step " << b.step;
  }
  ReplayOptions two;
  two.step = 2;
  const ReplayResult from_two = replay(changed, two);
  EXPECT_TRUE(from_two.reproduced) << (from_two.first_divergence ? from_two.first_divergence->message() : "");
  EXPECT_EQ(from_two.from_step, 2);
  fs::remove(rec.path);
  fs::remove(perturbed);
  fs::remove(changed);
}

// The replay restores the anchor's snapshot straight into the program's own tensors. When every
// snapshot at or before the target holds a non-finite tensor, the latest one is the anchor: it
// is decoded again after the earlier candidates were decoded over it. Here a NaN tensor the
// program does not hold is added to both stored snapshots (step_begin 1's, and step_end 1's
// that step_begin 2 points at); step 2 replays bitwise from its own. Negative control (by hand):
// without the second decode the anchor's state is empty and the replay fails (the program's
// parameters are missing from it); the perturbed copy below shows that the anchor's content
// decides the verdict.
TEST(Replay, WhenEverySnapshotHoldsNonFiniteStateTheLatestIsRestored) {
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  const Recorded rec = record(kGpt, "allnonfinite", options, 2);
  const std::string nonfinite = temp_path("allnonfinite_nan");
  rewrite(rec.path, nonfinite, [](Record& r, std::vector<TensorToWrite>& tensors) {
    if (r.meta["step"] != 1 || (r.type != RecordType::kStepBegin && r.type != RecordType::kStepEnd)) return;
    tensors.push_back({tensor_names::state("junk"), at::full({4}, std::nan(""), at::kFloat), true, std::nullopt});
  });
  ReplayOptions two;
  two.step = 2;
  const ReplayResult r = replay(nonfinite, two);
  EXPECT_EQ(r.from_step, 2);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");

  {
    // Control: the anchor's content decides the verdict (one element of step_end 1's stored
    // state changed diverges), so a replay from the wrong snapshot cannot pass.
    const std::string perturbed = temp_path("allnonfinite_perturbed");
    rewrite(nonfinite, perturbed, [](Record& r, std::vector<TensorToWrite>& tensors) {
      if (r.type == RecordType::kStepEnd && r.meta["step"] == 1) {
        for (TensorToWrite& t : tensors) {
          if (t.name == tensor_names::state("param.block2.fc.weight")) {
            t.tensor = t.tensor.clone();
            t.tensor.view(-1)[5] += 0.25;
          }
        }
      }
    });
    const ReplayResult bad = replay(perturbed, two);
    EXPECT_EQ(bad.from_step, 2);
    EXPECT_FALSE(bad.reproduced);
    fs::remove(perturbed);
  }
  fs::remove(rec.path);
  fs::remove(nonfinite);
}

// A step whose loss and gradient norm are finite but whose optimizer step leaves the parameters
// non-finite (an LR spike to 1e35 at step 1 on a loss weighted 1e6: the SGD update overflows
// float) is where the replay stops, as the recorded run went non-finite there, and provenance
// names the optimizer's op: the post-step state is checked finite as it is hashed for the
// comparison. Control: at LR 0.1, weight 1 and no spike it replays both steps.
TEST(Replay, StopsAtTheStepThatLeftTheParametersNonFinite) {
  for (const bool overflow : {true, false}) {
    SCOPED_TRACE(overflow ? "overflow" : "control");
    const std::string yaml = std::string("name: overflow\n"
                                         "model: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, dropout: 0.1}\n"
                                         "data: {batch: 4, seed: 3}\n") +
                             (overflow
                                  ? "training: {steps: 2, optimizer: sgd, segments: 2, lr: 1.0e5, loss_weight: 1.0e6}\n"
                                    "injections: [{type: lr_spike, step: 1, duration: 1, factor: 1.0e30}]\n"
                                  : "training: {steps: 2, optimizer: sgd, segments: 2, lr: 0.1}\n");
    RecorderOptions full;
    full.mode = RecordMode::kFull;
    full.state_check = false;
    register_builtin_programs();
    ScenarioProgram program(parse_scenario_text(yaml, "overflow"));
    const std::string path = temp_path("overflow");
    std::vector<StepOutcome> outcomes;
    {
      Recorder recorder(path, program, full);
      outcomes = record_run(program, recorder, 2, /*stop_on_nonfinite=*/false);
      recorder.close();
    }
    ASSERT_EQ(outcomes.size(), 2u);
    EXPECT_TRUE(outcomes[0].finite());  // step 1's loss and norm are finite; its update may not be
    EXPECT_EQ(outcomes[1].finite(), !overflow);
    ReplayOptions all;
    all.from = 1;
    const ReplayResult r = replay(path, all);
    EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
    EXPECT_EQ(r.from_step, 1);
    EXPECT_EQ(r.to_step, overflow ? 1 : 2);
    EXPECT_EQ(r.first_nonfinite.has_value(), overflow);
    if (r.first_nonfinite) {
      EXPECT_EQ(r.first_nonfinite->step, 1);
      EXPECT_EQ(r.first_nonfinite->phase, "optimizer");
    }
    fs::remove(path);
  }
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
    perturb_fc_weight(tensors);
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
  if (d.diff) {
    EXPECT_GT(d.diff->differing, 0);
  }
  fs::remove(rec.path);
  fs::remove(copy);
}

// A gradient made outside the segments: one target token changed in the trace leaves every
// segment's forward as recorded, and the first divergence is the gradient handed to the last
// segment's backward, made by the head and the loss after it. Its hint says so, and that the loss
// (compared only after backward) differs too. Control: a forward divergence (a changed weight, the
// test above) gets no such hint.
TEST(Replay, AGradientMadeOutsideTheSegmentsSaysWhereAndThatTheLossDiffers) {
  const Recorded rec = record(kGpt, "target_src", {}, 1);
  const std::string copy = temp_path("target");
  rewrite(rec.path, copy, [](Record& r, std::vector<TensorToWrite>& tensors) {
    if (r.type != RecordType::kStepBegin) return;
    for (TensorToWrite& t : tensors) {
      if (t.name != "batch.target") continue;
      t.tensor = t.tensor.clone();
      t.tensor.view(-1)[0] = (t.tensor.view(-1)[0] + 1) % 16;
    }
  });
  const ReplayResult r = replay(copy);
  ASSERT_TRUE(r.first_divergence.has_value());
  const Divergence& d = *r.first_divergence;
  EXPECT_EQ(d.phase, "backward") << d.message();
  EXPECT_EQ(d.tensor, "grad_output.0") << d.message();
  EXPECT_NE(d.hint.find("every segment event before it matched, so the gradient flowing into '" + d.segment +
                        "' was made outside the segments"),
            std::string::npos)
      << d.message();
  EXPECT_NE(d.hint.find("; the step's loss differs too (recorded "), std::string::npos) << d.message();

  const std::string weight = temp_path("weight");
  rewrite(rec.path, weight, [](Record& r, std::vector<TensorToWrite>& tensors) {
    if (r.type == RecordType::kStepBegin) perturb_fc_weight(tensors);
  });
  const ReplayResult w = replay(weight);
  ASSERT_TRUE(w.first_divergence.has_value());
  EXPECT_EQ(w.first_divergence->phase, "forward");
  EXPECT_EQ(w.first_divergence->hint.find("made outside the segments"), std::string::npos);
  fs::remove(rec.path);
  fs::remove(copy);
  fs::remove(weight);
}

// A recorded tensor the replay does not produce is a divergence too (e.g. an optimizer state the
// replayed program lost).
TEST(Replay, RecordedTensorMissingFromTheReplayDiverges) {
  const Recorded rec = record(kGpt, "extra_src", {}, 2);
  const std::string copy = temp_path("extra");
  rewrite(rec.path, copy, [](Record& r, std::vector<TensorToWrite>& tensors) {
    if (r.type == RecordType::kStepEnd && r.meta["step"] == 1) {
      tensors.push_back(
          TensorToWrite::digest_only("state.optim.ghost.exp_avg", torch::zeros({2}), digest(torch::zeros({2}))));
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
  EXPECT_FALSE(r.first_nonfinite->by_observer);  // the segment's own LayerNorm
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

// A ring whose snapshots are 3 steps apart (RecorderOptions::ring_every): the gradient goes NaN at
// step 9, the dump holds steps 4 and 7, and replay re-executes 8 and 9 from step 7's snapshot.
TEST(Replay, RingWithSnapshotsStepsApartReplaysTheFailingStepFromTheNewest) {
  RecorderOptions options;
  options.ring = 2;
  options.ring_every = 3;
  const Recorded rec = record(R"(
name: late-nan
model: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1}
data: {batch: 8, seed: 1}
training: {steps: 12, optimizer: adamw, lr: 0.003, segments: 2}
injections: [{type: grad_nonfinite, step: 9, mode: nan}]
)",
                              "ring_every", options);
  ASSERT_EQ(rec.outcomes.size(), 9u);
  std::vector<std::int64_t> ring_steps;
  const TraceReader trace(rec.path);
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record r = trace.read(i);
    if (r.type == RecordType::kStepBegin && r.meta.value("ring", false))
      ring_steps.push_back(r.meta.at("step").get<std::int64_t>());
  }
  EXPECT_EQ(ring_steps, (std::vector<std::int64_t>{4, 7}));
  const ReplayResult r = replay(rec.path);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
  EXPECT_EQ(r.from_step, 7);
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->step, 9);
  fs::remove(rec.path);
}

TEST(Replay, EnvironmentThatBreaksBitwiseEqualityIsRefusedUnlessForced) {
  const Recorded rec = record(kGpt, "env_src", {}, 2);
  const std::string copy = temp_path("env");
  rewrite(
      rec.path, copy, [](Record&, std::vector<TensorToWrite>&) {},
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

// A built-in scenario recorded without its expectations and replayed; the trace is removed.
ReplayResult record_and_replay_builtin(const std::string& name) {
  ScenarioSpec spec = load_scenario("builtin:" + name);
  spec.expect = ExpectSpec{};
  const std::string path = record_spec(spec, name);
  ReplayResult r = replay(path);
  fs::remove(path);
  return r;
}

// A trace with its program config replaced: the same records, another program to replay them.
std::string with_config(const std::string& path, const ScenarioSpec& spec, const std::string& name) {
  const std::string copy = temp_path(name);
  rewrite(
      path, copy, [](Record&, std::vector<TensorToWrite>&) {},
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
  // What went non-finite before it raised: the injected Inf (a fill_ given an infinity, after
  // backward), still in the gradients, whose norm clipping refused -- not the norm, which was
  // handed it.
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->step, 3);
  EXPECT_EQ(r.first_nonfinite->op, "aten::fill_") << r.first_nonfinite->message();
  EXPECT_EQ(r.first_nonfinite->phase, "post-backward") << r.first_nonfinite->message();
  EXPECT_TRUE(r.first_nonfinite->given_infinity);
  EXPECT_TRUE(r.first_nonfinite->nan_op.empty()) << r.first_nonfinite->message();
  // Left in the gradients when the step raised: named without a carrier.
  EXPECT_TRUE(r.first_nonfinite->carried_to.empty()) << r.first_nonfinite->message();
  EXPECT_NE(r.first_nonfinite->message().find("which no later op absorbed: the step ended with it"), std::string::npos)
      << r.first_nonfinite->message();
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

// A step whose outcome the trace does not hold (the run died in it) replayed alone compared nothing
// but its segment records at most: not shown to reproduce (red-team finding: "reproduced bitwise"
// for a trace cut right after step 3's step_begin). Controls: from step 1, steps 1 and 2 are compared
// and reproduce; by default the replay starts from step 2's snapshot, the one before the death. A step_end missing before later steps, or two of one step, is a damaged trace
// (it had been taken for the step a run died in, and the replay said "reproduced bitwise").
TEST(Replay, AStepWithoutItsRecordedOutcomeIsNotShownToReproduce) {
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  const Recorded rec = record(kGpt, "died_full", options);
  const auto no_edit = [](Record&, std::vector<TensorToWrite>&) {};
  const std::string cut = temp_path("died_cut");
  rewrite(rec.path, cut, no_edit, nullptr,
          [](const RecordInfo& r) { return r.step < 3 || r.type == RecordType::kStepBegin; });
  ReplayOptions from3;
  from3.from = 3;
  ReplayResult r = replay(cut, from3);
  EXPECT_EQ(r.from_step, 3);
  EXPECT_FALSE(r.reproduced);
  EXPECT_FALSE(r.first_divergence.has_value());
  EXPECT_NE(r.not_shown.find("step 3 has no recorded outcome (the run died during it): the trace holds nothing of "
                             "it after its start to compare with"),
            std::string::npos)
      << r.not_shown;
  EXPECT_EQ(r.to_json()["not_shown"], r.not_shown);
  ReplayOptions from1;
  from1.from = 1;
  r = replay(cut, from1);
  EXPECT_TRUE(r.reproduced) << r.not_shown;
  EXPECT_EQ(r.to_step, 3);
  EXPECT_TRUE(r.not_shown.empty());
  // By default from the snapshot before the step it died in: step 2 compared, step 3 re-executed.
  r = replay(cut);
  EXPECT_EQ(r.from_step, 2);
  EXPECT_TRUE(r.reproduced) << r.not_shown;

  // Cut before step 3's step_end only: its segment records are compared, its outcome is not.
  const std::string segments = temp_path("died_segments");
  rewrite(rec.path, segments, no_edit, nullptr,
          [](const RecordInfo& r) { return !(r.step == 3 && r.type == RecordType::kStepEnd); });
  r = replay(segments, from3);
  EXPECT_FALSE(r.reproduced);
  EXPECT_NE(r.not_shown.find("segment record(s) were compared, matching as far as they go; its loss, gradients and "
                             "state after it were never recorded"),
            std::string::npos)
      << r.not_shown;

  // Step 2's step_end gone, step 3 recorded: damage, not a death.
  const std::string gap = temp_path("died_gap");
  rewrite(rec.path, gap, no_edit, nullptr,
          [](const RecordInfo& r) { return !(r.step == 2 && r.type == RecordType::kStepEnd); });
  ReplayOptions to3 = from1;
  to3.step = 3;
  try {
    replay(gap, to3);
    ADD_FAILURE() << "a trace without step 2's step_end replayed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 2 has a step_begin record (byte offset "), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("but no step_end, and the trace goes on to step 3: a record is missing"),
              std::string::npos)
        << e.what();
  }
  // Step 2's step_end relabelled as step 1's: step 1 has two.
  const std::string twice = temp_path("died_twice");
  rewrite(rec.path, twice, [](Record& r, std::vector<TensorToWrite>&) {
    if (r.type == RecordType::kStepEnd && r.meta.value("step", -1) == 2) r.meta["step"] = 1;
  });
  try {
    replay(twice, to3);
    ADD_FAILURE() << "a trace with two step_end records of step 1 replayed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the trace holds two step_end records of step 1 (at byte offsets "),
              std::string::npos)
        << e.what();
  }
  for (const std::string& p : {rec.path, cut, segments, gap, twice}) fs::remove(p);
}

// A step_end whose scalars say something else than the replay computes -- another loss, a skip the
// replay did not make, another LR -- diverges at "(step_end)", though every tensor digest matched
// (red-team finding: a trace whose step 2 said "skipped" replayed "bitwise"). Control: the same
// trace re-encoded unchanged reproduces.
TEST(Replay, AStepEndWhoseRecordedOutcomeDiffersDiverges) {
  const Recorded rec = record(kGpt, "outcome_fields", RecorderOptions{});
  const auto edited = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const std::string out = temp_path(name);
    rewrite(rec.path, out, [&](Record& r, std::vector<TensorToWrite>&) {
      if (r.type == RecordType::kStepEnd && r.meta.value("step", -1) == 2) edit(r.meta);
    });
    ReplayOptions from1;
    from1.from = 1;
    const ReplayResult result = replay(out, from1);
    fs::remove(out);
    return result;
  };
  EXPECT_TRUE(edited("outcome_same", [](nlohmann::json&) {}).reproduced);
  const auto diverged_with = [](const ReplayResult& r, const std::string& what) {
    EXPECT_FALSE(r.reproduced);
    ASSERT_TRUE(r.first_divergence.has_value());
    EXPECT_EQ(r.first_divergence->step, 2);
    EXPECT_EQ(r.first_divergence->segment, "(step_end)");
    EXPECT_NE(r.first_divergence->detail.find("the step's recorded outcome differs from the replay's: " + what),
              std::string::npos)
        << r.first_divergence->detail;
  };
  diverged_with(edited("outcome_loss", [](nlohmann::json& m) { m["loss"] = m["loss"].get<double>() + 1; }),
                "loss recorded ");
  diverged_with(edited("outcome_skipped", [](nlohmann::json& m) { m["skipped"] = true; }),
                "skipped recorded true, replayed false");
  diverged_with(edited("outcome_lr", [](nlohmann::json& m) { m["lr"] = 0.009; }), "lr recorded 0.009, replayed ");
  // One ulp apart: the two numbers are printed with the digits that tell them apart (red-team
  // finding: "loss recorded 4.22011, replayed 4.22011").
  const ReplayResult ulp = edited("outcome_ulp", [](nlohmann::json& m) {
    m["loss"] = std::nextafter(m["loss"].get<double>(), std::numeric_limits<double>::infinity());
  });
  diverged_with(ulp, "loss recorded ");
  if (ulp.first_divergence) {
    const std::string& d = ulp.first_divergence->detail;
    const std::size_t a = d.find("loss recorded ") + 14, b = d.find(", replayed ");
    ASSERT_NE(b, std::string::npos) << d;
    EXPECT_NE(d.substr(a, b - a), d.substr(b + 11)) << d;
  }
  fs::remove(rec.path);
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
  EXPECT_NE(c.first_divergence->detail.find("the replay completed it"), std::string::npos)
      << c.first_divergence->message();
  for (const std::string& f : {raising, completing, other, raises_now, completes_now}) fs::remove(f);
}

// The CLI on those traces: a verdict, --json and --report written, exit 0 when the exception
// reproduced and 1 when it did not (never the 2 of bad input, whatever the exception's type).
TEST(ReplayCli, StepThatRaisedHasAVerdictJsonReportAndExitCode) {
  // RETRACE_BIN (ctest sets it), or the retrace binary next to this one.
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
    const std::string command =
        bin + " replay '" + trace + "' --json '" + json + "' --report '" + report + "' >/dev/null 2>&1";
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

// An injected overflow of a segment's output is made by the injector, an observer of that output,
// after the segment's own code: the first non-finite op is named in that segment, as the
// observer's (outsider finding: "(outside segments)", while the note said block1). Control: an
// overflow the segment's own LayerNorm makes (NanRunDumpsItsFlightRing...) is the segment's own.
TEST(Replay, AnInjectedOverflowIsNamedInItsSegmentAsTheObserversOp) {
  const std::string yaml =
      "name: gpt\nmodel: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, dropout: 0.1}\ndata: {batch: 4, seed: 3}\n"
      "training: {steps: 1, optimizer: adamw, lr: 0.001, segments: 2, precision: fp16}\n"
      "injections: [{type: activation_overflow, step: 1, segment: block2}]\n";
  const Recorded rec = record(yaml.c_str(), "injected_overflow", {}, 1);
  ASSERT_FALSE(rec.outcomes.empty());
  ASSERT_FALSE(rec.outcomes.back().finite());
  const ReplayResult r = replay(rec.path);
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->segment, "block2..block3") << r.first_nonfinite->message();
  EXPECT_EQ(r.first_nonfinite->phase, "forward");
  EXPECT_TRUE(r.first_nonfinite->by_observer) << r.first_nonfinite->message();
  EXPECT_NE(r.first_nonfinite->message().find("in segment 'block2..block3' (by an observer of its output"),
            std::string::npos)
      << r.first_nonfinite->message();
  EXPECT_TRUE(r.to_json()["first_nonfinite"]["by_observer"].get<bool>());
  fs::remove(rec.path);
}

// An op after backward and before the program hands over its gradients -- here an injected NaN
// gradient -- is post-backward, not forward (the forward control: NanRunDumpsItsFlightRing...,
// whose LayerNorm overflow stays forward).
TEST(Replay, GradientFaultIsPostBackward) {
  const ReplayResult r = record_and_replay_builtin("grad-nan-skip-off");
  EXPECT_TRUE(r.reproduced);
  ASSERT_TRUE(r.first_nonfinite.has_value());
  EXPECT_EQ(r.first_nonfinite->step, 3);
  EXPECT_EQ(r.first_nonfinite->op, "aten::fill_");
  EXPECT_EQ(r.first_nonfinite->segment, "");
  EXPECT_EQ(r.first_nonfinite->phase, "post-backward") << r.first_nonfinite->message();
  EXPECT_FALSE(r.first_nonfinite->given_infinity);  // fill_(nan): a NaN is never by design
}

// A replay from a snapshot after the one a rollback restored cannot rebuild the rollback ring: the
// hint says so and names the replay that reproduces, not an incomplete state(). Control: that
// replay (from step 1) reproduces bitwise.
TEST(Replay, AReplayStartingAfterARollbacksSnapshotSaysSo) {
  ScenarioSpec spec = load_scenario("builtin:bitflip-optimizer-rollback");  // step 5 rolls back to step 3
  spec.expect = ExpectSpec{};
  register_builtin_programs();
  ScenarioProgram program(spec);
  const std::string path = temp_path("rollback_ring");
  {
    RecorderOptions full;
    full.mode = RecordMode::kFull;
    Recorder recorder(path, program, full);
    record_run(program, recorder, spec.training.steps, /*stop_on_nonfinite=*/false);
    recorder.close();
  }
  ReplayOptions at5;
  at5.step = 5;
  const ReplayResult r = replay(path, at5);
  EXPECT_FALSE(r.reproduced);
  ASSERT_TRUE(r.first_divergence.has_value());
  EXPECT_EQ(r.first_divergence->step, 5);
  EXPECT_NE(r.first_divergence->hint.find("the recorded run rolled back in step 5 to the state from the start of "
                                          "step 3, a snapshot its rollback defense kept from before step 5"),
            std::string::npos)
      << r.first_divergence->message();
  EXPECT_EQ(r.first_divergence->hint.find("probably incomplete"), std::string::npos);
  at5.from = 1;
  const ReplayResult control = replay(path, at5);
  EXPECT_TRUE(control.reproduced) << (control.first_divergence ? control.first_divergence->message() : "");
  fs::remove(path);
}

// An injected Inf gradient (fill_ given an infinity) that clipping lets through is named at the
// fill_, with the optimizer op that turned it into NaN -- not at the gradient norm handed it, nor
// at AdamW's update that made the NaN. Control: those ops' outputs are non-finite too (the norm
// +inf, the update NaN), and naming the first op to return a non-finite value it was not given as
// an argument names the norm.
TEST(Replay, AnInfGradientIsNamedAtTheOpThatMadeIt) {
  const ReplayResult r = record_and_replay_builtin("grad-inf-clip-only");
  EXPECT_TRUE(r.reproduced);
  ASSERT_TRUE(r.first_nonfinite.has_value());
  const NonFiniteOrigin& o = *r.first_nonfinite;
  EXPECT_EQ(o.step, 3);
  EXPECT_EQ(o.op, "aten::fill_") << o.message();
  EXPECT_EQ(o.phase, "post-backward");
  EXPECT_TRUE(o.given_infinity);
  EXPECT_EQ(o.nan_op, "aten::addcdiv_") << o.message();
  EXPECT_EQ(o.nan_phase, "optimizer");
  ASSERT_EQ(o.outputs.size(), 1u);
  EXPECT_EQ(o.outputs[0].nonfinite.pos_inf, 1);
}

}  // namespace
}  // namespace retrace
