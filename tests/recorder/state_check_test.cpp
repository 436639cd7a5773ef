// The state round-trip self-check and its replay-side counterpart: a program whose state()
// leaves out Adam's moments is caught while recording, naming the tensors that came out
// otherwise, and a replay of its trace from a later snapshot says its state() is probably
// incomplete. Controls: the same program with a complete state() passes and replays; the check
// leaves the recorded run bit for bit as it is without it.
#include <retrace/cli.h>
#include <retrace/recorder.h>
#include <retrace/records.h>
#include <retrace/replayer.h>
#include <retrace/trainer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <unistd.h>

namespace retrace {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("retrace_state_check_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

// A Linear layer trained by Adam, with dropout on its input (so a step draws from the global CPU
// generator). state() holds Adam's moments and step counts only when `complete`: the incomplete
// one is the user program the check exists for.
class AdamProgram : public Program {
 public:
  enum class Quirk {
    kNone,
    kHiddenWarmUp,      // the loss counts double from the third step on, by a counter state() leaves out
    kGlobalBatch,       // batch() draws from the global generator, against Program's contract
    kNondeterministic,  // the loss is scaled by a process-wide count of steps run, as a kernel
                        // without a deterministic implementation varies from run to run
  };
  AdamProgram(std::string name, bool complete, Quirk quirk = Quirk::kNone)
      : name_(std::move(name)), complete_(complete), quirk_(quirk) {
    torch::manual_seed(11);
    fc_ = torch::nn::Linear(4, 2);
    adam_ = std::make_unique<torch::optim::Adam>(fc_->parameters(), torch::optim::AdamOptions(0.05));
  }
  std::string name() const override { return name_; }
  std::string config() const override { return ""; }

  std::vector<NamedTensor> state() override {
    std::vector<NamedTensor> out;
    for (const auto& p : fc_->named_parameters()) out.push_back({"param." + p.key(), p.value()});
    if (!complete_) return out;
    for (const auto& p : fc_->named_parameters()) {
      const auto it = adam_->state().find(p.value().unsafeGetTensorImpl());
      if (it == adam_->state().end()) continue;  // before the first step
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
      out.push_back({"optim." + p.key() + ".step", at::scalar_tensor(s.step(), at::kLong)});
      out.push_back({"optim." + p.key() + ".exp_avg", s.exp_avg()});
      out.push_back({"optim." + p.key() + ".exp_avg_sq", s.exp_avg_sq()});
    }
    return out;
  }

  void load_state(const std::vector<NamedTensor>& state) override {
    std::map<std::string, at::Tensor> by_name;
    for (const NamedTensor& n : state) by_name[n.name] = n.tensor;
    torch::NoGradGuard no_grad;
    adam_->state().clear();  // what state() does not hold is cleared (Program::load_state)
    for (const auto& p : fc_->named_parameters()) {
      p.value().copy_(by_name.at("param." + p.key()));
      p.value().mutable_grad() = at::Tensor();
      const std::string prefix = "optim." + p.key() + ".";
      if (!by_name.count(prefix + "step")) continue;
      auto s = std::make_unique<torch::optim::AdamParamState>();
      s->step(by_name.at(prefix + "step").item<std::int64_t>());
      s->exp_avg(by_name.at(prefix + "exp_avg").clone());
      s->exp_avg_sq(by_name.at(prefix + "exp_avg_sq").clone());
      adam_->state()[p.value().unsafeGetTensorImpl()] = std::move(s);
    }
  }

  std::vector<NamedTensor> batch(std::int64_t step) override {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(step));
    if (quirk_ == Quirk::kGlobalBatch) gen = at::detail::getDefaultCPUGenerator();
    at::Tensor x = at::randn({8, 4}, gen, at::kFloat);
    at::Tensor y = at::randn({8, 2}, gen, at::kFloat);
    return {{"x", x}, {"y", y}};
  }

  StepOutcome step(std::int64_t, const std::vector<NamedTensor>& batch, StepMonitor* monitor) override {
    adam_->zero_grad();
    const at::Tensor x = torch::dropout(batch[0].tensor, 0.25, /*train=*/true);
    at::Tensor loss = torch::mse_loss(fc_->forward(x), batch[1].tensor);
    if (quirk_ == Quirk::kHiddenWarmUp && steps_taken_ >= 2) loss = loss * 2;
    static int runs = 0;  // every instance's steps: the live program's and each check copy's
    if (quirk_ == Quirk::kNondeterministic) loss = loss * (1.0 + 1e-3 * (runs++ % 3));
    ++steps_taken_;
    loss.backward();
    std::vector<NamedTensor> grads;
    double squares = 0;
    for (const auto& p : fc_->named_parameters()) {
      grads.push_back({"grad." + p.key(), p.value().grad()});
      squares += p.value().grad().pow(2).sum().item<double>();
    }
    if (monitor) monitor->after_backward(loss, grads);
    adam_->step();
    StepOutcome out;
    out.loss = loss.item<double>();
    out.grad_norm = std::sqrt(squares);
    out.clipped_grad_norm = out.grad_norm;
    out.lr = 0.05;
    return out;
  }
  std::int64_t default_steps() const override { return 4; }
  double lr() const override { return 0.05; }

 private:
  std::string name_;
  bool complete_;
  Quirk quirk_;
  std::int64_t steps_taken_ = 0;
  torch::nn::Linear fc_{nullptr};
  std::unique_ptr<torch::optim::Adam> adam_;
};

const char* kIncomplete = "test.adam.incomplete";
const char* kComplete = "test.adam.complete";
const char* kWarmup = "test.adam.warmup";             // complete but for its hidden warm-up counter
const char* kGlobalBatch = "test.adam.global_batch";  // complete, its batch() drawn from the global generator
const char* kNondet = "test.adam.nondeterministic";   // complete, its step not deterministic

void register_adam_programs() {
  register_program(kWarmup, [](const std::string&) {
    return std::make_unique<AdamProgram>(kWarmup, true, AdamProgram::Quirk::kHiddenWarmUp);
  });
  register_program(kGlobalBatch, [](const std::string&) {
    return std::make_unique<AdamProgram>(kGlobalBatch, true, AdamProgram::Quirk::kGlobalBatch);
  });
  register_program(kNondet, [](const std::string&) {
    return std::make_unique<AdamProgram>(kNondet, true, AdamProgram::Quirk::kNondeterministic);
  });
  register_program(kIncomplete, [](const std::string&) { return std::make_unique<AdamProgram>(kIncomplete, false); });
  register_program(kComplete, [](const std::string&) { return std::make_unique<AdamProgram>(kComplete, true); });
}

struct Recording {
  std::string path;
  std::vector<StepOutcome> outcomes;
  RecorderStats stats;
};

Recording record(Program& program, const std::string& name, RecorderOptions options, std::int64_t steps,
                 const std::function<void(std::int64_t, const StepOutcome&)>& after_step = {}) {
  Recording r;
  r.path = temp_path(name);
  Recorder recorder(r.path, program, options);
  r.outcomes = record_run(program, recorder, steps, /*stop_on_nonfinite=*/true, after_step);
  recorder.close();
  r.stats = recorder.stats();
  return r;
}

// Every record of a trace as one line: type, step, and each tensor's name and digest.
std::vector<std::string> trace_digests(const std::string& path) {
  const TraceReader trace(path);
  std::vector<std::string> lines;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const Record rec = trace.read(i);
    std::string line = std::to_string(static_cast<int>(rec.type)) + " step " + std::to_string(trace.records()[i].step);
    for (const TensorEntry& e : rec.tensors) line += " " + e.name + "=" + e.digest.hex();
    lines.push_back(line);
  }
  return lines;
}

ReplayResult replay(const std::string& path, ReplayOptions options = {}, BuildFor build = BuildFor::kReplay) {
  const TraceReader trace(path);
  std::unique_ptr<Program> program = program_from_trace(trace, build);
  return Replayer(trace, *program).run(options);
}

// A program that skips its initialization when it is built for a replay (restoring_state()):
// its weight, which state() holds, is made NaN instead of drawn -- the worst that uninitialized
// memory could hold. It also multiplies its input by a fixed random mask drawn in the
// constructor: with `mask_in_state` state() holds the mask too, and under restoring_state() it is
// NaN as well; without, state() leaves the mask out and it is still skipped -- the mistake the
// self-check and the replay must catch. SGD without momentum: state() is the weight (and the mask).
class SkipsInitProgram : public Program {
 public:
  static inline bool last_built_restoring = false;

  SkipsInitProgram(std::string name, bool mask_in_state) : name_(std::move(name)), mask_in_state_(mask_in_state) {
    last_built_restoring = restoring_state();
    torch::manual_seed(5);
    if (restoring_state()) {
      w_ = at::full({2, 4}, std::nan(""));
      mask_ = at::full({4}, std::nan(""));
    } else {
      w_ = torch::randn({2, 4});
      mask_ = torch::randn({4});
    }
    w_.requires_grad_();
    sgd_ = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{w_}, torch::optim::SGDOptions(0.1));
  }
  std::string name() const override { return name_; }
  std::string config() const override { return ""; }
  std::vector<NamedTensor> state() override {
    std::vector<NamedTensor> out{{"param.w", w_, TensorKind::kParameter}};
    if (mask_in_state_) out.push_back({"buffer.mask", mask_, TensorKind::kBuffer});
    return out;
  }
  void load_state(const std::vector<NamedTensor>& state) override {
    torch::NoGradGuard no_grad;
    for (const NamedTensor& n : state) {
      if (n.name == "param.w") w_.copy_(n.tensor);
      if (n.name == "buffer.mask") mask_.copy_(n.tensor);
    }
    w_.mutable_grad() = at::Tensor();
  }
  std::vector<NamedTensor> batch(std::int64_t step) override {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(step));
    return {{"x", at::randn({8, 4}, gen, at::kFloat), TensorKind::kInput},
            {"y", at::randn({8, 2}, gen, at::kFloat), TensorKind::kTarget}};
  }
  StepOutcome step(std::int64_t, const std::vector<NamedTensor>& batch, StepMonitor* monitor) override {
    sgd_->zero_grad();
    const at::Tensor loss = torch::mse_loss((batch[0].tensor * mask_).matmul(w_.t()), batch[1].tensor);
    loss.backward();
    if (monitor) monitor->after_backward(loss, {{"grad.w", w_.grad(), TensorKind::kGradient}});
    StepOutcome out;
    out.grad_norm = w_.grad().norm().item<double>();
    out.clipped_grad_norm = out.grad_norm;
    sgd_->step();
    out.loss = loss.item<double>();
    return out;
  }
  std::int64_t default_steps() const override { return 4; }

 private:
  std::string name_;
  bool mask_in_state_;
  at::Tensor w_, mask_;
  std::unique_ptr<torch::optim::SGD> sgd_;
};

const char* kSkipsInState = "test.skips_init.in_state";
const char* kSkipsOutside = "test.skips_init.outside_state";

void register_init_skipping_programs() {
  register_program(kSkipsInState,
                   [](const std::string&) { return std::make_unique<SkipsInitProgram>(kSkipsInState, true); });
  register_program(kSkipsOutside,
                   [](const std::string&) { return std::make_unique<SkipsInitProgram>(kSkipsOutside, false); });
}

// The incomplete program fails the check at step 2: the copy restored from state() starts Adam
// afresh, so the parameters come out otherwise; the error names them and says why. record_run
// stops there, with step 2 recorded and the error noted in a readable trace.
TEST(RecordStateCheck, StateWithoutAdamMomentsIsCaughtNamingTheTensorsThatDiffer) {
  register_adam_programs();
  AdamProgram program(kIncomplete, false);
  const std::string path = temp_path("incomplete");
  Recorder recorder(path, program);
  try {
    record_run(program, recorder, 4);
    FAIL() << "the incomplete state() passed the self-check";
  } catch (const StateCheckError& e) {
    const StateCheckResult& r = e.result();
    EXPECT_EQ(r.status, StateCheckResult::Status::kFailed);
    EXPECT_EQ(r.step, kStateCheckStep);
    EXPECT_EQ(r.differing, (std::vector<std::string>{"param.weight", "param.bias"})) << e.what();
    EXPECT_EQ(r.state_tensors, 2u);
    const std::string what = e.what();
    EXPECT_NE(what.find("in param.weight, param.bias (2 of 2 state() tensors)"), std::string::npos) << what;
    EXPECT_NE(what.find("state() is probably incomplete"), std::string::npos) << what;
    EXPECT_NE(what.find("optimizer moments"), std::string::npos) << what;
  }
  EXPECT_EQ(recorder.stats().state_check.status, StateCheckResult::Status::kFailed);
  EXPECT_EQ(recorder.stats().steps, 2) << "the run went on past the failed check";

  const TraceReader trace(path);  // closed by record_run: the final name, readable
  EXPECT_FALSE(trace.truncated());
  std::int64_t last_end = 0;
  bool noted = false;
  for (std::size_t i = 0; i < trace.records().size(); ++i) {
    const RecordInfo& info = trace.records()[i];
    if (info.type == RecordType::kStepEnd) last_end = info.step;
    if (info.type != RecordType::kEvent) continue;
    if (const auto ev = EventRecord::decode(trace.read(i), trace.path()).exception) {
      noted = ev->what.find("state() is probably incomplete") != std::string::npos && !ev->raised_by_step;
    }
  }
  EXPECT_EQ(last_end, 2);
  EXPECT_TRUE(noted) << "the trace does not say why the recording stopped";
  fs::remove(path);
}

// A step that is not deterministic is not blamed on state(): two copies from the same start end
// it differently from each other, and the check says so. Control: the incomplete state() above,
// whose two copies agree with each other, is blamed on state().
TEST(RecordStateCheck, AStepThatIsNotDeterministicIsNamedSoNotAnIncompleteState) {
  register_adam_programs();
  AdamProgram program(kNondet, true, AdamProgram::Quirk::kNondeterministic);
  const std::string path = temp_path("nondet");
  Recorder recorder(path, program);
  try {
    record_run(program, recorder, 4);
    FAIL() << "a step that is not deterministic passed the self-check";
  } catch (const StateCheckError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.result().status, StateCheckResult::Status::kFailed);
    EXPECT_NE(what.find("two copies of program 'test.adam.nondeterministic', each"), std::string::npos) << what;
    EXPECT_NE(what.find("ended it differently from each other in "), std::string::npos) << what;
    EXPECT_NE(what.find("the step is not deterministic"), std::string::npos) << what;
    EXPECT_EQ(what.find("probably incomplete"), std::string::npos) << what;
    EXPECT_FALSE(e.result().differing.empty());
  }
  fs::remove(path);
}

// Run by a scenario, the program is recorded under the scenario's wrapper ("retrace.scenario", the
// name replay rebuilds it by); the check's message names the user's program and the scenario, not
// the wrapper alone. Control: the bare program's message above names no scenario.
TEST(RecordStateCheck, AScenariosProgramIsNamedByItsOwnNameAndTheScenario) {
  register_adam_programs();
  register_builtin_programs();
  const std::unique_ptr<Program> program = make_scenario_program(
      parse_scenario_text("name: wrapped-nondet\nprogram: test.adam.nondeterministic\ntraining: {steps: 4}\n"
                          "expect: {params_finite: true}\n",
                          "wrapped.yaml"));
  EXPECT_EQ(program->name(), "retrace.scenario");
  const std::string path = temp_path("wrapped");
  Recorder recorder(path, *program);
  try {
    record_run(*program, recorder, 4);
    FAIL() << "a step that is not deterministic passed the self-check";
  } catch (const StateCheckError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("two copies of program 'test.adam.nondeterministic', run by scenario 'wrapped-nondet' "
                        "(wrapped.yaml), each"),
              std::string::npos)
        << what;
  }
  fs::remove(path);
}

// Control: the same program with Adam's state in state() passes, and records all its steps.
TEST(RecordStateCheck, CompleteStatePasses) {
  register_adam_programs();
  AdamProgram program(kComplete, true);
  const Recording r = record(program, "complete", {}, 4);
  EXPECT_EQ(r.outcomes.size(), 4u);
  EXPECT_EQ(r.stats.state_check.status, StateCheckResult::Status::kPassed) << r.stats.state_check.message;
  EXPECT_TRUE(r.stats.state_check.differing.empty());
  EXPECT_EQ(r.stats.state_check.state_tensors, 8u);  // 2 parameters, 3 Adam entries each
  fs::remove(r.path);
}

// The built-in program (AdamW moments and step counts, schedule state) passes too.
TEST(RecordStateCheck, BuiltInProgramPasses) {
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(R"(
name: gpt
model: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, dropout: 0.1}
training: {steps: 3, optimizer: adamw, lr: 0.001, segments: 2}
)",
                                              "gpt"));
  const Recording r = record(program, "builtin", {}, 3);
  EXPECT_EQ(r.stats.state_check.status, StateCheckResult::Status::kPassed) << r.stats.state_check.message;
  fs::remove(r.path);
}

// The check runs on a second program and puts the RNG back: the recorded run -- every digest of
// every record, RNG states and dropout included -- is the same with the check on and off, for the
// Adam program and for the tiny GPT with dropout in checkpointed segments. Control: one extra draw
// from the global generator after step 1, as a check that forgot to restore the RNG would make,
// changes the trace, so the comparison does see such a perturbation.
TEST(RecordStateCheck, RecordedRunIsBitwiseTheSameWithTheCheckOnAndOff) {
  register_adam_programs();
  register_builtin_programs();
  const ScenarioSpec gpt = parse_scenario_text(R"(
name: gpt
model: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, dropout: 0.1}
training: {steps: 3, optimizer: adamw, lr: 0.001, segments: 2}
)",
                                               "gpt");
  RecorderOptions on, off;
  off.state_check = false;
  for (const bool builtin : {false, true}) {
    SCOPED_TRACE(builtin ? "tiny gpt" : "adam");
    auto make = [&]() -> std::unique_ptr<Program> {
      if (builtin) return std::make_unique<ScenarioProgram>(gpt);
      return std::make_unique<AdamProgram>(kComplete, true);
    };
    // Each program built just before its run: construction seeds the global generator.
    const Recording checked = record(*make(), "on", on, 3);
    const Recording unchecked = record(*make(), "off", off, 3);
    const Recording perturbed = record(*make(), "perturbed", off, 3, [](std::int64_t s, const StepOutcome&) {
      if (s == 1) torch::rand({1});
    });
    ASSERT_EQ(checked.stats.state_check.status, StateCheckResult::Status::kPassed);
    EXPECT_EQ(unchecked.stats.state_check.status, StateCheckResult::Status::kNotRun);
    EXPECT_EQ(trace_digests(checked.path), trace_digests(unchecked.path));
    for (std::size_t i = 0; i < checked.outcomes.size(); ++i) {
      EXPECT_EQ(checked.outcomes[i].loss, unchecked.outcomes[i].loss) << "step " << i + 1;
    }
    EXPECT_NE(trace_digests(perturbed.path), trace_digests(unchecked.path)) << "an extra RNG draw went unseen";
    for (const Recording* r : {&checked, &unchecked, &perturbed}) fs::remove(r->path);
  }
}

// A program that cannot be rebuilt by name is not checked, and the result says so; a run too
// short to reach step 2 is not checked either. Control: registered, the same program is checked.
TEST(RecordStateCheck, UnregisteredProgramOrOneStepRunIsSkippedAndSaysWhy) {
  register_adam_programs();
  AdamProgram unregistered("test.adam.unregistered", false);
  const Recording r = record(unregistered, "unregistered", {}, 3);
  EXPECT_EQ(r.outcomes.size(), 3u);
  EXPECT_EQ(r.stats.state_check.status, StateCheckResult::Status::kSkipped);
  EXPECT_NE(r.stats.state_check.message.find("'test.adam.unregistered' is not registered"), std::string::npos)
      << r.stats.state_check.message;

  AdamProgram short_run(kIncomplete, false);
  const Recording one = record(short_run, "one_step", {}, 1);
  EXPECT_EQ(one.stats.state_check.status, StateCheckResult::Status::kSkipped);
  EXPECT_NE(one.stats.state_check.message.find("ended before step 2"), std::string::npos)
      << one.stats.state_check.message;

  AdamProgram registered(kIncomplete, false);
  EXPECT_THROW(record(registered, "registered", {}, 3), StateCheckError);
  for (const std::string& p : {r.path, one.path, temp_path("registered")}) fs::remove(p);
}

// Replay from a snapshot taken after step 1 starts Adam afresh in the incomplete program:
// everything up to the optimizer step matches, the state after it does not, and the divergence
// says the program's state() is probably incomplete. Controls: the complete program reproduces
// from the same snapshot; the incomplete one reproduces from step 1, where its missing moments
// are still the constructor's (a replay from the start cannot see them, hence the record check).
TEST(ReplayStateCheck, SnapshotOfAnIncompleteProgramSaysItsStateIsProbablyIncomplete) {
  register_adam_programs();
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  options.state_check = false;  // record it anyway, as --no-state-check does
  AdamProgram incomplete(kIncomplete, false), complete(kComplete, true);
  const Recording bad = record(incomplete, "replay_incomplete", options, 3);
  const Recording good = record(complete, "replay_complete", options, 3);
  ReplayOptions at3;
  at3.step = 3;

  const ReplayResult r = replay(bad.path, at3);
  EXPECT_EQ(r.from_step, 3);
  ASSERT_TRUE(r.first_divergence);
  const Divergence& d = *r.first_divergence;
  EXPECT_EQ(d.step, 3);
  EXPECT_EQ(d.segment, "(state)");
  EXPECT_EQ(d.phase, "optimizer");
  EXPECT_EQ(d.tensor, "state.param.weight");
  EXPECT_NE(d.message().find("the program's state() is probably incomplete"), std::string::npos) << d.message();
  EXPECT_EQ(d.to_json()["hint"], d.hint);
  EXPECT_NE(d.to_json()["message"].get<std::string>().find("probably incomplete"), std::string::npos);

  const ReplayResult ok = replay(good.path, at3);
  EXPECT_TRUE(ok.reproduced) << (ok.first_divergence ? ok.first_divergence->message() : "");

  ReplayOptions from1 = at3;
  from1.from = 1;
  const ReplayResult start = replay(bad.path, from1);
  EXPECT_EQ(start.from_step, 1);
  EXPECT_TRUE(start.reproduced) << (start.first_divergence ? start.first_divergence->message() : "");
  fs::remove(bad.path);
  fs::remove(good.path);
}

// Writes the trace at `from` again to `to`, record by record; `edit` may change a record's
// metadata and its tensors (tensors[k] is r.tensors[k]: decoded where stored, else digest-only).
void rewrite_trace(const std::string& from, const std::string& to,
                   const std::function<void(Record& r, std::int64_t step, std::vector<TensorToWrite>& tensors)>& edit) {
  const TraceReader in(from);
  nlohmann::json header = in.header();
  header.erase("format_version");
  header.erase("writer");
  TraceWriter out(to, header);
  for (std::size_t i = 0; i < in.records().size(); ++i) {
    Record r = in.read(i);
    std::vector<TensorToWrite> tensors;
    for (const TensorEntry& e : r.tensors) {
      if (!e.has_data()) {  // a step_end's digests (dtype and shape from a meta tensor: no bytes)
        const at::Tensor like = at::empty(e.shape, at::TensorOptions().dtype(e.dtype).device(at::kMeta));
        tensors.push_back(TensorToWrite::digest_only(e.name, like, e.digest));
      } else {
        tensors.push_back({e.name, in.decode(r, e), true, std::nullopt});
      }
    }
    r.meta.erase("tensors");
    edit(r, in.records()[i].step, tensors);
    out.append(r.type, r.meta, tensors);
  }
  out.close();
}

// The trace at `from` with the state of `step`'s step_begin stored only as digests, as if it held
// no snapshot of that step.
void drop_snapshot(const std::string& from, const std::string& to, std::int64_t step) {
  rewrite_trace(from, to, [step](Record& r, std::int64_t s, std::vector<TensorToWrite>& tensors) {
    if (r.type != RecordType::kStepBegin || s != step) return;
    r.meta["full"] = false;
    for (std::size_t k = 0; k < tensors.size(); ++k) {
      const TensorEntry& e = r.tensors[k];
      if (e.name.rfind("state.", 0) == 0 && e.has_data())
        tensors[k] = TensorToWrite::digest_only(e.name, tensors[k].tensor, e.digest);
    }
  });
}

// A counter state() leaves out that matters only from the program's third step on (a warm-up)
// passes the self-check at step 2, where both programs are still before it. Replayed from step
// 3's snapshot, the step diverges before its optimizer step, in the loss: the hint names both
// causes (state() incomplete, not deterministic) and the replay that tells them apart, which
// reproduces. A trace without the first step's snapshot says it cannot tell them apart. Control:
// a divergence that is not in the first step replayed gets no hint (OtherDivergencesGetNoHint).
TEST(ReplayStateCheck, AHiddenWarmUpCounterDivergesFromALaterSnapshotWithAHint) {
  register_adam_programs();
  RecorderOptions options;
  options.mode = RecordMode::kFull;
  AdamProgram warmup(kWarmup, true, AdamProgram::Quirk::kHiddenWarmUp);
  const Recording rec = record(warmup, "warmup", options, 4);
  EXPECT_EQ(rec.stats.state_check.status, StateCheckResult::Status::kPassed) << rec.stats.state_check.message;
  ReplayOptions at3;
  at3.step = 3;
  const ReplayResult r = replay(rec.path, at3);
  EXPECT_EQ(r.from_step, 3);
  ASSERT_TRUE(r.first_divergence);
  const Divergence& d = *r.first_divergence;
  EXPECT_EQ(d.step, 3);
  EXPECT_NE(d.phase, "optimizer") << d.message();
  EXPECT_NE(d.hint.find("the step re-executed from the snapshot of step 3, the first one replayed, diverged in its " +
                        d.phase + ": either the program's state() leaves out something the step depends on"),
            std::string::npos)
      << d.message();
  EXPECT_NE(d.hint.find("or the program is not deterministic; a replay from step 1 (--from 1) tells them apart: it "
                        "reproduces when state() is incomplete"),
            std::string::npos)
      << d.hint;
  EXPECT_EQ(d.to_json()["hint"], d.hint);

  ReplayOptions from1 = at3;
  from1.from = 1;
  const ReplayResult start = replay(rec.path, from1);
  EXPECT_TRUE(start.reproduced) << (start.first_divergence ? start.first_divergence->message() : "");

  const std::string no_start = temp_path("warmup_no_start");
  drop_snapshot(rec.path, no_start, 1);
  const ReplayResult blind = replay(no_start, at3);
  ASSERT_TRUE(blind.first_divergence);
  EXPECT_NE(blind.first_divergence->hint.find("the trace holds no snapshot of the run's first step to tell them apart"),
            std::string::npos)
      << blind.first_divergence->hint;
  fs::remove(rec.path);
  fs::remove(no_start);
}

// A batch() that draws from the global generator moves it between steps in the recorded run, where
// the replay (which re-executes the recorded batch) does not: the steps themselves reproduce. The
// replay calls batch() where the recorded run did, finds that it accounts for the draw, notes the
// program's broken contract and goes on (outsider finding: 'DIVERGED' at step 2 for a run whose every
// step reproduces); the recording says so too. Controls: drawing between the steps elsewhere (the
// training loop, here record_run's after_step) is still a divergence at the next step's RNG state,
// with the hint; a batch drawn from a generator of its own replays bitwise with no note.
TEST(ReplayStateCheck, ABatchDrawnFromTheGlobalGeneratorIsNotedAndTheStepsReplay) {
  register_adam_programs();
  AdamProgram global(kGlobalBatch, true, AdamProgram::Quirk::kGlobalBatch), own(kComplete, true);
  const Recording bad = record(global, "global_batch", {}, 3);
  EXPECT_EQ(bad.stats.batch_drew_rng_step, 1);
  EXPECT_EQ(bad.stats.batch_drew_rng, "the CPU generator's");
  ReplayOptions from1;
  from1.from = 1;
  const ReplayResult r = replay(bad.path, from1);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
  EXPECT_EQ(r.to_step, 3);
  EXPECT_EQ(r.batch_draws_rng_from, 2);  // noted once, at the first step it shows before
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("Program::batch() draws from the global generator (the CPU generator's; first between "
                            "steps 1 and 2)"),
            std::string::npos)
      << r.notes[0];

  const Recording loop =
      record(own, "loop_draws", {}, 3, [](std::int64_t, const StepOutcome&) { (void)at::rand({4}); });
  EXPECT_EQ(loop.stats.batch_drew_rng_step, 0);
  const ReplayResult d = replay(loop.path, from1);
  EXPECT_EQ(d.batch_draws_rng_from, 0);
  ASSERT_TRUE(d.first_divergence);
  EXPECT_EQ(d.first_divergence->step, 2);
  EXPECT_EQ(d.first_divergence->phase, "step_begin");
  EXPECT_EQ(d.first_divergence->detail, "the RNG state differs from the recorded one (the CPU generator's)");
  EXPECT_NE(d.first_divergence->hint.find("where the replay draws nothing, and not in Program::batch()"),
            std::string::npos)
      << d.first_divergence->message();

  AdamProgram own2(kComplete, true);
  const Recording good = record(own2, "own_batch", {}, 3);
  EXPECT_EQ(good.stats.batch_drew_rng_step, 0);
  const ReplayResult ok = replay(good.path, from1);
  EXPECT_TRUE(ok.reproduced) << (ok.first_divergence ? ok.first_divergence->message() : "");
  EXPECT_TRUE(ok.notes.empty());
  fs::remove(bad.path);
  fs::remove(loop.path);
  fs::remove(good.path);
}

// A (state) divergence that is not the restored step's optimizer state gets no hint: the same
// trace replayed from step 1 with step 2's recorded parameters perturbed diverges at step 2's
// step_begin, where the state() comparison is not about what load_state() restored.
TEST(ReplayStateCheck, OtherDivergencesGetNoHint) {
  register_adam_programs();
  // Every step_begin stores the state (a full-mode trace stores it once between two steps, in the
  // step_end: step 2's step_begin would hold none to perturb).
  RecorderOptions options;
  options.every = 1;
  AdamProgram complete(kComplete, true);
  const Recording rec = record(complete, "nohint", options, 3);
  const std::string edited = temp_path("nohint_edited");
  rewrite_trace(rec.path, edited, [](Record& r, std::int64_t step, std::vector<TensorToWrite>& tensors) {
    r.meta.erase("state_as_step_end");
    if (r.type != RecordType::kStepBegin || step != 2) return;
    for (TensorToWrite& t : tensors) {
      if (t.name == "state.param.bias") t.tensor[0] += 1;  // step 2's recorded start state: one element off
    }
  });
  ReplayOptions from1;
  from1.from = 1;
  const ReplayResult r = replay(edited, from1);
  ASSERT_TRUE(r.first_divergence);
  EXPECT_EQ(r.first_divergence->step, 2);
  EXPECT_EQ(r.first_divergence->phase, "step_begin");
  EXPECT_EQ(r.first_divergence->segment, "(state)");
  EXPECT_TRUE(r.first_divergence->hint.empty()) << r.first_divergence->hint;
  fs::remove(rec.path);
  fs::remove(edited);
}

int run_cli(const std::string& program, std::vector<std::string> args, std::string* out, std::string* err) {
  args.insert(args.begin(), "retrace-test");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const bool complete = program == kComplete;
  const int rc = retrace::main(
      static_cast<int>(argv.size()), argv.data(), program,
      [program, complete](const std::string&) { return std::make_unique<AdamProgram>(program, complete); });
  *out = testing::internal::GetCapturedStdout();
  *err = testing::internal::GetCapturedStderr();
  return rc;
}

// A program that skips initializing only what state() holds when built for a replay passes the
// self-check (whose copy is built as replay builds it) and replays bitwise from a later snapshot,
// though its constructor made every such tensor NaN: the snapshot overwrote them all. The
// constructor saw restoring_state() under BuildFor::kReplay only. Control: the program that also
// skips its mask, which state() leaves out, fails the self-check, and a replay of its trace
// (recorded with the check off) does not reproduce; built with BuildFor::kFreshStart (the
// constructor's mask drawn) it does.
TEST(RecordStateCheck, ProgramSkippingInitOnlyOfItsStatePassesAndReplays) {
  register_init_skipping_programs();
  RecorderOptions full;
  full.mode = RecordMode::kFull;
  SkipsInitProgram good_program(kSkipsInState, true);
  EXPECT_FALSE(SkipsInitProgram::last_built_restoring);
  const Recording good = record(good_program, "skips_in_state", full, 4);
  EXPECT_EQ(good.stats.state_check.status, StateCheckResult::Status::kPassed) << good.stats.state_check.message;
  ReplayOptions at3;
  at3.step = 3;
  const ReplayResult r = replay(good.path, at3);
  EXPECT_TRUE(SkipsInitProgram::last_built_restoring);
  EXPECT_EQ(r.from_step, 3);
  EXPECT_TRUE(r.reproduced) << (r.first_divergence ? r.first_divergence->message() : "");
  EXPECT_TRUE(replay(good.path, at3, BuildFor::kFreshStart).reproduced);
  EXPECT_FALSE(SkipsInitProgram::last_built_restoring);

  SkipsInitProgram bad_program(kSkipsOutside, false);
  try {
    record(bad_program, "skips_outside_checked", full, 4);
    FAIL() << "skipping the initialization of a tensor state() leaves out passed the self-check";
  } catch (const StateCheckError& e) {
    EXPECT_EQ(e.result().status, StateCheckResult::Status::kFailed);
    const std::string what = e.what();
    EXPECT_NE(what.find("param.w"), std::string::npos) << what;
    EXPECT_NE(what.find("restoring_state()"), std::string::npos) << what;
  }
  fs::remove(temp_path("skips_outside_checked"));
  RecorderOptions unchecked = full;
  unchecked.state_check = false;
  SkipsInitProgram bad_again(kSkipsOutside, false);
  const Recording bad = record(bad_again, "skips_outside", unchecked, 4);
  const ReplayResult diverged = replay(bad.path, at3);
  EXPECT_EQ(diverged.from_step, 3);
  EXPECT_FALSE(diverged.reproduced);
  EXPECT_TRUE(replay(bad.path, at3, BuildFor::kFreshStart).reproduced);
  fs::remove(good.path);
  fs::remove(bad.path);
}

// `record` of a user's program (retrace::main): the incomplete state() exits 1 with the tensors
// and the cause; --no-state-check records it (exit 0). Control: the complete one exits 0 and says
// the round trip was checked.
TEST(RecordCli, IncompleteStateExitsOneUnlessTheCheckIsOff) {
  const std::string path = temp_path("cli.trace");
  std::string out, err;
  EXPECT_EQ(run_cli(kIncomplete, {"record", "-o", path, "--steps", "3"}, &out, &err), 1) << out << err;
  EXPECT_NE(err.find("in param.weight, param.bias"), std::string::npos) << err;
  EXPECT_NE(err.find("state() is probably incomplete"), std::string::npos) << err;
  EXPECT_NE(err.find("stopped after step 2"), std::string::npos) << err;

  EXPECT_EQ(run_cli(kIncomplete, {"record", "-o", path, "--steps", "3", "--no-state-check"}, &out, &err), 0)
      << out << err;
  EXPECT_EQ(err.find("self-check"), std::string::npos) << err;
  EXPECT_EQ(out.find("round-trip checked"), std::string::npos) << out;

  EXPECT_EQ(run_cli(kComplete, {"record", "-o", path, "--steps", "3"}, &out, &err), 0) << out << err;
  EXPECT_NE(out.find("state() round-trip checked at step 2"), std::string::npos) << out;
  fs::remove(path);
}

}  // namespace
}  // namespace retrace
