#include <retrace/defense_options.h>

#include <retrace/error.h>

namespace retrace {

const char* to_string(ClipMode mode) {
  switch (mode) {
    case ClipMode::kOff: return "off";
    case ClipMode::kGlobal: return "global";
    case ClipMode::kPerTensor: return "per_tensor";
    case ClipMode::kAdaptive: return "adaptive";
  }
  return "?";
}

std::vector<std::string> clip_mode_names() { return {"off", "global", "per_tensor", "adaptive"}; }

ClipMode parse_clip_mode(const std::string& name) {
  for (ClipMode m : {ClipMode::kOff, ClipMode::kGlobal, ClipMode::kPerTensor, ClipMode::kAdaptive}) {
    if (name == to_string(m)) return m;
  }
  throw Error("unknown clip mode '" + name + "'; use off, global, per_tensor or adaptive");
}

bool DefenseOptions::any() const {
  return loss_scaling.enabled || clip.mode != ClipMode::kOff || skip_nonfinite || skip_nonfinite_ranks ||
         warmup_steps > 0 || lr_scale != 1.0 || plateau.enabled || rollback || verify_recompute || validate_batch;
}

}  // namespace retrace
