#pragma once
// Scenario files: YAML describing a training run -- model, data, training settings, the defenses
// switched on, the faults injected and what is expected of the run. The schema is
// docs/scenarios.md. An unknown key, a wrong type, a non-finite number or a missing field is a
// retrace::Error naming the file, line and key.

#include <retrace/defense_options.h>
#include <retrace/injection_spec.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace retrace {

// The most ranks a scenario may ask for (processes on one machine).
inline constexpr int kMaxScenarioRanks = 64;

struct ModelSpec {
  std::string type;  // tiny_gpt | lstm | mlp (required)
  std::int64_t layers = 2;
  std::int64_t d_model = 32;      // tiny_gpt
  std::int64_t heads = 4;         // tiny_gpt
  std::int64_t hidden = 32;       // lstm, mlp
  std::int64_t vocab = 64;        // tiny_gpt, lstm
  std::int64_t seq_len = 16;      // tiny_gpt, lstm
  std::int64_t in_features = 16;  // mlp
  std::int64_t out_features = 4;  // mlp
  double dropout = 0.1;
  double layernorm_eps = 1e-5;  // tiny_gpt
  double init_gain = 1.0;       // every weight matrix scaled by this after initialization
                                // (> 1 makes an RNN's gradients explode)
};

struct DataSpec {
  std::int64_t batch = 4;
  std::uint64_t seed = 1;
};

struct TrainingSpec {
  std::int64_t steps = 5;
  std::uint64_t seed = 0;
  std::string optimizer = "adamw";  // adamw | adam | sgd
  double lr = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;  // sgd
  int segments = 0;       // checkpointed segments; 0 = no checkpointing
  // full: segments recompute whole (0 segments: nothing recomputes). selective: segments is 0 and
  // each block's attention core, norms and gelu recompute (the norms and gelu not under autocast),
  // its dropout masks are kept as bits and its matmul outputs kept (RecomputePolicy::selective);
  // tiny_gpt only.
  std::string recompute = "full";  // full | selective
  double clip_grad_norm = 0.0;     // 0 = off
  std::string device = "cpu";      // cpu | cuda
  // fp32, or autocast to bf16 / fp16 for the forward (parameters and optimizer stay fp32).
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  double loss_weight = 1.0;        // the loss back-propagated is loss * loss_weight
};

// The scenario's defenses: the pipeline's (defenses.h), plus three that act inside the built-in
// models and so apply to them only.
struct DefenseSpec : DefenseOptions {
  bool layernorm_fp32 = false;     // LayerNorm computed in fp32 whatever the autocast dtype
  double layernorm_min_eps = 0.0;  // eps guard: LayerNorm eps raised to at least this
  bool preserve_rng_state = true;  // checkpoint recomputes under the forward's RNG state
};

// What the run must show. Unset fields are not checked.
struct ExpectSpec {
  std::optional<bool> params_finite;  // every parameter finite at the end
  std::optional<bool> loss_finite;    // every applied (not skipped) step's loss finite
  std::optional<std::int64_t> max_skipped_steps;
  std::optional<std::int64_t> min_skipped_steps;
  std::optional<std::int64_t> min_scale_backoffs;
  std::optional<std::int64_t> min_scale_growths;
  std::optional<std::int64_t> min_rollbacks;
  std::optional<double> final_loss_below;  // mean loss of the applied steps among the last 3,
                                           // counting from the fault's step
  // Applied steps from the fault's step to the end; unset: the default progress rule (at least
  // half of them, and the last step) for a scenario that expects to hold.
  std::optional<std::int64_t> min_applied_steps;
  std::optional<bool> recompute_bitwise;  // no non-bitwise recompute reached an applied step
  std::optional<bool> replay_bitwise;     // the recorded run replays bit for bit
  std::optional<bool> injections_fired;   // at least one injection fired
  // The run must stop with an error (a defense that refuses to go on, like clipping's
  // error_if_nonfinite); a run that raises then counts as held, not broke.
  std::optional<bool> raises;
  std::string raises_match;  // with raises: the error must contain this text (any error if empty)
  // A negative control: the fault must get through -- at or after its step, the run ends with
  // non-finite parameters, fails loss_finite, final_loss_below or recompute_bitwise, or raises
  // as `raises` expects -- with every injection fired and every other expectation met.
  bool diverges = false;
  bool any() const;
};

struct ScenarioSpec {
  std::string name;
  std::string description;
  // A registered program to train instead of a built-in model (`program:`), and its `config:`
  // map as YAML text (what the program's factory gets; "" without). Empty: `model:` names a
  // built-in model.
  std::string program;
  std::string program_config;
  int program_config_line = 0;  // the line of `config:` in `origin` (0: not known), for the
                                // program's refusal of it
  // Data-parallel ranks (`world_size:`): the run is this many processes on c10d (retrace/dist.h),
  // each on its own shard of the data, gradients averaged. 1: one process.
  int world_size = 1;
  ModelSpec model;
  DataSpec data;
  TrainingSpec training;
  DefenseSpec defenses;
  std::vector<InjectionSpec> injections;
  ExpectSpec expect;
  std::string origin;  // file path or "<text>", for messages
};

// Where a scenario's text comes from. kWritten: a file or text a person wrote. kCanonical: to_yaml's,
// as a trace's program config holds it -- of this version or an earlier one, whose text wrote an
// injection's default factor as `factor: 0` (refused in written text, where it would silently
// stand for the default instead of 0).
enum class ScenarioSource { kWritten, kCanonical };
// Parses and validates. Throws retrace::Error "FILE:LINE: key 'a.b': what is wrong; how to fix".
ScenarioSpec parse_scenario_file(const std::string& path);
ScenarioSpec parse_scenario_text(const std::string& text, const std::string& origin = "<text>",
                                 ScenarioSource source = ScenarioSource::kWritten);
// Canonical YAML with every field set (an injection's factor left out where it is 0, the type's
// default); parse_scenario_text(to_yaml(s)) == s.
std::string to_yaml(const ScenarioSpec& spec);

// Whether this machine's CPU kernels (oneDNN) run an LSTM at `precision` ("fp32", "bf16", "fp16"):
// it depends on the instruction set (an AVX2-only CPU has no bf16 LSTM primitive, and no CPU has
// an fp16 one). Probed once per precision by a one-unit LSTM forward (microseconds), then cached.
// Thread-safe. The parser refuses an lstm scenario on the CPU under bf16 where this says no, and
// under fp16 always.
bool cpu_runs_lstm_at(const std::string& precision);

}  // namespace retrace
