#pragma once
// A program is what replay needs to re-execute a step: model, data, loss, optimizer and
// defenses, behind one interface. Built-in scenarios register theirs by name; a user's training
// binary hands its own to retrace::main() (cli.h) to get the same subcommands.

#include <retrace/collectives.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace retrace {

// What a tensor of a program is: the contract every layer selects by (bit flips hit parameters
// or optimizer state, batch corruption hits inputs, the runner checks parameters for non-finite
// values), whatever the program names its tensors.
enum class TensorKind : std::uint8_t {
  kOther = 0,       // not selected by any layer (the default for a tensor a program does not mark)
  kParameter,       // a trained weight (state())
  kBuffer,          // a module buffer (state())
  kOptimizerState,  // moments, momentum buffers, step counts (state())
  kDefenseState,    // a defense's or schedule's state: loss scale, LR schedule, clipping window
  kInput,           // a batch tensor the model reads: what corrupt_batch corrupts and
                    // validate_batch checks (token ids or features)
  kTarget,          // a batch tensor the loss compares against (labels)
  kGradient,        // a parameter's gradient (StepMonitor::after_backward)
};
const char* to_string(TensorKind kind);  // "parameter", "optimizer_state", ...
// The kind to_string() names; kOther for a name it does not know (a newer writer's kind).
TensorKind tensor_kind_from_string(const std::string& name);

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
  TensorKind kind = TensorKind::kOther;
};

struct StepOutcome {
  double loss = std::numeric_limits<double>::quiet_NaN();
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // before clipping
  double loss_scale = 1.0;                                      // at the step's start
  double loss_scale_after = 1.0;  // after the step's update (what the next step starts with)
  double lr = 0.0;
  // Clipping: the factor the gradients were multiplied by (1: not clipped; per-tensor clipping
  // has one per tensor, so this is 1 there) and the total norm after clipping (grad_norm when
  // nothing was clipped). NaN when the gradients were not clipped because they were non-finite.
  double clip_coef = 1.0;
  double clipped_grad_norm = std::numeric_limits<double>::quiet_NaN();
  bool skipped = false;  // the optimizer step was skipped (e.g. non-finite grads)
  // Why it was skipped, e.g. "non-finite gradients", "loss scaler: non-finite gradients, scale
  // backed off", "invalid batch: ...", "non-finite loss; restored the state from the start of step 3".
  std::string skip_reason;
  bool rolled_back = false;         // the step's starting state was restored after a non-finite step
  std::int64_t rolled_back_to = 0;  // ... the state from the start of this step (0: no rollback)
  // Injections that fired in this step, one line each ("activation_overflow block0..block1 ..."):
  // the recorder tags them in the trace so an injected fault is never taken for a real one.
  std::vector<std::string> injected;
  bool finite() const;
};

// Called by a program inside step(): after backward, before clipping and the optimizer step.
class Defenses;  // retrace/defenses.h

class StepMonitor {
 public:
  virtual ~StepMonitor() = default;
  virtual void after_backward(const at::Tensor& loss, const std::vector<NamedTensor>& grads) {}
};

class Program {
 public:
  virtual ~Program() = default;
  // The registry name that rebuilds this program, and the config text it rebuilds from.
  virtual std::string name() const = 0;
  virtual std::string config() const = 0;
  // The complete training state in a stable order: parameters, buffers, optimizer state,
  // scaler and schedule state. Tensors may alias live state; callers copy what they keep.
  virtual std::vector<NamedTensor> state() = 0;
  // Restores state() exactly (bitwise); entries absent from `state` that the program holds
  // (e.g. optimizer moments before the first step) are cleared. `state` may hold the program's
  // own tensors: a replay decodes a snapshot straight into them where they fit
  // (in_place_targets, restore.h) and passes them back, so copying an entry onto itself must be
  // harmless (docs/replay.md).
  virtual void load_state(const std::vector<NamedTensor>& state) = 0;
  // load_state() from tensors the caller gives up: the program may keep them as its own instead
  // of copying them (the replayer hands over the snapshot it decoded, 1.2 GB for GPT-2 small with
  // AdamW). The default calls load_state(); override it where the copies cost.
  virtual void adopt_state(std::vector<NamedTensor> state) { load_state(state); }
  // The batch of `step`, deterministic in (config, step).
  virtual std::vector<NamedTensor> batch(std::int64_t step) = 0;
  // One optimizer step on `batch`. Calls monitor->after_backward when monitor is set.
  virtual StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch, StepMonitor* monitor) = 0;
  // Steps a run takes when not told otherwise.
  virtual std::int64_t default_steps() const { return 1; }
  // The learning rate and loss scale the next step will use (recorded with each step).
  virtual double lr() const { return 0.0; }
  virtual double loss_scale() const { return 1.0; }
  // The defense pipeline the program's step() runs through (retrace/defenses.h), or nullptr. A
  // scenario's defenses and injections reach a program through it (Defenses::configure), and
  // the scenario runner reads what the defenses did from it.
  virtual Defenses* defenses() { return nullptr; }
  // A data-parallel program: which rank of how many this process trains as, and the run id the
  // ranks share (the recorder writes it into the trace's header; replay rebuilds the program as
  // that rank, alone). A single-process program keeps the default.
  virtual RankInfo ranks() const { return {}; }
  // How messages name this program: "program 'NAME'" by default. A program that wraps another
  // names the one it wraps (a scenario's: "program 'my.trainer', run by scenario 'x'").
  virtual std::string describe() const { return "program '" + name() + "'"; }
};

using ProgramFactory = std::function<std::unique_ptr<Program>(const std::string& config)>;

// Registers a factory under `name` (replacing any earlier one). Thread-safe.
void register_program(const std::string& name, ProgramFactory factory);
// Builds a registered program; throws retrace::Error naming the known programs otherwise, and
// "program 'NAME' refuses its config: ..." for anything its factory throws.
std::unique_ptr<Program> make_program(const std::string& name, const std::string& config);
std::vector<std::string> registered_programs();

// Whether the program being built will have every tensor of its state() overwritten from a
// snapshot before any step runs: true on this thread while a RestoringStateScope lives, as
// program_from_trace(trace, BuildFor::kReplay) keeps one around the factory (Replayer::run then
// restores the anchor's snapshot through load_state / adopt_state). A constructor may then skip
// drawing the initial values of what state() holds -- random init is serial, 0.75 s for GPT-2
// small's 98M parameters on a 2-core CPU -- but must still make every such tensor with its
// dtype, shape and device (at::empty). Nothing outside state() may be left uninitialized: the
// replay restores only state(). The built-in models do this (harness/models.cpp).
bool restoring_state();
class RestoringStateScope {
 public:
  RestoringStateScope();
  ~RestoringStateScope();
  RestoringStateScope(const RestoringStateScope&) = delete;
  RestoringStateScope& operator=(const RestoringStateScope&) = delete;

 private:
  bool previous_;
};

// Registers a program at static-initialization time, for binaries that never call
// retrace::main (a gtest binary with RETRACE_SCENARIO_TEST):
//   static retrace::ProgramRegistration reg("my.trainer", [](const std::string& config) {
//     return std::make_unique<MyTrainer>(config); });
struct ProgramRegistration {
  ProgramRegistration(const std::string& name, ProgramFactory factory) { register_program(name, std::move(factory)); }
};

// Detached copies of `tensors` (names and kinds kept): a snapshot that later steps cannot change.
std::vector<NamedTensor> clone_all(const std::vector<NamedTensor>& tensors);
// The tensors of `tensors` of kind `kind`, in order.
std::vector<NamedTensor> of_kind(const std::vector<NamedTensor>& tensors, TensorKind kind);
// Every floating-point tensor of kind parameter in `state` is finite.
bool parameters_finite(const std::vector<NamedTensor>& state);

}  // namespace retrace
