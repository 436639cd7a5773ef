// A user's own program under scenarios: the defense pipeline's public pieces (retrace/defenses.h),
// tensor kinds instead of name prefixes, `program:` + `config:` in scenario files, and the runner,
// recorder and replayer on a program that is none of the built-in models. Each rule has a case
// that meets it and a control built to trip it.
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

#include <cmath>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace retrace {
namespace {

// A user's program with its own names: weights "w1"/"w2", momentum buffers "momentum.w1" (not
// retrace's "optim." convention), features "x" and targets "y". SGD with momentum; a two-layer
// tanh regressor, the first layer checkpointed as "layer0". Config: "lr: X" (default 0.05) and
// "pipeline: false" (no defense pipeline).
class Regressor : public Program {
 public:
  explicit Regressor(const std::string& config) : config_(config) {
    if (config.find("lr: ") != std::string::npos) lr_ = std::stod(config.substr(config.find("lr: ") + 4));
    pipeline_ = config.find("pipeline: false") == std::string::npos;
    forget_defense_state_ = config.find("forget_defense_state: true") != std::string::npos;
    torch::manual_seed(7);
    w1_ = (torch::randn({8, 16}) * 0.3).requires_grad_();
    w2_ = (torch::randn({16, 1}) * 0.3).requires_grad_();
    optimizer_ = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{w1_, w2_},
                                                     torch::optim::SGDOptions(lr_).momentum(0.9));
    params_ = {{"w1", w1_, TensorKind::kParameter}, {"w2", w2_, TensorKind::kParameter}};
    defenses_.attach(*this, *optimizer_, params_);
  }
  std::string name() const override { return "test.regressor"; }
  std::string config() const override { return config_; }
  std::int64_t default_steps() const override { return 6; }
  std::vector<NamedTensor> state() override {
    std::vector<NamedTensor> out = params_;
    for (const NamedTensor& p : params_) {
      auto it = optimizer_->state().find(p.tensor.unsafeGetTensorImpl());
      if (it == optimizer_->state().end()) continue;
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      out.push_back({"momentum." + p.name, s.momentum_buffer(), TensorKind::kOptimizerState});
    }
    if (!forget_defense_state_) {
      for (NamedTensor& n : defenses_.state()) out.push_back(std::move(n));
    }
    return out;
  }
  void load_state(const std::vector<NamedTensor>& state) override {
    copy_state_into(params_, state);
    optimizer_->state().clear();
    for (const NamedTensor& p : params_) {
      for (const NamedTensor& s : state) {
        if (s.name != "momentum." + p.name) continue;
        auto st = std::make_unique<torch::optim::SGDParamState>();
        st->momentum_buffer(s.tensor.clone());
        optimizer_->state()[p.tensor.unsafeGetTensorImpl()] = std::move(st);
      }
    }
    defenses_.load_state(state);
  }
  std::vector<NamedTensor> batch(std::int64_t step) override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    const at::Tensor x = at::randn({32, 8}, gen);
    return {{"x", x, TensorKind::kInput}, {"y", x.sum(1, true).sin(), TensorKind::kTarget}};
  }
  StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch_in, StepMonitor* monitor) override {
    DefendedStep s = defenses_.begin(step, monitor);
    const std::vector<NamedTensor> batch = s.batch(batch_in);
    if (s.done()) return s.finish();
    optimizer_->zero_grad();
    at::Tensor loss;
    {
      const auto forward = s.forward();
      const at::Tensor h = checkpoint("layer0", [this](const at::Tensor& x) { return torch::tanh(x.matmul(w1_)); }, batch[0].tensor);
      loss = torch::mse_loss(h.matmul(w2_), batch[1].tensor);
    }
    s.backward(loss);
    return s.finish();
  }
  Defenses* defenses() override { return pipeline_ ? &defenses_ : nullptr; }
  torch::optim::SGD& optimizer() { return *optimizer_; }

 private:
  std::string config_;
  double lr_ = 0.05;
  bool pipeline_ = true, forget_defense_state_ = false;
  at::Tensor w1_, w2_;
  std::unique_ptr<torch::optim::SGD> optimizer_;
  std::vector<NamedTensor> params_;
  Defenses defenses_;
};

const ProgramRegistration registration("test.regressor", [](const std::string& config) {
  return std::make_unique<Regressor>(config);
});

ScenarioSpec program_scenario(const std::string& body) {
  return parse_scenario_text("name: p\nprogram: test.regressor\ntraining: {steps: 6}\n" + body, "program.yaml");
}

std::string why(const ScenarioResult& r) {
  std::string out = r.verdict() + (r.error.empty() ? "" : " error: " + r.error) + "\n";
  for (const ExpectationCheck& c : r.checks) out += "  " + c.name + ": " + c.expected + " / " + c.observed + (c.passed ? "" : " FAILED") + "\n";
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
  const ScenarioSpec s = program_scenario("config: {lr: 0.01, layers: [1, 2]}\ndefenses: {skip_nonfinite: true, lr_scale: 0.5}\n");
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

TEST(ProgramScenario, BuiltInOnlyKeysAreRefusedWithTheirLine) {
  const std::string head = "name: p\nprogram: test.regressor\n";
  expect_error(head + "model: {type: mlp}\n", "program.yaml:3: key 'model': describes a built-in model");
  expect_error(head + "data: {batch: 2}\n", "key 'data'");
  expect_error(head + "training: {steps: 3, lr: 0.1}\n", "key 'training.lr': applies to the built-in models only");
  expect_error(head + "defenses: {layernorm_fp32: true}\n", "key 'defenses.layernorm_fp32': acts inside the built-in models");
  expect_error(head + "config: [1, 2]\n", "key 'config': must be a mapping");
  expect_error("name: p\nmodel: {type: mlp}\nconfig: {lr: 1}\n", "key 'config': is the configuration of a registered program; it needs 'program: NAME'");
  expect_error(head + "injections: [{type: corrupt_batch, step: 1}]\n", "key 'injections[0].mode': is required");
  expect_error("name: p\nmodel: {type: mlp}\ndefenses: {clip: {mode: hard}}\n", "must be one of off, global, per_tensor, adaptive");
  // Control: the same keys are fine for a built-in model.
  EXPECT_NO_THROW(parse_scenario_text("name: p\nmodel: {type: mlp}\ndata: {batch: 2}\ntraining: {steps: 3, lr: 0.1}\n", "ok.yaml"));
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
  const ScenarioResult broke = run_scenario(program_scenario(
      "injections: [{type: corrupt_batch, step: 2, mode: nan_features}]\nexpect: {params_finite: true, diverges: true}\n"));
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

TEST(ProgramScenario, DefensesHoldAndTheirControlsBreakOnAUsersProgram) {
  // Gradient NaN: skip holds; without it the parameters go non-finite.
  const std::string fault = "injections: [{type: grad_nonfinite, step: 3}]\n";
  const ScenarioResult held = run_scenario(program_scenario(
      fault + "defenses: {skip_nonfinite: true}\nexpect: {params_finite: true, max_skipped_steps: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(held.passed) << why(held);
  EXPECT_TRUE(held.replay_bitwise) << held.replay_report;
  const ScenarioResult control = run_scenario(program_scenario(fault + "expect: {params_finite: true, diverges: true}\n"));
  EXPECT_TRUE(control.passed) << why(control);
  ASSERT_NE(control.evidence(), nullptr);
  EXPECT_EQ(control.evidence()->kind, BreakKind::kNonFiniteParams);
  // And the same control claimed to hold fails: the verdict is earned, not assumed.
  const ScenarioResult claimed = run_scenario(program_scenario(fault + "expect: {params_finite: true}\n"));
  EXPECT_FALSE(claimed.passed) << why(claimed);
}

TEST(ProgramScenario, RollbackAndLossScalingReachTheProgram) {
  const ScenarioResult rollback = run_scenario(program_scenario(
      "defenses: {rollback: true}\ninjections: [{type: grad_nonfinite, step: 3}]\n"
      "expect: {params_finite: true, min_rollbacks: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(rollback.passed) << why(rollback);
  const ScenarioResult scaling = run_scenario(program_scenario(
      "defenses: {loss_scaling: {enabled: true, init_scale: 1024}}\ninjections: [{type: grad_nonfinite, step: 2, mode: inf}]\n"
      "expect: {params_finite: true, min_scale_backoffs: 1, replay_bitwise: true}\n"));
  EXPECT_TRUE(scaling.passed) << why(scaling);
  EXPECT_EQ(scaling.scale_backoffs, 1);
}

TEST(ProgramScenario, AnUnknownProgramIsAHarnessErrorNamingIt) {
  const ScenarioResult r = run_scenario(parse_scenario_text("name: p\nprogram: no.such\n", "p.yaml"));
  EXPECT_TRUE(r.harness_error);
  EXPECT_NE(r.error.find("key 'program': 'no.such' is not registered in this binary (it has: "), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("test.regressor"), std::string::npos) << r.error;
}

TEST(ProgramScenario, DefensesNeedTheProgramsPipeline) {
  const ScenarioResult r = run_scenario(program_scenario("config: {pipeline: false}\ndefenses: {skip_nonfinite: true}\n"));
  EXPECT_TRUE(r.harness_error);
  EXPECT_NE(r.error.find("has no defense pipeline"), std::string::npos) << r.error;
  // Control: without defenses or injections, such a program runs.
  const ScenarioResult ok = run_scenario(program_scenario("config: {pipeline: false}\nexpect: {params_finite: true}\n"));
  EXPECT_TRUE(ok.passed) << why(ok);
}

TEST(ProgramScenario, AStateWithoutTheDefensesStateIsRefused) {
  const ScenarioResult r = run_scenario(program_scenario(
      "config: {forget_defense_state: true}\ndefenses: {loss_scaling: true}\n"));
  EXPECT_TRUE(r.harness_error);
  EXPECT_NE(r.error.find("the program's state() lacks the defenses' 'scaler.scale'"), std::string::npos) << r.error;
}

TEST(ProgramScenario, DiagnoseDoesNotCountAVariantThatStopsTrainingAsAFix) {
  // NaN gradients on every step from 3: skipping them avoids the NaN only by never training
  // again, which is no fix; with the fault on one step only, skipping is one.
  DiagnoseOptions o;
  o.repeats = 1;
  const Diagnosis every = diagnose_scenario(program_scenario(
      "injections: [{type: grad_nonfinite, step: 3, duration: 4}]\nexpect: {params_finite: true}\n"), o);
  const Diagnosis once = diagnose_scenario(program_scenario(
      "injections: [{type: grad_nonfinite, step: 3}]\nexpect: {params_finite: true}\n"), o);
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
  EXPECT_NE(once.not_applicable[1].find("fp32: program 'test.regressor' sets its precision in its own config"), std::string::npos);
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

// --- the pipeline's pieces --------------------------------------------------------------------

TEST(Pipeline, TheProgramsOwnLrComesBackAfterEachStepAndScheduleMultipliesIt) {
  Regressor p("lr: 0.2");
  DefenseOptions o;
  o.warmup_steps = 4;
  p.defenses()->configure(o, {});
  p.optimizer().param_groups()[0].options().set_lr(0.1);  // the program's own scheduler moved it
  const StepOutcome s1 = p.step(1, p.batch(1), nullptr);
  EXPECT_DOUBLE_EQ(s1.lr, 0.1 * 0.25);  // warmup step 1 of 4, on the program's LR
  EXPECT_DOUBLE_EQ(p.optimizer().param_groups()[0].options().get_lr(), 0.1);
  const StepOutcome s2 = p.step(2, p.batch(2), nullptr);
  EXPECT_DOUBLE_EQ(s2.lr, 0.1 * 0.5);
}

TEST(Pipeline, PlateauCutsOnlyWhenTheChangeExceedsEps) {
  PlateauOptions plateau;
  plateau.enabled = true;
  plateau.patience = 0;
  plateau.factor = 0.5;
  LrSchedule cut(0, 1.0, plateau);
  cut.on_applied(1.0, 1e-3);
  cut.on_applied(1.0, 1e-3);  // no improvement, patience 0: cut
  EXPECT_DOUBLE_EQ(cut.lr(1e-3), 0.5e-3);
  plateau.eps = 1e-3;  // PyTorch's rule: a cut of 0.5e-3 is not more than eps, so none is made
  LrSchedule kept(0, 1.0, plateau);
  kept.on_applied(1.0, 1e-3);
  kept.on_applied(1.0, 1e-3);
  EXPECT_DOUBLE_EQ(kept.lr(1e-3), 1e-3);
}

TEST(Pipeline, GlobalClippingMatchesTorchsClipGradNorm) {
  torch::manual_seed(1);
  const at::Tensor a = torch::randn({5, 7}) * 3, b = torch::randn({11}) * 3;
  std::vector<at::Tensor> ours = {a.clone(), b.clone()}, theirs = {a.clone().requires_grad_(), b.clone().requires_grad_()};
  for (at::Tensor& t : theirs) t.mutable_grad() = t.detach().clone();
  torch::nn::utils::clip_grad_norm_(theirs, 1.0);
  std::vector<NamedTensor> grads = {{"a", ours[0], TensorKind::kGradient}, {"b", ours[1], TensorKind::kGradient}};
  std::vector<at::Tensor> norms = {ours[0].norm(), ours[1].norm()};
  const double total = at::stack(norms).norm().item<double>();
  ClipOptions o;
  o.mode = ClipMode::kGlobal;
  GradClipper clipper(o);
  const ClipResult r = clipper.clip(grads, norms, total, 1, false);
  EXPECT_TRUE(torch::equal(ours[0], theirs[0].grad())) << "not bitwise";
  EXPECT_TRUE(torch::equal(ours[1], theirs[1].grad())) << "not bitwise";
  EXPECT_LT(r.coef, 1.0);
  // Control: max_norm above the norm leaves the gradients as they were.
  o.max_norm = total * 2;
  std::vector<NamedTensor> same = {{"a", a.clone(), TensorKind::kGradient}};
  GradClipper loose(o);
  loose.clip(same, {same[0].tensor.norm()}, same[0].tensor.norm().item<double>(), 1, false);
  EXPECT_TRUE(torch::equal(same[0].tensor, a));
}

TEST(Pipeline, ANonFiniteNormIsNeverClippedAndErrorIfNonfiniteRaises) {
  ClipOptions o;
  o.mode = ClipMode::kGlobal;
  o.error_if_nonfinite = true;
  GradClipper clipper(o);
  std::vector<NamedTensor> grads = {{"a", torch::tensor({1.0f, INFINITY}), TensorKind::kGradient}};
  EXPECT_THROW(clipper.clip(grads, {grads[0].tensor.norm()}, INFINITY, 4, false), Error);
  const ClipResult r = clipper.clip(grads, {grads[0].tensor.norm()}, INFINITY, 4, /*overflow_is_handled=*/true);
  EXPECT_TRUE(std::isnan(r.coef));
  EXPECT_TRUE(std::isinf(grads[0].tensor[1].item<float>()));  // left as it was
}

TEST(Pipeline, AStepWithoutBackwardIsAnErrorAndLeavesTheLrAsItWas) {
  Regressor p("");
  {
    DefendedStep s = p.defenses()->begin(1);
    s.batch(p.batch(1));
    EXPECT_THROW(s.finish(), Error);
  }
  EXPECT_DOUBLE_EQ(p.optimizer().param_groups()[0].options().get_lr(), 0.05);
  // The pipeline is usable again after the abandoned step.
  const StepOutcome o = p.step(1, p.batch(1), nullptr);
  EXPECT_TRUE(o.finite());
  EXPECT_FALSE(o.skipped);
}

TEST(Pipeline, AForwardWithoutTheBatchStageIsRefused) {
  // Without batch() a step would run without its rollback snapshot and state injections.
  Regressor p("");
  DefenseOptions o;
  o.rollback = true;
  p.defenses()->configure(o, {});
  {
    DefendedStep s = p.defenses()->begin(1);
    EXPECT_THROW((void)s.forward(), Error);
  }
  // Control: in order, the step runs.
  DefendedStep s = p.defenses()->begin(1);
  s.batch(p.batch(1));
  EXPECT_NO_THROW((void)s.forward());
}

TEST(Pipeline, EachStepSaysWhatTheDefensesDid) {
  // Rollback: the step that went non-finite says whose start it restored; loss scaling: the
  // scale it started with and the one after its backoff; clipping: the coefficient.
  Regressor p("");
  DefenseOptions o;
  o.rollback = true;
  o.loss_scaling.enabled = true;
  o.loss_scaling.init_scale = 1024;
  o.clip.mode = ClipMode::kGlobal;
  o.clip.max_norm = 1e-3;
  InjectionSpec nan;
  nan.type = InjectionType::kGradNonFinite;
  nan.step = 2;
  nan.mode = "nan";
  p.defenses()->configure(o, {nan});
  const StepOutcome s1 = p.step(1, p.batch(1), nullptr);
  EXPECT_FALSE(s1.skipped);
  EXPECT_LT(s1.clip_coef, 1.0);  // clipped hard: a norm far above 1e-3
  EXPECT_NEAR(s1.clipped_grad_norm, 1e-3, 1e-6);
  const StepOutcome s2 = p.step(2, p.batch(2), nullptr);
  EXPECT_TRUE(s2.skipped);
  EXPECT_EQ(s2.loss_scale, 1024);
  EXPECT_EQ(s2.loss_scale_after, 512);  // backed off
  EXPECT_FALSE(s2.rolled_back);  // the scaler skipped it and the parameters are finite: nothing to undo
  EXPECT_EQ(s2.rolled_back_to, 0);
  // Control: without the scaler, the NaN is applied and rollback restores step 2's start.
  Regressor q("");
  DefenseOptions r;
  r.rollback = true;
  q.defenses()->configure(r, {nan});
  q.step(1, q.batch(1), nullptr);
  const StepOutcome t2 = q.step(2, q.batch(2), nullptr);
  EXPECT_TRUE(t2.rolled_back);
  EXPECT_EQ(t2.rolled_back_to, 2);
  EXPECT_NE(t2.skip_reason.find("restored the state from the start of step 2"), std::string::npos) << t2.skip_reason;
}

TEST(Pipeline, ClipModeNamesParseOnceAndATypoIsAnError) {
  for (const std::string& name : clip_mode_names()) EXPECT_EQ(to_string(parse_clip_mode(name)), name);
  EXPECT_THROW(parse_clip_mode("adaptiv"), Error);
}

// --- record and replay a program scenario -----------------------------------------------------

TEST(ProgramScenario, ATraceOfAProgramScenarioReplaysWithItsDefenses) {
  const ScenarioSpec spec = program_scenario(
      "defenses: {loss_scaling: {enabled: true, init_scale: 256}}\ninjections: [{type: grad_nonfinite, step: 2, mode: inf}]\n");
  register_builtin_programs();  // "retrace.scenario" rebuilds the program from the trace
  const std::string path = (std::filesystem::temp_directory_path() / ("program-" + std::to_string(::getpid()) + ".trace")).string();
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
