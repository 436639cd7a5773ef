#pragma once
// Activation checkpointing for LibTorch's C++ API (which has none): a named segment runs its
// forward under no-grad keeping only its inputs, and in backward recomputes itself with grad
// enabled, under the RNG and autocast state of the forward, and back-propagates through the
// recompute. This is PyTorch's reentrant checkpoint (use_reentrant=True), with three differences:
//   - parameter gradients arrive even when no input requires grad;
//   - the segment has a name, and its events go to attached observers (observer.h);
//   - misuse is an error naming the segment, never wrong gradients.

#include <retrace/error.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace retrace {

using SegmentFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

// How the forward of a checkpointed segment runs.
enum class ForwardMode {
  // With grad enabled on detached inputs, the graph dropped as soon as the outputs exist: every
  // kernel sees the same grad mode and requires_grad flags as in the recompute. Some kernels pick
  // their algorithm by grad mode -- torch::nn::LSTM on CPU (oneDNN) computes other bits under
  // no-grad (docs/checkpoint.md has the measurement) -- so this is what makes
  // checkpointed gradients bitwise equal to the plain model's. Costs building (not keeping) the
  // segment's graph; peak memory is one segment's activations, as in its recompute.
  kLikeRecompute,
  // Under no-grad, as torch.utils.checkpoint does: a little cheaper, and not bitwise for such
  // kernels (the verifier reports them).
  kNoGrad,
};

struct CheckpointOptions {
  // Save the CPU generator and the generators of the inputs' CUDA devices at forward and run the
  // recompute from that state (preserve_rng_state=True in PyTorch). Turning it off makes dropout
  // draw other masks on recompute: the gradients are then wrong, which the verifier reports.
  bool preserve_rng_state = true;
  // Re-apply the forward's autocast state during recompute. Off only for negative controls.
  bool restore_autocast = true;
  ForwardMode forward_mode = ForwardMode::kLikeRecompute;
};

// Runs fn(inputs) as a checkpointed segment named `name` and returns its outputs.
//
// fn must return at least one tensor; every output must be a floating-point tensor on the
// device of the inputs. fn may use module parameters freely: their gradients are accumulated
// during backward exactly as without checkpointing. fn must be a pure function of its inputs,
// its parameters and the random generators; it runs twice when backward runs.
//
// Cost: the forward costs fn plus, with observers attached, their handlers; memory held until
// backward is the inputs only (and, with kLikeRecompute, the forward briefly builds the
// segment's graph). Backward costs a second fn plus its backward.
// Not supported (throws CheckpointError naming the segment): backward through
// torch::autograd::grad(...) or backward(inputs=...), backward with create_graph=true (double
// backward), outputs of mixed devices, no output, non-floating outputs.
std::vector<at::Tensor> checkpoint(const std::string& name, SegmentFn fn, const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

// Single tensor in, single tensor out.
at::Tensor checkpoint(const std::string& name, TensorFn fn, const at::Tensor& input,
                      const CheckpointOptions& options = {});

// A named step of a sequential model.
struct Stage {
  std::string name;
  TensorFn fn;
};

// Splits `stages` into `segments` contiguous groups of near-equal size (sizes differ by at
// most one, the earlier groups larger) and checkpoints each group as one segment named after its
// stages ("block0" or "block0..block3"). Unlike torch.utils.checkpoint.checkpoint_sequential, the
// last group is checkpointed too; segments == 1 checkpoints the whole sequence.
// Throws retrace::Error if segments < 1 or segments > stages.size().
at::Tensor checkpoint_sequential(const std::vector<Stage>& stages, int segments, const at::Tensor& input,
                                 const CheckpointOptions& options = {});

// The segment names checkpoint_sequential() would use.
std::vector<std::string> segment_names(const std::vector<Stage>& stages, int segments);

// --- Selective recompute ---------------------------------------------------------------------
// Full recompute (checkpoint(), checkpoint_sequential()) keeps only a segment's inputs and runs
// its whole forward again in backward. Selective recompute (Megatron-LM's; Korthikanti et al.,
// "Reducing Activation Recomputation in Large Transformer Models", 2023) recomputes only what is
// cheap to run and expensive to keep, and keeps every matmul's output as autograd does without
// checkpointing. A model marks such parts as regions of a kind; the policy on the thread says
// which kinds recompute:
//   - recompute_region(): the attention core, whose softmax and dropout tensors grow with the
//     square of the sequence (Megatron's selective recompute);
//   - recompute_linear_input(): a norm or an activation whose output only feeds a linear layer.
//     The linear layer keeps that output for its weight gradient; here the region's input is kept
//     instead and the region alone runs again in backward, not the matmul;
//   - recompute_dropout(): a dropout, whose float mask is kept as one bit an element.
// Every recomputed region is a checkpointed segment to observers (its recompute is verified and
// replay-compared like any segment's), and the gradients are bitwise those of the plain model.

// Kinds of forward regions.
enum class RegionKind {
  kAttentionCore,  // scores = QK^T, mask, softmax, dropout, scores x V (its inputs: Q, K, V)
  kNorm,           // a normalization feeding a linear layer (recompute_linear_input)
  kActivation,     // an elementwise activation feeding a linear layer (recompute_linear_input)
  kDropout,        // a dropout mask, kept as bits and rebuilt in backward (recompute_dropout)
};
const char* to_string(RegionKind kind);

struct RecomputePolicy {
  std::vector<RegionKind> kinds;  // the kinds that recompute; the others run plainly
  CheckpointOptions options;      // how a recomputed region runs (RNG preserved by default)
  bool recomputes(RegionKind kind) const;
  // Every kind: attention cores, norms and activations feeding linear layers, dropout masks.
  static RecomputePolicy selective();
  // Megatron's selective recompute: the attention core only.
  static RecomputePolicy attention_core();
};

// Makes `policy` the one the regions below follow on this thread for the scope's life. Scopes
// nest; the innermost wins. Without one, every region runs plainly.
class RecomputePolicyScope {
 public:
  explicit RecomputePolicyScope(RecomputePolicy policy);
  ~RecomputePolicyScope();
  RecomputePolicyScope(const RecomputePolicyScope&) = delete;
  RecomputePolicyScope& operator=(const RecomputePolicyScope&) = delete;
};

// Runs fn(inputs) as the checkpointed segment `name` (its events go to observers, its recompute
// is verified like any segment's) when the thread's policy recomputes `kind`, grad mode is on and
// no checkpointed segment is running on the thread (a segment recomputes its regions with
// itself); otherwise runs fn(inputs) plainly. fn runs again in backward, after this call has
// returned: it must capture by value what it uses (a module by its shared_ptr).
std::vector<at::Tensor> recompute_region(const std::string& name, RegionKind kind, SegmentFn fn,
                                         const std::vector<at::Tensor>& inputs);

// Returns at::linear(fn(input), weight, bias), bit for bit, gradients included. When it recomputes
// -- the policy names `kind` (kNorm or kActivation), grad mode is on, no segment is running, no
// autocast is on, bias is defined and something requires grad -- it keeps `input` where the plain
// model keeps fn's output, and in backward runs fn again (under the forward's RNG and autocast
// state, as the segment `name` to observers) and computes the linear layer's gradients from that
// output as autograd does, without running the matmul again. Otherwise it runs plainly.
// fn must return a contiguous 2-D or 3-D floating-point tensor on input's device (a
// CheckpointError naming the region otherwise) and capture by value what it uses, as above.
at::Tensor recompute_linear_input(const std::string& name, RegionKind kind, TensorFn fn, const at::Tensor& input,
                                  const at::Tensor& weight, const at::Tensor& bias);

// Returns at::dropout(input, p, train) -- what torch::nn::Dropout computes -- bit for bit, and
// keeps its mask as one bit an element instead of the float tensor of input's size that dropout
// keeps on the CPU:
//   - outside any segment, when the policy names kDropout, grad mode is on and input requires
//     grad: the segment `name` to observers, with no inputs and one output, the mask as dropout
//     multiplies by it (0 or 1/(1-p)), rebuilt from its bits in backward;
//   - inside a checkpointed segment (full recompute, or a region) preserving RNG state, whatever
//     the policy: the forward keeps the bits and the generator's state after the draw, and the
//     recompute rebuilds the mask from them instead of drawing again (a draw costs more than
//     the rest of a small model's recompute) and moves the generator to where the forward left it.
// Without RNG preservation the mask is drawn again from the generator as it then stands (the
// negative control). Otherwise -- eval mode, p 0 or 1, no grad, a CUDA tensor, where dropout keeps
// a one-byte mask -- it is at::dropout.
at::Tensor recompute_dropout(const std::string& name, const at::Tensor& input, double p, bool train);

}  // namespace retrace
