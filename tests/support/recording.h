#pragma once
// Test support for the recorder, replayer and diagnose tests: a four-block tiny GPT (kGpt),
// record a built-in scenario program to a temporary trace, replay a trace, and rewrite a trace
// record by record.

#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/scenario.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include <unistd.h>

namespace retrace {

namespace fs = std::filesystem;

inline std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("retrace_replay_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

inline const char* kGpt = R"(
name: gpt
model: {type: tiny_gpt, layers: 4, d_model: 32, heads: 4, dropout: 0.1}
data: {batch: 4, seed: 3}
training: {steps: 3, optimizer: adamw, lr: 0.001, segments: 2}
)";

struct Recorded {
  std::string path;
  std::vector<StepOutcome> outcomes;
  RecorderStats stats;
};

inline Recorded record(const char* yaml, const std::string& name, RecorderOptions options, std::int64_t steps = -1) {
  register_builtin_programs();
  ScenarioProgram program(parse_scenario_text(yaml, name));
  Recorded r;
  r.path = temp_path(name);
  Recorder recorder(r.path, program, options);
  r.outcomes = record_run(program, recorder, steps > 0 ? steps : program.default_steps());
  recorder.close();
  r.stats = recorder.stats();
  return r;
}

// Replays as `retrace replay` does: the program built for a replay (BuildFor::kReplay), its
// parameters left uninitialized until the snapshot is restored.
inline ReplayResult replay(const std::string& path, ReplayOptions options = {}) {
  const TraceReader trace(path);
  std::unique_ptr<Program> program = program_from_trace(trace, BuildFor::kReplay);
  return Replayer(trace, *program).run(options);
}

// Re-encodes a trace, letting `edit_header` change the header and `edit` the records.
inline void rewrite(const std::string& from, const std::string& to,
                    const std::function<void(Record&, std::vector<TensorToWrite>&)>& edit,
                    const std::function<void(nlohmann::json&)>& edit_header = nullptr) {
  const TraceReader in(from);
  nlohmann::json header = in.header();
  header.erase("format_version");
  header.erase("writer");
  if (edit_header) edit_header(header);
  TraceWriter out(to, header);
  for (std::size_t i = 0; i < in.records().size(); ++i) {
    Record rec = in.read(i);
    std::vector<TensorToWrite> tensors;
    for (const TensorEntry& e : rec.tensors) {
      if (e.has_data()) {
        tensors.push_back({e.name, in.decode(rec, e), true, std::nullopt});
      } else {
        TensorToWrite w;
        w.name = e.name;
        w.digest = e.digest;
        w.dtype = e.dtype;
        w.shape = e.shape;
        tensors.push_back(std::move(w));
      }
    }
    edit(rec, tensors);
    rec.meta.erase("tensors");
    out.append(rec.type, rec.meta, tensors);
  }
  out.close();
}

}  // namespace retrace
