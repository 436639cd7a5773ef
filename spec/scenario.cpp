#include <retrace/scenario.h>

#include <retrace/autocast.h>
#include <retrace/checkpoint.h>
#include <retrace/error.h>
#include <retrace/number.h>

#include <ATen/ops/lstm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <cctype>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>

namespace retrace {

namespace {

// A scalar as an error message quotes it: one line, at most 60 characters.
std::string shown(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (out.size() >= 60) return out + "...";
    out += (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
  }
  return out;
}

class Parser {
 public:
  Parser(std::string origin, ScenarioSource source) : origin_(std::move(origin)), source_(source) {}
  ScenarioSource source() const { return source_; }

  [[noreturn]] void fail(const YAML::Node& node, const std::string& key, const std::string& what) const {
    std::string where = origin_;
    if (node.IsDefined() && node.Mark().line >= 0) where += ":" + std::to_string(node.Mark().line + 1);
    throw Error(where + ": key '" + key + "': " + what);
  }

  // Checks that `node` is a mapping whose keys are all in `known`.
  void keys(const YAML::Node& node, const std::string& prefix, const std::vector<std::string>& known) const {
    if (!node.IsMap()) {
      if (prefix.empty()) {
        throw Error(origin_ + (node.Mark().line >= 0 ? ":" + std::to_string(node.Mark().line + 1) : std::string()) +
                    ": a scenario is a mapping of sections (model, data, training, defenses, injections, expect), "
                    "not a list or a single value");
      }
      fail(node, prefix, "must be a mapping of keys to values");
    }
    std::map<std::string, int> seen;  // key -> its line (1-based), to name both of a duplicate
    for (auto it = node.begin(); it != node.end(); ++it) {
      if (!it->first.IsScalar())
        fail(it->first, prefix.empty() ? "?" : prefix + ".?", "a key must be a plain name, not a list or mapping");
      const std::string k = it->first.Scalar();
      const auto [first, fresh] = seen.emplace(k, it->first.Mark().line + 1);
      if (!fresh) {
        // YAML forbids it, and yaml-cpp would silently keep the first.
        fail(it->first, prefix.empty() ? shown(k) : prefix + "." + shown(k),
             "appears twice in one mapping (first on line " + std::to_string(first->second) + "); keep one");
      }
      if (std::find(known.begin(), known.end(), k) == known.end()) {
        std::string list;
        for (const auto& s : known) list += (list.empty() ? "" : ", ") + s;
        fail(it->first, prefix.empty() ? shown(k) : prefix + "." + shown(k), "unknown key; known keys here: " + list);
      }
    }
  }

  // A quoted scalar (tag "!") or one tagged !!str is a string (YAML's core schema): "0.1" is not the
  // number 0.1, "true" not true, whatever it spells.
  static bool string_tagged(const YAML::Node& n) { return n.Tag() == "!" || n.Tag() == "tag:yaml.org,2002:str"; }
  void unquoted(const YAML::Node& n, const std::string& full, const char* what) const {
    if (string_tagged(n))
      fail(n, full,
           std::string("must be ") + what + ", got the string '" + shown(n.Scalar()) + "' (" +
               (n.Tag() == "!" ? "quoted" : "tagged !!str") + "); write it plainly");
  }

  std::int64_t integer(const YAML::Node& parent, const char* key, const std::string& full, std::int64_t fallback,
                       std::int64_t min, std::int64_t max) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return fallback;
    if (!n.IsScalar()) fail(n, full, "must be an integer");
    unquoted(n, full, "an integer");
    std::int64_t v;
    try {
      v = n.as<std::int64_t>();
    } catch (const YAML::Exception&) {
      fail(n, full, "must be an integer, got '" + shown(n.Scalar()) + "'");
    }
    if (v < min || v > max) {
      fail(n, full,
           "must be between " + std::to_string(min) + " and " + std::to_string(max) + ", got " + std::to_string(v));
    }
    return v;
  }

  double number(const YAML::Node& parent, const char* key, const std::string& full, double fallback, double min,
                double max) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return fallback;
    if (!n.IsScalar()) fail(n, full, "must be a number");
    unquoted(n, full, "a number");
    double v;
    try {
      v = n.as<double>();
    } catch (const YAML::Exception&) {
      fail(n, full, "must be a number, got '" + shown(n.Scalar()) + "'");
    }
    if (!std::isfinite(v)) fail(n, full, "must be a finite number, got '" + shown(n.Scalar()) + "'");
    if (v < min || v > max) {
      std::ostringstream os;
      os << "must be between " << min << " and " << max << ", got " << v;
      fail(n, full, os.str());
    }
    return v;
  }

  std::string choice(const YAML::Node& parent, const char* key, const std::string& full, const std::string& fallback,
                     const std::vector<std::string>& allowed, bool required = false) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) {
      if (required) fail(parent, full, "is required; one of " + join(allowed));
      return fallback;
    }
    if (!n.IsScalar()) fail(n, full, "must be one of " + join(allowed));
    const std::string v = n.Scalar();
    if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
      fail(n, full, "must be one of " + join(allowed) + ", got '" + shown(v) + "'");
    }
    return v;
  }

  bool boolean(const YAML::Node& parent, const char* key, const std::string& full, bool fallback) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return fallback;
    // YAML 1.2's core schema: true or false (yaml-cpp also reads yes, on, y ... as booleans).
    const std::string t = n.IsScalar() ? n.Scalar() : "";
    const bool yes = t == "true" || t == "True" || t == "TRUE", no = t == "false" || t == "False" || t == "FALSE";
    if (!n.IsScalar() || string_tagged(n) || (!yes && !no))
      fail(n, full,
           "must be true or false, got " +
               (n.IsScalar() ? std::string(string_tagged(n) ? "the string '" : "'") + shown(n.Scalar()) +
                                   (n.Tag() == "!"     ? "' (quoted)"
                                    : string_tagged(n) ? "' (tagged !!str)"
                                                       : "'")
                             : std::string("a collection")));
    return yes;
  }

  std::string text(const YAML::Node& parent, const char* key, const std::string& full) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined()) return "";
    if (!n.IsScalar()) fail(n, full, "must be a string");
    return n.Scalar();
  }

  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  }

 private:
  std::string origin_;
  ScenarioSource source_;
};

constexpr std::int64_t kBig = std::int64_t{1} << 40;

// `builtin_model`: the defenses that act inside the built-in models are known keys too.
void parse_defenses(const Parser& p, const YAML::Node& d, DefenseSpec& out, bool builtin_model) {
  std::vector<std::string> known = {
      "loss_scaling", "clip",     "skip_nonfinite", "skip_nonfinite_ranks", "warmup_steps",  "lr_scale",
      "plateau",      "rollback", "rollback_depth", "verify_recompute",     "validate_batch"};
  if (builtin_model) known.insert(known.end(), {"layernorm_fp32", "layernorm_min_eps", "preserve_rng_state"});
  p.keys(d, "defenses", known);
  if (const YAML::Node ls = d["loss_scaling"]; ls.IsDefined()) {
    LossScalingOptions& l = out.loss_scaling;
    bool on = false;
    if (ls.IsScalar() && YAML::convert<bool>::decode(ls, on)) {
      l.enabled = on;
    } else {
      p.keys(
          ls, "defenses.loss_scaling",
          {"enabled", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale"});
      l.enabled = p.boolean(ls, "enabled", "defenses.loss_scaling.enabled", true);
      l.init_scale = p.number(ls, "init_scale", "defenses.loss_scaling.init_scale", l.init_scale, 1e-30, 1e30);
      l.growth_factor = p.number(ls, "growth_factor", "defenses.loss_scaling.growth_factor", l.growth_factor, 1.0, 1e6);
      l.backoff_factor =
          p.number(ls, "backoff_factor", "defenses.loss_scaling.backoff_factor", l.backoff_factor, 1e-6, 1.0);
      l.growth_interval =
          p.integer(ls, "growth_interval", "defenses.loss_scaling.growth_interval", l.growth_interval, 1, 1 << 30);
      l.hysteresis = p.integer(ls, "hysteresis", "defenses.loss_scaling.hysteresis", l.hysteresis, 1, 1 << 20);
      l.min_scale = p.number(ls, "min_scale", "defenses.loss_scaling.min_scale", l.min_scale, 0.0, 1e30);
      if (!(l.growth_factor > 1))
        p.fail(ls["growth_factor"], "defenses.loss_scaling.growth_factor", "must be greater than 1");
      if (!(l.backoff_factor < 1))
        p.fail(ls["backoff_factor"], "defenses.loss_scaling.backoff_factor", "must be less than 1");
      if (l.min_scale > l.init_scale) {
        p.fail(ls["min_scale"], "defenses.loss_scaling.min_scale",
               "is " + std::to_string(l.min_scale) + ", above init_scale " + std::to_string(l.init_scale) +
                   "; lower it or raise init_scale");
      }
    }
  }
  if (const YAML::Node c = d["clip"]; c.IsDefined()) {
    p.keys(c, "defenses.clip", {"mode", "max_norm", "error_if_nonfinite", "window", "multiplier"});
    ClipOptions& cl = out.clip;
    cl.mode = parse_clip_mode(p.choice(c, "mode", "defenses.clip.mode", "global", clip_mode_names()));
    cl.max_norm = p.number(c, "max_norm", "defenses.clip.max_norm", cl.max_norm, 1e-30, 1e30);
    cl.error_if_nonfinite =
        p.boolean(c, "error_if_nonfinite", "defenses.clip.error_if_nonfinite", cl.error_if_nonfinite);
    cl.window = p.integer(c, "window", "defenses.clip.window", cl.window, 1, 1 << 20);
    cl.multiplier = p.number(c, "multiplier", "defenses.clip.multiplier", cl.multiplier, 1.0, 1e6);
    // A setting the mode never reads is a mistake, not a default (the canonical YAML writes every
    // key with its default, which these leave alone).
    const ClipOptions unset;
    const bool off = cl.mode == ClipMode::kOff, adaptive = cl.mode == ClipMode::kAdaptive;
    if (off && (cl.max_norm != unset.max_norm || cl.error_if_nonfinite)) {
      const char* key = cl.error_if_nonfinite ? "error_if_nonfinite" : "max_norm";
      p.fail(c[key], std::string("defenses.clip.") + key,
             "does nothing with clip mode off; drop it, or set mode (global, per_tensor, adaptive)");
    }
    if (!adaptive && (cl.window != unset.window || cl.multiplier != unset.multiplier)) {
      const char* key = cl.window != unset.window ? "window" : "multiplier";
      p.fail(c[key], std::string("defenses.clip.") + key,
             std::string("is adaptive clipping's, but clip mode is ") + to_string(cl.mode) +
                 "; drop it, or use mode: adaptive");
    }
  }
  out.skip_nonfinite = p.boolean(d, "skip_nonfinite", "defenses.skip_nonfinite", out.skip_nonfinite);
  out.skip_nonfinite_ranks =
      p.boolean(d, "skip_nonfinite_ranks", "defenses.skip_nonfinite_ranks", out.skip_nonfinite_ranks);
  out.warmup_steps = p.integer(d, "warmup_steps", "defenses.warmup_steps", out.warmup_steps, 0, 1 << 30);
  out.lr_scale = p.number(d, "lr_scale", "defenses.lr_scale", out.lr_scale, 1e-12, 1e12);
  if (const YAML::Node pl = d["plateau"]; pl.IsDefined()) {
    p.keys(pl, "defenses.plateau", {"factor", "patience", "threshold", "min_lr", "eps"});
    PlateauOptions& ps = out.plateau;
    ps.enabled = true;
    ps.factor = p.number(pl, "factor", "defenses.plateau.factor", ps.factor, 1e-6, 0.999999);
    ps.patience = p.integer(pl, "patience", "defenses.plateau.patience", ps.patience, 0, 1 << 20);
    ps.threshold = p.number(pl, "threshold", "defenses.plateau.threshold", ps.threshold, 0.0, 1.0);
    ps.min_lr = p.number(pl, "min_lr", "defenses.plateau.min_lr", ps.min_lr, 0.0, 1e12);
    ps.eps = p.number(pl, "eps", "defenses.plateau.eps", ps.eps, 0.0, 1e12);
  }
  out.layernorm_fp32 = p.boolean(d, "layernorm_fp32", "defenses.layernorm_fp32", out.layernorm_fp32);
  out.layernorm_min_eps =
      p.number(d, "layernorm_min_eps", "defenses.layernorm_min_eps", out.layernorm_min_eps, 0.0, 1.0);
  out.rollback = p.boolean(d, "rollback", "defenses.rollback", out.rollback);
  out.rollback_depth = p.integer(d, "rollback_depth", "defenses.rollback_depth", out.rollback_depth, 1, 1024);
  out.preserve_rng_state = p.boolean(d, "preserve_rng_state", "defenses.preserve_rng_state", out.preserve_rng_state);
  out.verify_recompute = p.boolean(d, "verify_recompute", "defenses.verify_recompute", out.verify_recompute);
  out.validate_batch = p.boolean(d, "validate_batch", "defenses.validate_batch", out.validate_batch);
}

InjectionSpec parse_injection(const Parser& p, const YAML::Node& n, const std::string& at, const ScenarioSpec& s) {
  p.keys(n, at,
         {"type", "step", "duration", "probability", "seed", "segment", "factor", "mode", "target", "bit_class", "bits",
          "bit", "rows", "phase", "rank"});
  InjectionSpec in;
  const std::string type = p.choice(n, "type", at + ".type", "", injection_type_names(), /*required=*/true);
  in.type = parse_injection_type(type);
  // Keys that only some types use: anywhere else they would be silently ignored.
  const std::vector<std::pair<const char*, std::vector<InjectionType>>> only = {
      {"segment",
       {InjectionType::kActivationOverflow, InjectionType::kLayerNormInput, InjectionType::kRngDesync,
        InjectionType::kBitFlip}},
      {"factor",
       {InjectionType::kActivationOverflow, InjectionType::kLrSpike, InjectionType::kLayerNormInput,
        InjectionType::kLossSpike}},
      {"mode", {InjectionType::kLayerNormInput, InjectionType::kGradNonFinite, InjectionType::kCorruptBatch}},
      {"target", {InjectionType::kBitFlip}},
      {"bit_class", {InjectionType::kBitFlip}},
      {"bits", {InjectionType::kBitFlip}},
      {"bit", {InjectionType::kBitFlip}},
      {"rows", {InjectionType::kLayerNormInput}},
      {"phase", {InjectionType::kActivationOverflow, InjectionType::kLayerNormInput, InjectionType::kBitFlip}}};
  for (const auto& [key, types] : only) {
    if (n[key].IsDefined() && std::find(types.begin(), types.end(), in.type) == types.end()) {
      p.fail(n[key], at + "." + key, std::string("is not used by injection type ") + type + "; remove it");
    }
  }
  in.step = p.integer(n, "step", at + ".step", in.step, 1, 1 << 30);
  in.duration = p.integer(n, "duration", at + ".duration", in.duration, 1, 1 << 30);
  in.probability = p.number(n, "probability", at + ".probability", in.probability, 0.0, 1.0);
  in.seed = static_cast<std::uint64_t>(p.integer(n, "seed", at + ".seed", 0, 0, kBig));
  in.segment = p.text(n, "segment", at + ".segment");
  in.factor = p.number(n, "factor", at + ".factor", 0.0, -1e30, 1e30);
  if (n["factor"].IsDefined() && in.factor == 0 && p.source() == ScenarioSource::kWritten) {
    // 0 is what InjectionSpec holds for "the type's default": taken as written it would be swapped
    // for a factor of 1000 or more without a word. (Canonical text of earlier versions wrote it.)
    p.fail(n["factor"], at + ".factor",
           "is 0, which retrace cannot take as written (0 stands for the type's default, " +
               number_text(InjectionSpec{in.type}.effective_factor()) +
               "); omit the key for that default, or give a small number such as 1e-12");
  }
  if (n["factor"].IsDefined() && in.factor == 1 && in.type != InjectionType::kLayerNormInput) {
    p.fail(n["factor"], at + ".factor",
           "is 1, which leaves the " +
               std::string(in.type == InjectionType::kLrSpike     ? "learning rate"
                           : in.type == InjectionType::kLossSpike ? "loss"
                                                                  : "segment's outputs") +
               " unchanged: the injection would fire and do nothing; use another factor, or remove the injection");
  }
  in.rows = p.number(n, "rows", at + ".rows", in.rows, 0.0, 1.0);
  in.bits = static_cast<int>(p.integer(n, "bits", at + ".bits", in.bits, 1, 64));
  in.bit = static_cast<int>(p.integer(n, "bit", at + ".bit", in.bit, 0, 31));  // the harness's tensors are fp32
  in.bit_class = p.choice(n, "bit_class", at + ".bit_class", in.bit_class, {"sign", "exponent", "mantissa", "any"});
  in.phase = p.choice(n, "phase", at + ".phase", in.phase, {"both", "forward", "recompute"});
  if (n["rank"].IsDefined()) {
    in.rank = static_cast<int>(p.integer(n, "rank", at + ".rank", 0, 0, 1 << 16));
    if (in.rank >= s.world_size) {
      p.fail(n["rank"], at + ".rank",
             "is " + std::to_string(in.rank) + ", but the run has world_size " + std::to_string(s.world_size) +
                 " (ranks 0.." + std::to_string(s.world_size - 1) + "); lower it or raise world_size");
    }
  }
  if (in.step > s.training.steps) {
    p.fail(n["step"], at + ".step",
           "is " + std::to_string(in.step) + ", after the run's last step " + std::to_string(s.training.steps) +
               ", so it could never fire; lower it or raise training.steps");
  }
  if (n["bits"].IsDefined()) {
    // The harness's tensors are fp32: the class's bits there (injectors.cpp, bits_of_class).
    const int width = in.bit_class == "sign"       ? 1
                      : in.bit_class == "exponent" ? 8
                      : in.bit_class == "mantissa" ? 23
                                                   : 32;
    if (in.bits > width) {
      p.fail(n["bits"], at + ".bits",
             "is " + std::to_string(in.bits) + ", but bit_class " + in.bit_class + " has " + std::to_string(width) +
                 " bits in an fp32 element; use 1 .. " + std::to_string(width) + " (or bit_class any)");
    }
  }
  switch (in.type) {
    case InjectionType::kLayerNormInput:
      in.mode = p.choice(n, "mode", at + ".mode", "constant", {"constant", "huge", "nan"});
      break;
    case InjectionType::kGradNonFinite: in.mode = p.choice(n, "mode", at + ".mode", "nan", {"nan", "inf"}); break;
    case InjectionType::kCorruptBatch: {
      if (!s.program.empty()) {  // the program's inputs: what fits is known when it is built
        in.mode = p.choice(n, "mode", at + ".mode", "", {"nan_features", "token_out_of_range"}, /*required=*/true);
        break;
      }
      const std::string fallback = s.model.type == "mlp" ? "nan_features" : "token_out_of_range";
      in.mode = p.choice(n, "mode", at + ".mode", fallback, {"nan_features", "token_out_of_range"});
      if ((in.mode == "nan_features") != (s.model.type == "mlp")) {
        p.fail(n["mode"], at + ".mode",
               in.mode + " does not fit model type " + s.model.type +
                   (s.model.type == "mlp" ? " (float features); use nan_features"
                                          : " (token ids); use token_out_of_range"));
      }
      break;
    }
    case InjectionType::kBitFlip:
      in.target =
          p.choice(n, "target", at + ".target", "weights", {"weights", "activations", "optimizer", "gradients"});
      break;
    default: break;
  }
  if (n["bit"].IsDefined() && n["bits"].IsDefined())
    p.fail(n["bits"], at + ".bits", "cannot be combined with 'bit' (which flips exactly that one bit)");
  if (n["bit"].IsDefined() && n["bit_class"].IsDefined())
    p.fail(n["bit_class"], at + ".bit_class", "cannot be combined with 'bit' (which names the bit itself)");
  if (in.type == InjectionType::kBitFlip && in.target != "activations" && n["segment"].IsDefined()) {
    p.fail(n["segment"], at + ".segment",
           "is only for target activations; a " + in.target + " flip picks its tensor by seed");
  }
  if (in.type == InjectionType::kBitFlip && in.target != "activations" && n["phase"].IsDefined()) {
    p.fail(n["phase"], at + ".phase", "is only for target activations (a checkpointed segment's outputs)");
  }
  if (in.type == InjectionType::kLayerNormInput && in.mode != "huge" && n["factor"].IsDefined()) {
    p.fail(n["factor"], at + ".factor", "is only used by mode huge (the rows' magnitude); remove it");
  }
  if (!in.segment.empty() && s.program.empty()) {  // a program's segments are named by the program
    // A stage of this model ("block1") or a checkpoint_sequential range of them ("block0..block1").
    const std::string prefix = s.model.type == "tiny_gpt" ? "block" : s.model.type == "lstm" ? "lstm" : "layer";
    // The stage's index, or -1: digits without a leading zero, below model.layers.
    auto stage = [&](const std::string& name) -> long long {
      const std::string digits = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : "";
      if (digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0')) return -1;
      for (char c : digits) {
        if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
      }
      const long long i = std::stoll(digits);
      return i < s.model.layers ? i : -1;
    };
    const auto dots = in.segment.find("..");
    bool ok = false;
    if (dots == std::string::npos) {
      ok = stage(in.segment) >= 0;
    } else {
      const long long a = stage(in.segment.substr(0, dots)), b = stage(in.segment.substr(dots + 2));
      ok = a >= 0 && b > a;
      // A range must be one of the run's segments, as checkpoint_sequential splits the stages.
      std::vector<Stage> stages;
      for (std::int64_t i = 0; i < s.model.layers; ++i) stages.push_back({prefix + std::to_string(i), nullptr});
      const std::vector<std::string> names = segment_names(stages, std::max(1, s.training.segments));
      if (ok && std::find(names.begin(), names.end(), in.segment) == names.end()) {
        std::string list;
        for (const auto& x : names) list += (list.empty() ? "" : ", ") + x;
        p.fail(
            n["segment"], at + ".segment",
            "'" + in.segment + "' is not one of this run's segments (" + list + "); name one, or a stage inside one");
      }
    }
    if (!ok) {
      p.fail(n["segment"], at + ".segment",
             "'" + in.segment + "' is not a stage of this model; use " + prefix + "0 .. " + prefix +
                 std::to_string(s.model.layers - 1));
    }
  }
  if (in.in_segment() && s.program.empty() && s.training.segments == 0) {  // a program checkpoints as it does
    p.fail(n["type"], at + ".type",
           type + " hits a checkpointed segment, but training.segments is 0; set training.segments >= 1");
  }
  return in;
}

void parse_expect(const Parser& p, const YAML::Node& e, ExpectSpec& out) {
  p.keys(e, "expect",
         {"params_finite", "loss_finite", "max_skipped_steps", "min_skipped_steps", "min_scale_backoffs",
          "min_scale_growths", "min_rollbacks", "final_loss_below", "min_applied_steps", "recompute_bitwise",
          "replay_bitwise", "injections_fired", "raises", "raises_match", "diverges"});
  auto opt_bool = [&](const char* key, std::optional<bool>& field) {
    if (e[key].IsDefined()) field = p.boolean(e, key, std::string("expect.") + key, false);
  };
  auto opt_int = [&](const char* key, std::optional<std::int64_t>& field) {
    if (e[key].IsDefined()) field = p.integer(e, key, std::string("expect.") + key, 0, 0, kBig);
  };
  opt_bool("params_finite", out.params_finite);
  opt_bool("loss_finite", out.loss_finite);
  opt_int("max_skipped_steps", out.max_skipped_steps);
  opt_int("min_skipped_steps", out.min_skipped_steps);
  opt_int("min_scale_backoffs", out.min_scale_backoffs);
  opt_int("min_scale_growths", out.min_scale_growths);
  opt_int("min_rollbacks", out.min_rollbacks);
  if (e["final_loss_below"].IsDefined())
    out.final_loss_below = p.number(e, "final_loss_below", "expect.final_loss_below", 0.0, -1e30, 1e30);
  opt_int("min_applied_steps", out.min_applied_steps);
  opt_bool("recompute_bitwise", out.recompute_bitwise);
  opt_bool("replay_bitwise", out.replay_bitwise);
  opt_bool("injections_fired", out.injections_fired);
  opt_bool("raises", out.raises);
  out.raises_match = p.text(e, "raises_match", "expect.raises_match");
  if (!out.raises_match.empty() && !out.raises.value_or(false)) {
    p.fail(e["raises_match"], "expect.raises_match", "needs raises: true");
  }
  out.diverges = p.boolean(e, "diverges", "expect.diverges", false);
  // Expecting the run to break is a negative control's claim, judged as one (its fault's evidence,
  // its counterfactual): not a scenario that expects to hold.
  for (const char* key : {"params_finite", "loss_finite", "recompute_bitwise"}) {
    const std::string k = key;
    const std::optional<bool>& v = k == "params_finite" ? out.params_finite
                                   : k == "loss_finite" ? out.loss_finite
                                                        : out.recompute_bitwise;
    if (v == false && !out.diverges) {
      p.fail(e[key], std::string("expect.") + key,
             std::string("false expects the run to break, which is a negative control's claim: write ") + key +
                 ": true with diverges: true (the control's fault is to break it)");
    }
  }
}

void parse_injections_and_expect(const Parser& p, const YAML::Node& root, ScenarioSpec& s) {
  if (s.defenses.skip_nonfinite_ranks && s.world_size < 2) {
    p.fail(root["defenses"]["skip_nonfinite_ranks"], "defenses.skip_nonfinite_ranks",
           "needs a data-parallel run (world_size 2 or more); a single process uses skip_nonfinite");
  }
  if (const YAML::Node list = root["injections"]; list.IsDefined()) {
    if (!list.IsSequence()) p.fail(list, "injections", "must be a list of injections (each a mapping with 'type')");
    for (std::size_t i = 0; i < list.size(); ++i) {
      s.injections.push_back(parse_injection(p, list[i], "injections[" + std::to_string(i) + "]", s));
    }
  }
  if (const YAML::Node e = root["expect"]; e.IsDefined()) {
    parse_expect(p, e, s.expect);
    // More applied steps than the run has from its fault's step on can never pass (red-team
    // finding: min_applied_steps 100 in a 6-step run was graded "broke").
    std::int64_t fault_step = 1;
    for (std::size_t i = 0; i < s.injections.size(); ++i)
      fault_step = i == 0 ? s.injections[i].step : std::min(fault_step, s.injections[i].step);
    const std::int64_t room = s.training.steps - fault_step + 1;
    if (s.expect.min_applied_steps && *s.expect.min_applied_steps > room) {
      p.fail(e["min_applied_steps"], "expect.min_applied_steps",
             "is " + std::to_string(*s.expect.min_applied_steps) + ", but steps " + std::to_string(fault_step) + ".." +
                 std::to_string(s.training.steps) + " are " + std::to_string(room) +
                 ", so it could never pass; lower it or raise training.steps");
    }
  }
}

// Block style all the way down, whatever the file wrote ({a: 1} included).
void block_style(YAML::Node node) {
  if (node.IsMap() || node.IsSequence()) node.SetStyle(YAML::EmitterStyle::Block);
  if (node.IsMap()) {
    for (auto kv : node) block_style(kv.second);
  } else if (node.IsSequence()) {
    for (auto item : node) block_style(item);
  }
}

// The canonical text of a program's `config:` map, what its factory receives: block style, one
// "key: value" line per scalar entry, however the scenario wrote it.
std::string config_text(const YAML::Node& config) {
  YAML::Node copy = YAML::Clone(config);
  block_style(copy);
  YAML::Emitter out;
  out.SetDoublePrecision(17);
  out << copy;
  return out.c_str();
}

// A scenario that trains a registered program: `program:` and `config:` instead of `model:` and
// `data:`; of `training:` only steps and seed (the program's own config has the rest); the
// defenses the pipeline runs (not those inside the built-in models).
ScenarioSpec parse_program_scenario(const Parser& p, const YAML::Node& root, ScenarioSpec s) {
  const YAML::Node prog = root["program"];
  if (!prog.IsScalar() || prog.Scalar().empty())
    p.fail(prog, "program", "must be the name a program is registered under");
  s.program = prog.Scalar();
  for (const char* key : {"model", "data"}) {
    if (root[key].IsDefined()) {
      p.fail(root[key], key,
             std::string("describes a built-in model; a scenario with 'program' takes its model and data from ") +
                 "the program (put settings under 'config:')");
    }
  }
  if (const YAML::Node c = root["config"]; c.IsDefined() && !c.IsNull()) {
    if (!c.IsMap()) p.fail(c, "config", "must be a mapping (handed to the program's factory as YAML text)");
    s.program_config = config_text(c);
    if (c.Mark().line >= 0) s.program_config_line = c.Mark().line + 1;
  }
  if (const YAML::Node t = root["training"]; t.IsDefined()) {
    if (!t.IsMap()) p.fail(t, "training", "must be a mapping");
    for (const auto& kv : t) {
      const std::string key = kv.first.Scalar();
      if (key != "steps" && key != "seed") {
        p.fail(kv.first, "training." + key,
               "applies to the built-in models only; a scenario with 'program' has training.steps and training.seed, "
               "and the program takes the rest from 'config:'");
      }
    }
    p.keys(t, "training", {"steps", "seed"});
    s.training.steps = p.integer(t, "steps", "training.steps", s.training.steps, 1, 1 << 30);
    s.training.seed = static_cast<std::uint64_t>(p.integer(t, "seed", "training.seed", 0, 0, kBig));
  }
  if (const YAML::Node d = root["defenses"]; d.IsDefined()) {
    if (d.IsMap()) {
      for (const char* key : {"layernorm_fp32", "layernorm_min_eps", "preserve_rng_state"}) {
        if (d[key].IsDefined()) {
          p.fail(d[key], std::string("defenses.") + key,
                 "acts inside the built-in models; a program applies it in its own model (from its 'config:')");
        }
      }
    }
    parse_defenses(p, d, s.defenses, /*builtin_model=*/false);
  }
  parse_injections_and_expect(p, root, s);
  return s;
}

ScenarioSpec parse(const YAML::Node& root, const std::string& origin, ScenarioSource source) {
  Parser p(origin, source);
  ScenarioSpec s;
  s.origin = origin;
  if (!root.IsDefined() || root.IsNull())
    throw Error(origin + ": the scenario file is empty; it needs at least a 'model' section (or 'program: NAME')");
  p.keys(root, "",
         {"name", "description", "program", "config", "world_size", "model", "data", "training", "defenses",
          "injections", "expect"});
  s.name = p.text(root, "name", "name");
  // A name lands in the console's lines, file names, JUnit XML (where most control characters are
  // not allowed at all) and HTML: one line of text.
  for (std::size_t i = 0; i < s.name.size(); ++i) {
    const auto c = static_cast<unsigned char>(s.name[i]);
    if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", c);
      p.fail(root["name"], "name",
             std::string("holds a control character (byte ") + hex + " at offset " + std::to_string(i) +
                 "): a name is one line of text");
    }
  }
  s.description = p.text(root, "description", "description");
  s.world_size = static_cast<int>(p.integer(root, "world_size", "world_size", 1, 1, kMaxScenarioRanks));
  if (root["program"].IsDefined()) return parse_program_scenario(p, root, std::move(s));
  if (root["config"].IsDefined())
    p.fail(root["config"], "config", "is the configuration of a registered program; it needs 'program: NAME'");

  const YAML::Node model = root["model"];
  if (!model.IsDefined())
    p.fail(root, "model", "is required (a mapping with at least 'type'), or 'program: NAME' for a registered program");
  p.keys(model, "model",
         {"type", "layers", "d_model", "heads", "hidden", "vocab", "seq_len", "in_features", "out_features", "dropout",
          "layernorm_eps", "init_gain"});
  ModelSpec& m = s.model;
  m.type = p.choice(model, "type", "model.type", "", {"tiny_gpt", "lstm", "mlp"}, /*required=*/true);
  m.layers = p.integer(model, "layers", "model.layers", m.layers, 1, 1024);
  m.d_model = p.integer(model, "d_model", "model.d_model", m.d_model, 1, 1 << 16);
  m.heads = p.integer(model, "heads", "model.heads", m.heads, 1, 1024);
  m.hidden = p.integer(model, "hidden", "model.hidden", m.hidden, 1, 1 << 16);
  m.vocab = p.integer(model, "vocab", "model.vocab", m.vocab, 2, 1 << 24);
  m.seq_len = p.integer(model, "seq_len", "model.seq_len", m.seq_len, 1, 1 << 20);
  m.in_features = p.integer(model, "in_features", "model.in_features", m.in_features, 1, 1 << 20);
  m.out_features = p.integer(model, "out_features", "model.out_features", m.out_features, 1, 1 << 20);
  m.dropout = p.number(model, "dropout", "model.dropout", m.dropout, 0.0, 0.999);
  m.layernorm_eps = p.number(model, "layernorm_eps", "model.layernorm_eps", m.layernorm_eps, 0.0, 1.0);
  m.init_gain = p.number(model, "init_gain", "model.init_gain", m.init_gain, 1e-6, 1e6);
  if (m.type == "tiny_gpt" && m.d_model % m.heads != 0) {
    p.fail(model["heads"].IsDefined() ? model["heads"] : model, "model.heads",
           "d_model (" + std::to_string(m.d_model) + ") must be divisible by heads (" + std::to_string(m.heads) + ")");
  }

  if (const YAML::Node data = root["data"]; data.IsDefined()) {
    p.keys(data, "data", {"batch", "seed"});
    s.data.batch = p.integer(data, "batch", "data.batch", s.data.batch, 1, 1 << 20);
    s.data.seed = static_cast<std::uint64_t>(p.integer(data, "seed", "data.seed", 1, 0, kBig));
  }

  if (const YAML::Node t = root["training"]; t.IsDefined()) {
    p.keys(t, "training",
           {"steps", "seed", "optimizer", "lr", "weight_decay", "momentum", "segments", "recompute", "clip_grad_norm",
            "device", "precision", "loss_weight"});
    TrainingSpec& tr = s.training;
    tr.steps = p.integer(t, "steps", "training.steps", tr.steps, 1, 1 << 30);
    tr.seed = static_cast<std::uint64_t>(p.integer(t, "seed", "training.seed", 0, 0, kBig));
    tr.optimizer = p.choice(t, "optimizer", "training.optimizer", tr.optimizer, {"adamw", "adam", "sgd"});
    tr.lr = p.number(t, "lr", "training.lr", tr.lr, 0.0, 1e12);
    tr.weight_decay = p.number(t, "weight_decay", "training.weight_decay", tr.weight_decay, 0.0, 1e3);
    tr.momentum = p.number(t, "momentum", "training.momentum", tr.momentum, 0.0, 1.0);
    if (tr.momentum != 0 && tr.optimizer != "sgd") {
      p.fail(t["momentum"], "training.momentum",
             "is SGD's, but training.optimizer is " + tr.optimizer +
                 " (Adam keeps its own moments); drop it, or use optimizer: sgd");
    }
    tr.segments = static_cast<int>(p.integer(t, "segments", "training.segments", tr.segments, 0, 1 << 20));
    tr.clip_grad_norm = p.number(t, "clip_grad_norm", "training.clip_grad_norm", tr.clip_grad_norm, 0.0, 1e12);
    tr.device = p.choice(t, "device", "training.device", tr.device, {"cpu", "cuda"});
    tr.precision = p.choice(t, "precision", "training.precision", tr.precision, {"fp32", "bf16", "fp16"});
    tr.loss_weight = p.number(t, "loss_weight", "training.loss_weight", tr.loss_weight, 1e-30, 1e30);
    if (tr.segments > m.layers) {
      p.fail(t["segments"], "training.segments",
             "is " + std::to_string(tr.segments) + " but the model has " + std::to_string(m.layers) +
                 " layers; use 0 (off) to " + std::to_string(m.layers));
    }
    tr.recompute = p.choice(t, "recompute", "training.recompute", tr.recompute, {"full", "selective"});
    if (tr.recompute == "selective" && tr.segments != 0) {
      p.fail(t["recompute"], "training.recompute",
             "is selective, which recomputes parts of each block and keeps its matmul outputs; it needs "
             "training.segments 0 (got " +
                 std::to_string(tr.segments) + "): drop segments, or use recompute: full");
    }
    if (tr.recompute == "selective" && m.type != "tiny_gpt") {
      p.fail(t["recompute"], "training.recompute",
             "is selective, which recomputes the regions a transformer block marks, but a " + m.type +
                 " model marks none; use it with model.type tiny_gpt");
    }
  }

  if (m.type == "lstm" && s.training.device == "cpu" &&
      (s.training.precision == "fp16" || (s.training.precision == "bf16" && !cpu_runs_lstm_at("bf16")))) {
    const YAML::Node t = root["training"];
    p.fail(t.IsDefined() && t["precision"].IsDefined() ? t["precision"] : root, "training.precision",
           s.training.precision == "fp16"
               ? "fp16 autocast cannot run an lstm on the CPU (oneDNN has no fp16 LSTM primitive: every step would "
                 "raise); "
                 "use bf16 or fp32, or device cuda"
               : s.training.precision + " autocast cannot run an lstm on this machine's CPU (its oneDNN has no " +
                     s.training.precision +
                     " LSTM primitive for this instruction set, e.g. without AVX-512: every step "
                     "would raise); use fp32, or device cuda");
  }
  if (const YAML::Node d = root["defenses"]; d.IsDefined()) {
    parse_defenses(p, d, s.defenses, /*builtin_model=*/true);
    if (m.type != "tiny_gpt" && (s.defenses.layernorm_fp32 || s.defenses.layernorm_min_eps > 0)) {
      const char* key = s.defenses.layernorm_fp32 ? "layernorm_fp32" : "layernorm_min_eps";
      p.fail(d[key], std::string("defenses.") + key,
             "guards LayerNorm, but model type " + m.type + " has none (tiny_gpt has); drop it");
    }
  }
  if (s.training.clip_grad_norm > 0 && s.defenses.clip.mode == ClipMode::kOff) {  // the shorthand
    s.defenses.clip.mode = ClipMode::kGlobal;
    s.defenses.clip.max_norm = s.training.clip_grad_norm;
  }
  parse_injections_and_expect(p, root, s);
  return s;
}

}  // namespace

namespace {

// Counts a stream's documents through the parser's events, building no nodes: the memory it
// needs does not grow with what the documents hold (aliases are never expanded).
class DocumentCounter : public YAML::EventHandler {
 public:
  int documents = 0;
  YAML::Mark second;  // where the second document starts
  void OnDocumentStart(const YAML::Mark& mark) override {
    if (++documents == 2) second = mark;
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

[[noreturn]] void yaml_error(const YAML::Exception& e, const std::string& origin) {
  const std::string where = origin + ":" + std::to_string(std::max(0, e.mark.line) + 1);
  if (const auto* deep = dynamic_cast<const YAML::DeepRecursion*>(&e)) {
    throw Error(where + ": nested more than " + std::to_string(deep->depth() - 1) +
                " levels deep, which the YAML reader refuses; a scenario nests at most 4 (e.g. "
                "defenses.loss_scaling.init_scale)");
  }
  throw Error(where + ": not valid YAML: " + e.msg);
}

}  // namespace

ScenarioSpec parse_scenario_text(const std::string& text, const std::string& origin, ScenarioSource source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
    // YAML::Load reads the first document only: whatever follows a `---` would be dropped
    // silently, injections and expectations included.
    std::istringstream in(text);
    YAML::Parser events(in);
    DocumentCounter counter;
    while (counter.documents < 2 && events.HandleNextDocument(counter)) {
    }
    if (counter.documents > 1) {
      throw Error(origin + ":" + std::to_string(counter.second.line + 1) +
                  ": a second YAML document starts here (after '---'); a scenario file holds one, so "
                  "merge it into the first or put it in a file of its own");
    }
  } catch (const YAML::Exception& e) {
    yaml_error(e, origin);
  }
  try {
    return parse(root, origin, source);
  } catch (const YAML::Exception& e) {  // a shape the checks above did not foresee
    throw Error(origin + (e.mark.line >= 0 ? ":" + std::to_string(e.mark.line + 1) : std::string()) +
                ": cannot read the scenario: " + e.msg);
  }
}

ScenarioSpec parse_scenario_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open the scenario file (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(path + ": cannot read the scenario file");
  return parse_scenario_text(ss.str(), path);
}

namespace {

void emit_model(YAML::Emitter& out, const ModelSpec& m) {
  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << m.type;
  out << YAML::Key << "layers" << YAML::Value << m.layers;
  out << YAML::Key << "d_model" << YAML::Value << m.d_model;
  out << YAML::Key << "heads" << YAML::Value << m.heads;
  out << YAML::Key << "hidden" << YAML::Value << m.hidden;
  out << YAML::Key << "vocab" << YAML::Value << m.vocab;
  out << YAML::Key << "seq_len" << YAML::Value << m.seq_len;
  out << YAML::Key << "in_features" << YAML::Value << m.in_features;
  out << YAML::Key << "out_features" << YAML::Value << m.out_features;
  out << YAML::Key << "dropout" << YAML::Value << m.dropout;
  out << YAML::Key << "layernorm_eps" << YAML::Value << m.layernorm_eps;
  out << YAML::Key << "init_gain" << YAML::Value << m.init_gain;
  out << YAML::EndMap;
}

void emit_data(YAML::Emitter& out, const DataSpec& d) {
  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "batch" << YAML::Value << d.batch;
  out << YAML::Key << "seed" << YAML::Value << d.seed;
  out << YAML::EndMap;
}

void emit_training(YAML::Emitter& out, const TrainingSpec& t) {
  out << YAML::Key << "training" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "steps" << YAML::Value << t.steps;
  out << YAML::Key << "seed" << YAML::Value << t.seed;
  out << YAML::Key << "optimizer" << YAML::Value << t.optimizer;
  out << YAML::Key << "lr" << YAML::Value << t.lr;
  out << YAML::Key << "weight_decay" << YAML::Value << t.weight_decay;
  out << YAML::Key << "momentum" << YAML::Value << t.momentum;
  out << YAML::Key << "segments" << YAML::Value << t.segments;
  // Only when selective: the canonical form of every other scenario (the config its traces keep)
  // stays as it was.
  if (t.recompute != "full") out << YAML::Key << "recompute" << YAML::Value << t.recompute;
  out << YAML::Key << "clip_grad_norm" << YAML::Value << t.clip_grad_norm;
  out << YAML::Key << "device" << YAML::Value << t.device;
  out << YAML::Key << "precision" << YAML::Value << t.precision;
  out << YAML::Key << "loss_weight" << YAML::Value << t.loss_weight;
  out << YAML::EndMap;
}

// `builtin`: a built-in model trains, and its own defenses (LayerNorm, RNG) are written too.
void emit_defenses(YAML::Emitter& out, const DefenseSpec& d, bool builtin) {
  out << YAML::Key << "defenses" << YAML::Value << YAML::BeginMap;
  const LossScalingOptions& l = d.loss_scaling;
  out << YAML::Key << "loss_scaling" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "enabled" << YAML::Value << l.enabled;
  out << YAML::Key << "init_scale" << YAML::Value << l.init_scale;
  out << YAML::Key << "growth_factor" << YAML::Value << l.growth_factor;
  out << YAML::Key << "backoff_factor" << YAML::Value << l.backoff_factor;
  out << YAML::Key << "growth_interval" << YAML::Value << l.growth_interval;
  out << YAML::Key << "hysteresis" << YAML::Value << l.hysteresis;
  out << YAML::Key << "min_scale" << YAML::Value << l.min_scale;
  out << YAML::EndMap;
  out << YAML::Key << "clip" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "mode" << YAML::Value << to_string(d.clip.mode);
  out << YAML::Key << "max_norm" << YAML::Value << d.clip.max_norm;
  out << YAML::Key << "error_if_nonfinite" << YAML::Value << d.clip.error_if_nonfinite;
  out << YAML::Key << "window" << YAML::Value << d.clip.window;
  out << YAML::Key << "multiplier" << YAML::Value << d.clip.multiplier;
  out << YAML::EndMap;
  out << YAML::Key << "skip_nonfinite" << YAML::Value << d.skip_nonfinite;
  if (d.skip_nonfinite_ranks) out << YAML::Key << "skip_nonfinite_ranks" << YAML::Value << true;
  out << YAML::Key << "warmup_steps" << YAML::Value << d.warmup_steps;
  out << YAML::Key << "lr_scale" << YAML::Value << d.lr_scale;
  if (d.plateau.enabled) {
    out << YAML::Key << "plateau" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "factor" << YAML::Value << d.plateau.factor;
    out << YAML::Key << "patience" << YAML::Value << d.plateau.patience;
    out << YAML::Key << "threshold" << YAML::Value << d.plateau.threshold;
    out << YAML::Key << "min_lr" << YAML::Value << d.plateau.min_lr;
    out << YAML::Key << "eps" << YAML::Value << d.plateau.eps;
    out << YAML::EndMap;
  }
  if (builtin) {  // the built-in models' own defenses
    out << YAML::Key << "layernorm_fp32" << YAML::Value << d.layernorm_fp32;
    out << YAML::Key << "layernorm_min_eps" << YAML::Value << d.layernorm_min_eps;
  }
  out << YAML::Key << "rollback" << YAML::Value << d.rollback;
  out << YAML::Key << "rollback_depth" << YAML::Value << d.rollback_depth;
  if (builtin) out << YAML::Key << "preserve_rng_state" << YAML::Value << d.preserve_rng_state;
  out << YAML::Key << "verify_recompute" << YAML::Value << d.verify_recompute;
  out << YAML::Key << "validate_batch" << YAML::Value << d.validate_batch;
  out << YAML::EndMap;
}

// Only the keys the injection's type uses (the parser rejects the others).
void emit_injection(YAML::Emitter& out, const InjectionSpec& in) {
  out << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << to_string(in.type);
  out << YAML::Key << "step" << YAML::Value << in.step;
  out << YAML::Key << "duration" << YAML::Value << in.duration;
  out << YAML::Key << "probability" << YAML::Value << in.probability;
  out << YAML::Key << "seed" << YAML::Value << in.seed;
  const bool bitflip = in.type == InjectionType::kBitFlip;
  if (!in.segment.empty()) out << YAML::Key << "segment" << YAML::Value << in.segment;
  if (in.type == InjectionType::kActivationOverflow || in.type == InjectionType::kLrSpike ||
      (in.type == InjectionType::kLayerNormInput && in.mode == "huge") || in.type == InjectionType::kLossSpike) {
    if (in.factor != 0) out << YAML::Key << "factor" << YAML::Value << in.factor;  // 0: the default
  }
  if (!in.mode.empty()) out << YAML::Key << "mode" << YAML::Value << in.mode;
  if (bitflip) {
    out << YAML::Key << "target" << YAML::Value << in.target;
    if (in.bit >= 0) {
      out << YAML::Key << "bit" << YAML::Value << in.bit;
    } else {
      out << YAML::Key << "bit_class" << YAML::Value << in.bit_class;
      out << YAML::Key << "bits" << YAML::Value << in.bits;
    }
  }
  if (in.type == InjectionType::kLayerNormInput) out << YAML::Key << "rows" << YAML::Value << in.rows;
  if (in.phase != "both") out << YAML::Key << "phase" << YAML::Value << in.phase;
  if (in.rank >= 0) out << YAML::Key << "rank" << YAML::Value << in.rank;
  out << YAML::EndMap;
}

void emit_expect(YAML::Emitter& out, const ExpectSpec& e) {
  out << YAML::Key << "expect" << YAML::Value << YAML::BeginMap;
  auto opt = [&](const char* key, const auto& field) {
    if (field) out << YAML::Key << key << YAML::Value << *field;
  };
  opt("params_finite", e.params_finite);
  opt("loss_finite", e.loss_finite);
  opt("max_skipped_steps", e.max_skipped_steps);
  opt("min_skipped_steps", e.min_skipped_steps);
  opt("min_scale_backoffs", e.min_scale_backoffs);
  opt("min_scale_growths", e.min_scale_growths);
  opt("min_rollbacks", e.min_rollbacks);
  opt("final_loss_below", e.final_loss_below);
  opt("min_applied_steps", e.min_applied_steps);
  opt("recompute_bitwise", e.recompute_bitwise);
  opt("replay_bitwise", e.replay_bitwise);
  opt("injections_fired", e.injections_fired);
  opt("raises", e.raises);
  if (!e.raises_match.empty()) out << YAML::Key << "raises_match" << YAML::Value << e.raises_match;
  if (e.diverges) out << YAML::Key << "diverges" << YAML::Value << true;
  out << YAML::EndMap;
}

}  // namespace

std::string to_yaml(const ScenarioSpec& s) {
  YAML::Emitter out;
  out.SetDoublePrecision(17);
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << s.name;
  if (!s.description.empty()) out << YAML::Key << "description" << YAML::Value << s.description;
  if (s.world_size > 1) out << YAML::Key << "world_size" << YAML::Value << s.world_size;
  if (!s.program.empty()) {
    out << YAML::Key << "program" << YAML::Value << s.program;
    if (!s.program_config.empty()) out << YAML::Key << "config" << YAML::Value << YAML::Load(s.program_config);
    out << YAML::Key << "training" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "steps" << YAML::Value << s.training.steps;
    out << YAML::Key << "seed" << YAML::Value << s.training.seed;
    out << YAML::EndMap;
  } else {
    emit_model(out, s.model);
    emit_data(out, s.data);
    emit_training(out, s.training);
  }
  emit_defenses(out, s.defenses, s.program.empty());
  if (!s.injections.empty()) {
    out << YAML::Key << "injections" << YAML::Value << YAML::BeginSeq;
    for (const InjectionSpec& in : s.injections) emit_injection(out, in);
    out << YAML::EndSeq;
  }
  if (s.expect.any()) emit_expect(out, s.expect);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

bool ExpectSpec::any() const {
  return params_finite || loss_finite || max_skipped_steps || min_skipped_steps || min_scale_backoffs ||
         min_scale_growths || min_rollbacks || final_loss_below || min_applied_steps || recompute_bitwise ||
         replay_bitwise || injections_fired || raises || diverges;
}

bool cpu_runs_lstm_at(const std::string& precision) {
  static std::mutex mutex;
  static std::map<std::string, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(precision); it != known.end()) return it->second;
  const at::ScalarType dtype = precision == "bf16" ? at::kBFloat16 : precision == "fp16" ? at::kHalf : at::kFloat;
  bool runs = true;
  try {
    // Under CPU autocast at that dtype, as the harness trains (the same op outside autocast, on
    // tensors already in that dtype, takes another kernel and runs where autocast's does not).
    AutocastState autocast = AutocastState::capture();
    for (AutocastState::Entry& e : autocast.entries) {
      if (e.device_type == c10::DeviceType::CPU) {
        e.enabled = dtype != at::kFloat;
        e.dtype = dtype;
      }
    }
    const AutocastGuard guard(autocast);
    const auto o = at::TensorOptions().dtype(at::kFloat);
    const std::vector<at::Tensor> hx = {at::zeros({1, 1, 1}, o), at::zeros({1, 1, 1}, o)};
    const std::vector<at::Tensor> params = {at::zeros({4, 1}, o), at::zeros({4, 1}, o), at::zeros({4}, o),
                                            at::zeros({4}, o)};
    at::lstm(at::zeros({2, 1, 1}, o), hx, params, /*has_biases=*/true, /*num_layers=*/1, /*dropout=*/0.0,
             /*train=*/true, /*bidirectional=*/false, /*batch_first=*/false);
  } catch (const std::exception&) {  // a c10::Error, or oneDNN's own dnnl::error
    runs = false;
  }
  known[precision] = runs;
  return runs;
}

}  // namespace retrace
