#pragma once
// What the defenses are asked to do: loss scaling, clipping, skip, rollback, LR schedules, batch
// validation, recompute verification. Plain data, read from a scenario file's `defenses:`
// (scenario.h) and carried out by the pipeline (defenses.h) and the LossScaler (loss_scaler.h).

#include <cstdint>
#include <string>
#include <vector>

namespace retrace {

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  // DeepSpeed's extensions: overflows tolerated (step skipped, scale kept) before the scale backs
  // off, restored when the scale next grows; and a floor the scale never backs off below.
  std::int64_t hysteresis = 1;
  double min_scale = 0.0;
};

enum class ClipMode { kOff, kGlobal, kPerTensor, kAdaptive };
const char* to_string(ClipMode mode);  // "off", "global", "per_tensor", "adaptive"
// Throws retrace::Error naming the known modes.
ClipMode parse_clip_mode(const std::string& name);
std::vector<std::string> clip_mode_names();

struct LossScalingOptions : LossScalerOptions {
  bool enabled = false;
};

struct ClipOptions {
  ClipMode mode = ClipMode::kOff;
  double max_norm = 1.0;            // global, per_tensor; adaptive: the floor of the threshold
  bool error_if_nonfinite = false;  // a non-finite norm throws instead of going on (a loss scaler,
                                    // when on, owns the overflow and skips instead)
  std::int64_t window = 20;         // adaptive: recent applied steps whose norms set the threshold
  double multiplier = 2.0;          // adaptive: threshold = multiplier x median of the window
};

// ReduceLROnPlateau on the step loss (PyTorch's rule, relative threshold).
struct PlateauOptions {
  bool enabled = false;
  double factor = 0.5;
  std::int64_t patience = 3;
  double threshold = 1e-4;  // relative improvement that counts
  double min_lr = 0.0;
  double eps = 1e-8;  // a cut that would change the LR by less than this is not made
};

struct DefenseOptions {
  LossScalingOptions loss_scaling;
  ClipOptions clip;
  bool skip_nonfinite = false;  // skip the optimizer step when gradients are not finite
  // Data-parallel: before the gradient all-reduce, each rank checks its own gradients; when any
  // rank's are not finite, every rank skips the step (they agree by an all-reduce of the flag),
  // and the skip reason names the ranks. Without it one rank's NaN poisons every rank.
  bool skip_nonfinite_ranks = false;
  std::int64_t warmup_steps = 0;  // linear LR warmup over the first applied steps
  double lr_scale = 1.0;          // the program's LR multiplied by this (diagnose's LR / 10)
  PlateauOptions plateau;
  // A non-finite step restores the state the step started from; consecutive non-finite steps
  // walk further back through the last rollback_depth step-start snapshots (a bad update that
  // only shows one step later is undone too).
  bool rollback = false;
  std::int64_t rollback_depth = 4;
  bool verify_recompute = false;  // a non-bitwise recompute skips the step (never applied)
  bool validate_batch = false;    // a batch with non-finite features or out-of-range ids is skipped
  bool any() const;               // some defense is on
};

}  // namespace retrace
