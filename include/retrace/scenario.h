#pragma once
// Scenario files: YAML describing a training run (model, data, training settings; the scenario
// issue grows the schema to defenses, injections and expectations). The schema is
// docs/scenarios.md. An unknown key, a wrong type, a non-finite number or a missing field is a
// retrace::Error naming the file, line and key.

#include <cstdint>
#include <string>

namespace retrace {

struct ModelSpec {
  std::string type;  // tiny_gpt | lstm | mlp (required)
  std::int64_t layers = 2;
  std::int64_t d_model = 32;  // tiny_gpt
  std::int64_t heads = 4;     // tiny_gpt
  std::int64_t hidden = 32;   // lstm, mlp
  std::int64_t vocab = 64;    // tiny_gpt, lstm
  std::int64_t seq_len = 16;  // tiny_gpt, lstm
  std::int64_t in_features = 16;   // mlp
  std::int64_t out_features = 4;   // mlp
  double dropout = 0.1;
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
  double momentum = 0.0;            // sgd
  int segments = 0;                 // checkpointed segments; 0 = no checkpointing
  double clip_grad_norm = 0.0;      // 0 = off
  std::string device = "cpu";       // cpu | cuda
};

struct ScenarioSpec {
  std::string name;
  std::string description;
  ModelSpec model;
  DataSpec data;
  TrainingSpec training;
  std::string origin;  // file path or "<text>", for messages
};

// Parses and validates. Throws retrace::Error "FILE:LINE: key 'a.b': what is wrong; how to fix".
ScenarioSpec parse_scenario_file(const std::string& path);
ScenarioSpec parse_scenario_text(const std::string& text, const std::string& origin = "<text>");
// Canonical YAML with every field; parse_scenario_text(to_yaml(s)) == s.
std::string to_yaml(const ScenarioSpec& spec);

}  // namespace retrace
