#include "../support/regressor.h"
#include "../support/scenario_text.h"

#include <retrace/checkpoint.h>
#include <retrace/defenses.h>
#include <retrace/diagnose.h>
#include <retrace/error.h>
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/runner.h>
#include <retrace/scenario.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace retrace {
namespace {

using test::Regressor;

const ProgramRegistration registration("test.regressor",
                                       [](const std::string& config) { return std::make_unique<Regressor>(config); });

ScenarioSpec program_scenario(const std::string& body) {
  return parse_scenario_text("name: p\nprogram: test.regressor\ntraining: {steps: 6}\n" + body, "program.yaml");
}

std::string why(const ScenarioResult& r) {
  std::string out = r.verdict() + (r.error.empty() ? "" : " error: " + r.error) + "\n";
  for (const ExpectationCheck& c : r.checks)
    out += "  " + std::string(c.name()) + ": " + c.expected + " / " + c.observed + (c.passed ? "" : " FAILED") + "\n";
  return out;
}

void expect_error(const std::string& text, const std::string& needle) {
  try {
    parse_scenario_text(text, "program.yaml");
    ADD_FAILURE() << "accepted:\n" << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// --- the scenario file ------------------------------------------------------------------------

TEST(ProgramScenario, ProgramAndConfigParseAndRoundTrip) {
  const ScenarioSpec s =
      program_scenario("config: {lr: 0.01, layers: [1, 2]}\ndefenses: {skip_nonfinite: true, lr_scale: 0.5}\n");
  EXPECT_EQ(s.program, "test.regressor");
  // Block style whatever the file wrote: the program's factory gets "key: value" lines.
  EXPECT_EQ(s.program_config, "lr: 0.01\nlayers:\n  - 1\n  - 2") << s.program_config;
  EXPECT_EQ(s.defenses.lr_scale, 0.5);
  const ScenarioSpec again = parse_scenario_text(to_yaml(s), "again.yaml");
  EXPECT_EQ(again.program, s.program);
  EXPECT_EQ(again.program_config, s.program_config);
  EXPECT_EQ(to_yaml(again), to_yaml(s));
  EXPECT_EQ(to_yaml(s).find("model:"), std::string::npos) << to_yaml(s);
}

// Whatever a program's factory throws on its config -- std::stod's std::invalid_argument ("stod") as
// much as a retrace::Error -- is the scenario's bad input: an Error naming the file, the key and the
// program (outsider finding: "run: stod", exit 1). Control: a config it takes builds.
TEST(ProgramScenario, AFactoryThatThrowsOnItsConfigIsNamedWithTheFileAndKey) {
  try {
    make_scenario_program(program_scenario("config: {lr: abc}\n"));
    ADD_FAILURE() << "a config the factory throws on was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "program.yaml:4: key 'config': program 'test.regressor' refuses its config: stod");
  }
  EXPECT_NE(make_scenario_program(program_scenario("config: {lr: 0.5}\n")), nullptr);
}

TEST(ProgramScenario, BuiltInOnlyKeysAreRefusedWithTheirLine) {
  const std::string head = "name: p\nprogram: test.regressor\n";
  expect_error(head + "model: {type: mlp}\n", "program.yaml:3: key 'model': describes a built-in model");
  expect_error(head + "data: {batch: 2}\n", "key 'data'");
  expect_error(head + "training: {steps: 3, lr: 0.1}\n", "key 'training.lr': applies to the built-in models only");
  expect_error(head + "defenses: {layernorm_fp32: true}\n",
               "key 'defenses.layernorm_fp32': acts inside the built-in models");
  expect_error(head + "config: [1, 2]\n", "key 'config': must be a mapping");
  expect_error("name: p\nmodel: {type: mlp}\nconfig: {lr: 1}\n",
               "key 'config': is the configuration of a registered program; it needs 'program: NAME'");
  expect_error(head + "injections: [{type: corrupt_batch, step: 1}]\n", "key 'injections[0].mode': is required");
  expect_error("name: p\nmodel: {type: mlp}\ndefenses: {clip: {mode: hard}}\n",
               "must be one of off, global, per_tensor, adaptive");
  // Control: the same keys are fine for a built-in model.
  EXPECT_NO_THROW(
      parse_scenario_text("name: p\nmodel: {type: mlp}\ndata: {batch: 2}\ntraining: {steps: 3, lr: 0.1}\n", "ok.yaml"));
}

// --- the runner on a user's program -----------------------------------------------------------

TEST(ProgramScenario, AnOptimizerBitFlipFindsTheProgramsOwnMomentumByKind) {
  // The momentum buffers are named "momentum.*": a flip of optimizer state finds them by kind.
  const ScenarioResult r = run_scenario(program_scenario(
      "injections: [{type: bit_flip, step: 3, target: optimizer, bit: 30}]\nexpect: {injections_fired: true}\n"));
  const std::vector<StepNote> injected = r.notes_of(StepNoteKind::kInjected);
  ASSERT_EQ(injected.size(), 1u) << why(r);
  EXPECT_EQ(injected[0].step, 3);
  EXPECT_EQ(injected[0].text.rfind("bit_flip momentum.w", 0), 0u) << injected[0].text;
  ASSERT_EQ(r.injections.size(), 1u);
  EXPECT_EQ(r.injections[0].fired, std::vector<std::int64_t>{3});
}

TEST(ProgramScenario, NanFeaturesHitTheInputKindAndValidationSkipsThem) {
  const ScenarioResult held = run_scenario(program_scenario(
      "defenses: {validate_batch: true}\ninjections: [{type: corrupt_batch, step: 2, mode: nan_features}]\n"
      "expect: {params_finite: true, min_skipped_steps: 1, max_skipped_steps: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(held.passed) << why(held);
  const std::vector<StepNote> skips = held.notes_of(StepNoteKind::kSkipped);
  ASSERT_FALSE(skips.empty());
  EXPECT_EQ(skips[0].step, 2);
  EXPECT_NE(skips[0].text.find("non-finite features in 'x'"), std::string::npos) << skips[0].text;
  // Control: without validation the NaN features reach the parameters.
  const ScenarioResult broke =
      run_scenario(program_scenario("injections: [{type: corrupt_batch, step: 2, mode: nan_features}]\nexpect: "
                                    "{params_finite: true, diverges: true}\n"));
  EXPECT_TRUE(broke.passed) << why(broke);
  EXPECT_FALSE(broke.params_finite);
}

TEST(ProgramScenario, TokenCorruptionNeedsAVocabularyTheProgramDeclares) {
  // The regressor takes features and declares no vocabulary: a harness error, before step 1.
  const ScenarioResult r = run_scenario(program_scenario(
      "injections: [{type: corrupt_batch, step: 2, mode: token_out_of_range}]\nexpect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed);
  EXPECT_TRUE(r.harness_error) << why(r);
  EXPECT_NE(r.error.find("needs the program's vocabulary"), std::string::npos) << r.error;
}

// An injection the program cannot take, found when it first falls due (token ids corrupted in
// float features): a harness error naming it, outcome "not exercised" -- not the fault breaking
// the run. Control: a step that raises otherwise at the fault's step is the fault's raise: broke.
TEST(ProgramScenario, AnInjectionTheProgramCannotTakeIsAHarnessErrorNotABreak) {
  const ScenarioResult r = run_scenario(
      program_scenario("config: {vocab: true}\ninjections: [{type: corrupt_batch, step: 2, mode: token_out_of_range}]\n"
                       "expect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed);
  EXPECT_TRUE(r.harness_error) << why(r);
  EXPECT_FALSE(r.broke) << why(r);
  EXPECT_EQ(r.outcome(), "not exercised") << why(r);
  EXPECT_NE(r.error.find("step 2: the scenario's injection corrupt_batch: mode token_out_of_range needs token ids"),
            std::string::npos)
      << r.error;
  // Control: clipping that refuses an infinite norm raises at the fault's step, unasked: broke.
  const ScenarioResult raised = run_scenario(
      program_scenario("defenses: {clip: {max_norm: 1.0, error_if_nonfinite: true}}\n"
                       "injections: [{type: grad_nonfinite, step: 2, mode: inf}]\nexpect: {params_finite: true}\n"));
  EXPECT_TRUE(raised.raised) << why(raised);
  EXPECT_FALSE(raised.harness_error);
  EXPECT_EQ(raised.outcome(), "broke") << why(raised);
}

// A data-parallel defense on a program that trains in one process (checked before any rank starts,
// as `retrace run` does): refused, naming the defense's key. Control: the one-process defense
// (skip_nonfinite) is taken.
TEST(ProgramScenario, ADataParallelDefenseOnAOneProcessProgramNamesItsKey) {
  const ScenarioResult r = run_scenario(program_scenario("world_size: 2\ndefenses: {skip_nonfinite_ranks: true}\n"));
  EXPECT_TRUE(r.harness_error) << why(r);
  EXPECT_NE(r.error.find("key 'defenses.skip_nonfinite_ranks': program 'test.regressor' trains in one process"),
            std::string::npos)
      << r.error;
  EXPECT_FALSE(run_scenario(program_scenario("defenses: {skip_nonfinite: true}\n")).harness_error);
}

TEST(ProgramScenario, DefensesHoldAndTheirControlsBreakOnAUsersProgram) {
  // Gradient NaN: skip holds; without it the parameters go non-finite.
  const std::string fault = "injections: [{type: grad_nonfinite, step: 3}]\n";
  const ScenarioResult held = run_scenario(program_scenario(
      fault +
      "defenses: {skip_nonfinite: true}\nexpect: {params_finite: true, max_skipped_steps: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(held.passed) << why(held);
  EXPECT_TRUE(held.replay_bitwise) << held.replay_report;
  const ScenarioResult control =
      run_scenario(program_scenario(fault + "expect: {params_finite: true, diverges: true}\n"));
  EXPECT_TRUE(control.passed) << why(control);
  ASSERT_NE(control.evidence(), nullptr);
  EXPECT_EQ(control.evidence()->kind, BreakKind::kNonFiniteParams);
  // And the same control claimed to hold fails: the verdict is earned, not assumed.
  const ScenarioResult claimed = run_scenario(program_scenario(fault + "expect: {params_finite: true}\n"));
  EXPECT_FALSE(claimed.passed) << why(claimed);
}

// A buffer the forward updates (BatchNorm's running statistics) takes a skipped step's NaN batch
// before the skip: parameters and momentum finite, the buffer Inf to the end -- the model's eval
// forward reads it (outsider finding: 'held'). Control: the same run without the buffer held.
TEST(ProgramScenario, ABufferLeftNonFiniteBreaksARunThatSkippedItsFault) {
  const std::string rest = "defenses: {skip_nonfinite: true}\n"
                           "injections: [{type: corrupt_batch, step: 3, mode: nan_features}]\n"
                           "expect: {params_finite: true}\n";
  const ScenarioResult r = run_scenario(program_scenario("config: {buffer: true}\n" + rest));
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_TRUE(r.params_finite);
  EXPECT_EQ(r.nonfinite_state, "running_mean");
  EXPECT_EQ(r.nonfinite_state_kind, TensorKind::kBuffer);
  ASSERT_FALSE(r.breakage.empty()) << why(r);
  EXPECT_EQ(r.breakage.front().kind, BreakKind::kNonFiniteBuffers);
  EXPECT_NE(r.breakage.front().detail.find("a buffer non-finite at the end (running_mean)"), std::string::npos)
      << r.breakage.front().detail;
  EXPECT_EQ(ScenarioResult::from_json(r.to_json()).nonfinite_state_kind, TensorKind::kBuffer);
  const ScenarioResult control = run_scenario(program_scenario(rest));
  EXPECT_TRUE(control.passed) << why(control);
  EXPECT_EQ(control.nonfinite_state, "");
}

// A buffer a fault left finite but huge: an overflow of x 1e6 in the segment's output at step 3,
// its gradients clipped to norm 1, puts the running mean ~1e4 and it decays by 0.9 a step -- every
// finite check passes, and the training-mode loss does not read it, but the model's eval forward
// would normalize by it (red-team finding: a BatchNorm's running_var at 8.6e34, 'ok'). Against the
// run with neither the fault nor the defenses (its running mean 0.04, weighed as 1, the floor) the
// buffer ends more than kSaturatedBuffer times larger: broke (saturated_buffers); a x 3e4 overflow
// leaves it ~300, broke too. Controls: the same run without the buffer held; a x 1000 overflow
// leaves the buffer ~11, within the bar (it would not be against 0.04 without the floor): held.
TEST(ProgramScenario, ABufferTheFaultLeftHugeButFiniteHeldNothing) {
  const auto run = [](const std::string& config, const std::string& factor) {
    return run_scenario(program_scenario(config +
                                         "defenses: {clip: {mode: global, max_norm: 1.0}}\n"
                                         "injections: [{type: activation_overflow, step: 3, segment: layer0, "
                                         "factor: " +
                                         factor + "}]\nexpect: {params_finite: true, loss_finite: true}\n"));
  };
  ScenarioResult r = run("config: {buffer: true}\n", "1.0e6");
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_TRUE(r.params_finite);
  ASSERT_FALSE(r.breakage.empty()) << why(r);
  EXPECT_EQ(r.breakage.back().kind, BreakKind::kSaturatedBuffers) << why(r);
  EXPECT_NE(r.breakage.back().detail.find("its buffer 'running_mean' ends with a largest magnitude of "),
            std::string::npos)
      << r.breakage.back().detail;
  EXPECT_NE(r.breakage.back().detail.find("times 1, the floor for a buffer (the run's with neither the fault nor the "
                                          "defenses: 0.0"),
            std::string::npos)
      << r.breakage.back().detail;
  EXPECT_GT(r.buffer_scale.at("running_mean"), 1e4);
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.buffer_scale, r.buffer_scale);
  EXPECT_EQ(back.counterfactual.buffer_scale, r.counterfactual.buffer_scale);
  EXPECT_EQ(back.breakage.back().kind, BreakKind::kSaturatedBuffers);

  r = run("", "1.0e6");
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_TRUE(r.buffer_scale.empty());
  r = run("config: {buffer: true}\n", "1000");
  EXPECT_TRUE(r.passed) << why(r);
  EXPECT_FALSE(r.buffer_scale.empty());
  // x 3e4: the running mean ends ~300, past 100 times the floor (1; that run's is 0.04): broke.
  r = run("config: {buffer: true}\n", "3.0e4");
  EXPECT_EQ(r.outcome(), "broke") << why(r);
  EXPECT_GT(r.buffer_scale.at("running_mean"), 100);
  EXPECT_LT(r.buffer_scale.at("running_mean"), 1e4);
}

// A skipped step whose forward left a buffer non-finite (parameters finite): the replay goes on
// past it, as past any skipped step, and says what is left non-finite (outsider finding: it ended
// there, said 'reproduced bitwise' for the steps before and nothing of why). Without the skip the
// replay ends at the step and says why, and that it did not reach the step asked for.
TEST(ProgramScenario, AReplayGoesOnPastASkippedStepThatLeftABufferNonFiniteAndSaysWhyItEnds) {
  register_builtin_programs();
  const std::string path =
      (std::filesystem::temp_directory_path() / ("buffer-" + std::to_string(::getpid()) + ".trace")).string();
  auto replay = [&](const std::string& defenses) {
    const ScenarioSpec spec = program_scenario("config: {buffer: true}\n" + defenses +
                                               "injections: [{type: corrupt_batch, step: 3, mode: nan_features}]\n");
    {
      std::unique_ptr<Program> program = make_scenario_program(spec);
      Recorder recorder(path, *program);
      record_run(*program, recorder, 6, /*stop_on_nonfinite=*/false);
      recorder.close();
    }
    const TraceReader trace(path);
    std::unique_ptr<Program> again = program_from_trace(trace);
    const ReplayResult rr = Replayer(trace, *again).run();
    std::filesystem::remove(path);
    return rr;
  };
  auto noted = [](const ReplayResult& rr, const std::string& text) {
    return std::any_of(rr.notes.begin(), rr.notes.end(),
                       [&](const std::string& n) { return n.find(text) != std::string::npos; });
  };
  ReplayResult rr = replay("defenses: {skip_nonfinite: true}\n");
  EXPECT_TRUE(rr.reproduced);
  EXPECT_EQ(rr.to_step, 6);
  EXPECT_EQ(rr.ended_early, "");
  EXPECT_TRUE(noted(rr, "step 3 went non-finite and a defense skipped it (")) << rr.to_json();
  EXPECT_TRUE(noted(rr, "its parameters are finite, but its buffer 'running_mean' is non-finite after it (a skip "
                        "does not undo what the step's forward wrote); the replay goes on"))
      << rr.to_json();
  EXPECT_TRUE(noted(rr, "step 6, the last replayed: its loss and parameters are finite, but its buffer "
                        "'running_mean' is non-finite after it"))
      << rr.to_json();
  rr = replay("");
  EXPECT_TRUE(rr.reproduced);
  EXPECT_EQ(rr.to_step, 3);
  EXPECT_EQ(rr.target_step, 6);
  EXPECT_NE(rr.ended_early.find("step 3 went non-finite (loss nan"), std::string::npos) << rr.ended_early;
  EXPECT_NE(rr.ended_early.find(") and no defense skipped it: a replay ends at such a step"), std::string::npos)
      << rr.ended_early;
  EXPECT_TRUE(rr.first_nonfinite.has_value());
}

// A buffer updated inside a checkpointed segment (a BatchNorm's running statistics) is updated
// again by the segment's recompute in backward: twice a step (outsider finding: num_batches_tracked
// 22 after 11 steps, running_var 30% off). DefendedStep::backward puts back what the recompute
// wrote: the same bits as the update outside the segment, over steps and micro-batches. Control:
// the update outside the segment is once a step whatever backward does.
TEST(ProgramScenario, ARecomputeDoesNotUpdateABufferTwice) {
  for (const std::string micro : {"", ", micro_batches: 2"}) {
    Regressor outside("buffer: true" + micro), inside("buffer: segment" + micro);
    for (std::int64_t s = 1; s <= 4; ++s) {
      outside.step(s, outside.batch(s), nullptr);
      inside.step(s, inside.batch(s), nullptr);
    }
    auto running_mean = [](Regressor& p) {
      for (const NamedTensor& n : p.state()) {
        if (n.name == "running_mean") return n.tensor.clone();
      }
      return at::Tensor();
    };
    const at::Tensor a = running_mean(outside), b = running_mean(inside);
    ASSERT_TRUE(a.defined() && b.defined());
    EXPECT_TRUE(a.equal(b)) << micro << "\n" << a << "\n" << b;
    EXPECT_GT(a.abs().sum().item<double>(), 0.0);
  }
}

// A program that sets its LR after begin() overrode an injected spike, which counted as fired
// (outsider finding: a control 'held: the fault did not bite' for a fault that never happened).
// finish() refuses it at the first step whose LR it changed, naming the fix; the spike did not
// fire. Control: the same spike on the program that leaves the LR to begin() breaks the run.
TEST(ProgramScenario, AProgramThatSetsItsLrInsideTheStepIsRefused) {
  const std::string rest = "injections: [{type: lr_spike, step: 3, factor: 1.0e30}]\n"
                           "expect: {params_finite: true, diverges: true}\n";
  const ScenarioResult r = run_scenario(program_scenario("config: {lr_in_step: true}\n" + rest));
  EXPECT_FALSE(r.passed) << why(r);
  EXPECT_EQ(r.raised_at_step, 3) << why(r);
  EXPECT_NE(r.error.find("step 3: the optimizer's LR (group 0) is 0.05, but begin() set it to 5e+28"),
            std::string::npos)
      << r.error;
  EXPECT_NE(r.error.find("set the program's own LR before begin()"), std::string::npos) << r.error;
  ASSERT_FALSE(r.injections.empty());
  EXPECT_TRUE(r.injections[0].fired.empty()) << why(r);
  const ScenarioResult control = run_scenario(program_scenario(rest));
  EXPECT_TRUE(control.passed) << why(control);
}

TEST(ProgramScenario, RollbackAndLossScalingReachTheProgram) {
  const ScenarioResult rollback =
      run_scenario(program_scenario("defenses: {rollback: true}\ninjections: [{type: grad_nonfinite, step: 3}]\n"
                                    "expect: {params_finite: true, min_rollbacks: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(rollback.passed) << why(rollback);
  const ScenarioResult scaling =
      run_scenario(program_scenario("defenses: {loss_scaling: {enabled: true, init_scale: 1024}}\ninjections: [{type: "
                                    "grad_nonfinite, step: 2, mode: inf}]\n"
                                    "expect: {params_finite: true, min_scale_backoffs: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(scaling.passed) << why(scaling);
  EXPECT_EQ(scaling.scale_backoffs, 1);
}

TEST(ProgramScenario, AnUnknownProgramIsAHarnessErrorNamingIt) {
  const ScenarioResult r = run_scenario(parse_scenario_text("name: p\nprogram: no.such\n", "p.yaml"));
  EXPECT_TRUE(r.harness_error);
  EXPECT_NE(r.error.find("key 'program': 'no.such' is not registered in this binary (it has: "), std::string::npos)
      << r.error;
  EXPECT_NE(r.error.find("test.regressor"), std::string::npos) << r.error;
}

TEST(ProgramScenario, DefensesNeedTheProgramsPipeline) {
  const ScenarioResult r =
      run_scenario(program_scenario("config: {pipeline: false}\ndefenses: {skip_nonfinite: true}\n"));
  EXPECT_TRUE(r.harness_error);
  EXPECT_NE(r.error.find("has no defense pipeline"), std::string::npos) << r.error;
  // Control: without defenses or injections, such a program runs.
  const ScenarioResult ok =
      run_scenario(program_scenario("config: {pipeline: false}\nexpect: {params_finite: true}\n"));
  EXPECT_TRUE(ok.passed) << why(ok);
}

TEST(ProgramScenario, AStateWithoutTheDefensesStateIsRefused) {
  const ScenarioResult r =
      run_scenario(program_scenario("config: {forget_defense_state: true}\ndefenses: {loss_scaling: true}\n"));
  EXPECT_TRUE(r.harness_error);
  EXPECT_NE(r.error.find("the program's state() lacks the defenses' 'scaler.scale'"), std::string::npos) << r.error;
  // It names the scenario file and the program: `retrace run` refuses the whole run with it.
  EXPECT_EQ(r.error.rfind("program.yaml: key 'program': program 'test.regressor': ", 0), 0u) << r.error;
}

TEST(ProgramScenario, DiagnoseDoesNotCountAVariantThatStopsTrainingAsAFix) {
  // NaN gradients on every step from 3: skipping them avoids the NaN only by never training
  // again, which is no fix; with the fault on one step only, skipping is one.
  DiagnoseOptions o;
  o.repeats = 1;
  const Diagnosis every = diagnose_scenario(
      program_scenario("injections: [{type: grad_nonfinite, step: 3, duration: 4}]\nexpect: {params_finite: true}\n"),
      o);
  const Diagnosis once = diagnose_scenario(
      program_scenario("injections: [{type: grad_nonfinite, step: 3}]\nexpect: {params_finite: true}\n"), o);
  auto find = [](const Diagnosis& d, const std::string& name) -> const VariantResult* {
    for (const VariantResult& v : d.variants) {
      if (v.name == name) return &v;
    }
    return nullptr;
  };
  const VariantResult* skip_every = find(every, "skip non-finite");
  const VariantResult* skip_once = find(once, "skip non-finite");
  ASSERT_TRUE(skip_every && skip_once) << every.report();
  EXPECT_FALSE(skip_every->fixes) << every.report();
  EXPECT_NE(skip_every->outcome.find("training stopped: 0 of steps 3..6 applied"), std::string::npos) << every.report();
  EXPECT_TRUE(skip_once->fixes) << once.report();
  // The variants a program owns are listed as not tried, with why.
  ASSERT_EQ(once.not_applicable.size(), 3u);
  EXPECT_NE(once.not_applicable[1].find("fp32: program 'test.regressor' sets its precision in its own config"),
            std::string::npos);
  // The re-executed step's injection is named as the cause.
  EXPECT_NE(once.classification.detail.find("without the injections it does not fail"), std::string::npos)
      << once.classification.detail;
}

TEST(ProgramScenario, ASegmentFaultOnASegmentThatNeverRunsSaysWhichRan) {
  const ScenarioResult r = run_scenario(program_scenario(
      "injections: [{type: activation_overflow, step: 2, segment: layer7}]\nexpect: {params_finite: true}\n"));
  EXPECT_FALSE(r.passed);
  EXPECT_EQ(r.segments_seen, std::vector<std::string>{"layer0"});
  bool said = false;
  for (const ExpectationCheck& c : r.checks) {
    said = said || c.observed.find("segment 'layer7' never ran (the segments that ran: layer0)") != std::string::npos;
  }
  EXPECT_TRUE(said) << why(r);
}

// --- record and replay a program scenario -----------------------------------------------------

TEST(ProgramScenario, ATraceOfAProgramScenarioReplaysWithItsDefenses) {
  const ScenarioSpec spec = program_scenario("defenses: {loss_scaling: {enabled: true, init_scale: 256}}\ninjections: "
                                             "[{type: grad_nonfinite, step: 2, mode: inf}]\n");
  register_builtin_programs();  // "retrace.scenario" rebuilds the program from the trace
  const std::string path =
      (std::filesystem::temp_directory_path() / ("program-" + std::to_string(::getpid()) + ".trace")).string();
  {
    std::unique_ptr<Program> program = make_scenario_program(spec);
    EXPECT_EQ(program->name(), "retrace.scenario");
    Recorder recorder(path, *program);
    record_run(*program, recorder, 4, /*stop_on_nonfinite=*/false);
    recorder.close();
  }
  const TraceReader trace(path);
  std::unique_ptr<Program> again = program_from_trace(trace);
  ASSERT_NE(again->defenses(), nullptr);
  EXPECT_TRUE(again->defenses()->options().loss_scaling.enabled);  // the scenario's defenses came back
  ReplayOptions ro;
  ro.provenance = false;
  const ReplayResult rr = Replayer(trace, *again).run(ro);
  EXPECT_TRUE(rr.reproduced) << (rr.first_divergence ? rr.first_divergence->message() : "");
  EXPECT_EQ(rr.to_step, 4);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace retrace
