#pragma once
// Numerical fault injectors for training: each one forces a fault that real runs hit (fp16
// overflow, a learning-rate spike, a zero-variance LayerNorm row, a flipped bit, ...) on a seeded
// schedule, so that a scenario can check that the defense meant for it holds -- and, with the
// defense switched off, that the fault really bites.
//
// An Injector is driven by the defense pipeline (retrace/defenses.h) through the hooks below, and is a
// SegmentObserver for the faults that live inside checkpointed segments. Every decision is a pure
// function of (injection seed, step, index): it never draws from LibTorch's generators, so an
// injected run replays bit for bit and an injection never shifts the dropout masks of the run
// (rng_desync excepted: consuming the CPU generator is what it does).
// What fired is reported per step (fired()), and the recorder tags it in the trace, so an
// injected fault is never mistaken for a real one.

#include <retrace/injection_spec.h>
#include <retrace/observer.h>
#include <retrace/program.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace retrace {

// One injection that fired.
struct InjectionEvent {
  std::int64_t step = 0;
  std::string type;       // to_string(InjectionType)
  std::string where;      // segment, tensor name or "loss" / "lr" / "batch"
  std::string detail;     // e.g. "x1e+06", "bit 30 (exponent) 0.0123 -> 4.2e+36"
  std::size_t entry = 0;  // index of the InjectionSpec that fired (its place in the scenario's list)
  // "TYPE WHERE: DETAIL": the step's line (StepOutcome::injected)
  std::string line() const { return type + " " + where + ": " + detail; }
};

// An injection that cannot act on this program (corrupt_batch's nan_features on token ids, or
// token_out_of_range on float features), found when it first falls due: bad input, not the
// fault breaking the run (a scenario run counts it as a harness error).
class InjectionUnsupported : public Error {
 public:
  using Error::Error;
};

// Whether an injection's `segment:` (`wanted`) targets the segment named `segment`: "" targets
// every one; a name, the segment of that name and a range segment holding it ("block1" targets
// "block0..block3": same prefix, its number within the range).
bool segment_targeted(const std::string& wanted, const std::string& segment);

class Injector : public SegmentObserver {
 public:
  explicit Injector(std::vector<InjectionSpec> specs);

  bool empty() const { return specs_.empty(); }
  // The dtype activations are kept in (fp16 for fp16 training). Under autocast the residual
  // stream stays fp32, so kActivationOverflow rounds its scaled outputs through this dtype: a
  // value past fp16's 65504 becomes Inf, as it does in a model whose activations are fp16.
  void set_activation_dtype(at::ScalarType dtype) { activation_dtype_ = dtype; }
  const std::vector<InjectionSpec>& specs() const { return specs_; }
  // A data-parallel run: the rank this process is. A spec with `rank` set fires on that rank only.
  void set_rank(int rank) { rank_ = rank; }
  int rank() const { return rank_; }

  // Call once at the start of each step, before any other hook; clears fired().
  void begin_step(std::int64_t step);
  // LR multiplier for this step (kLrSpike), 1 when none is due.
  double lr_factor();
  // The optimizer step ran with lr_factor()'s LR: each spike in it is noted in fired() now, not
  // when lr_factor() was asked. A step skipped before its update (an invalid batch, a loss
  // scaler's overflow, non-finite gradients) never used the spiked LR, and an injection that did
  // nothing must not count as fired: a defense would "hold" against it.
  void lr_applied();
  // kCorruptBatch: corrupts the tensors of kind kInput in `batch` (copies first; never the
  // caller's storage); token ids become `vocab` + 7.
  void corrupt_batch(std::vector<NamedTensor>& batch, std::int64_t vocab);
  // kBitFlip on weights or optimizer state: flips bits in place in one element of one of
  // `tensors` (chosen by the seed among the floating-point ones of kind kParameter, or
  // kOptimizerState for target optimizer).
  void flip_state(const std::vector<NamedTensor>& state);
  // kLossSpike: the loss to back-propagate.
  at::Tensor on_loss(const at::Tensor& loss);
  // kGradNonFinite: poisons one element of one gradient in place; kBitFlip with target
  // gradients flips bits of one element of one of them (after backward, before any all-reduce).
  void on_grads(const std::vector<NamedTensor>& grads);

  // Segment faults: kActivationOverflow, kLayerNormInput and activation bit flips replace the
  // outputs of the targeted segment in forward and/or, identically, in its recompute (`phase`);
  // kRngDesync draws from the CPU generator after the targeted forward.
  void on_forward(SegmentEvent& event) override;
  void on_recompute(SegmentEvent& event) override;

  // What fired since begin_step(), in order.
  std::vector<InjectionEvent> fired() const;
  // Whether spec `index` is due on `step`: for this rank, inside its window and drawn by its seeded
  // coin. A pure function of (spec, rank, step), so a runner can tell which steps an injection had to fire on.
  // Being due is not firing: a hook may find nothing to hit (no optimizer state yet, a segment
  // that does not run, a bit past the element's width).
  bool scheduled(std::size_t index, std::int64_t step) const;
  // The steps in first..last that spec `index` is due on (scheduled), in order.
  std::vector<std::int64_t> due_steps(std::size_t index, std::int64_t first, std::int64_t last) const;

 private:
  bool fires(std::size_t index) const;  // spec `index` fires on the current step
  bool targets(const InjectionSpec& spec, const std::string& segment) const;
  at::Tensor apply_segment_fault(std::size_t index, const at::Tensor& output, const std::string& segment, bool log);
  void note(const InjectionSpec& spec, std::string where, std::string detail);

  std::vector<InjectionSpec> specs_;
  at::ScalarType activation_dtype_ = at::kFloat;
  int rank_ = 0;
  std::int64_t step_ = 0;
  mutable std::mutex mutex_;  // fired_ and the per-invocation bookkeeping (backward runs on the
                              // autograd engine's thread)
  std::vector<InjectionEvent> fired_;
  std::vector<std::size_t> lr_spikes_;  // the kLrSpike specs in this step's lr_factor()
  // Segment forwards injected this step (invocation, spec), whose recompute gets the same fault.
  std::vector<std::pair<std::uint64_t, std::size_t>> hit_invocations_;
  std::vector<char> segment_done_;  // per spec: its segment fault fired this step
};

// Flips bit `bit` (0 = least significant) of element `index` of `t` (any dtype, contiguous or
// not) in place: what a kBitFlip injection does, for a program that flips bits its own way.
void flip_bit(at::Tensor& t, std::int64_t index, int bit);

}  // namespace retrace
