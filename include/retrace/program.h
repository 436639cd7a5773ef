#pragma once
// A program is what replay needs to re-execute a step: model, data, loss, optimizer and
// defenses, behind one interface. Built-in scenarios register theirs by name; a user's training
// binary hands its own to retrace::main() (cli.h) to get the same subcommands.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace retrace {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

struct StepOutcome {
  double loss = std::numeric_limits<double>::quiet_NaN();
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // before clipping
  double loss_scale = 1.0;       // at the step's start
  double loss_scale_after = 1.0; // after the step's update (what the next step starts with)
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
  bool rolled_back = false;  // the step's starting state was restored after a non-finite step
  // Injections that fired in this step, one line each ("activation_overflow block0..block1 ..."):
  // the recorder tags them in the trace so an injected fault is never taken for a real one.
  std::vector<std::string> injected;
  bool finite() const;
};

// Called by a program inside step(): after backward, before clipping and the optimizer step.
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
  // (e.g. optimizer moments before the first step) are cleared.
  virtual void load_state(const std::vector<NamedTensor>& state) = 0;
  // The batch of `step`, deterministic in (config, step).
  virtual std::vector<NamedTensor> batch(std::int64_t step) = 0;
  // One optimizer step on `batch`. Calls monitor->after_backward when monitor is set.
  virtual StepOutcome step(std::int64_t step, const std::vector<NamedTensor>& batch,
                           StepMonitor* monitor) = 0;
  // Steps a run takes when not told otherwise.
  virtual std::int64_t default_steps() const { return 1; }
  // The learning rate and loss scale the next step will use (recorded with each step).
  virtual double lr() const { return 0.0; }
  virtual double loss_scale() const { return 1.0; }
};

using ProgramFactory = std::function<std::unique_ptr<Program>(const std::string& config)>;

// Registers a factory under `name` (replacing any earlier one). Thread-safe.
void register_program(const std::string& name, ProgramFactory factory);
// Builds a registered program; throws retrace::Error naming the known programs otherwise.
std::unique_ptr<Program> make_program(const std::string& name, const std::string& config);
std::vector<std::string> registered_programs();

}  // namespace retrace
