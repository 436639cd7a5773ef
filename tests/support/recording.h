#pragma once
// Test support for the recorder, replayer and diagnose tests: a four-block tiny GPT (kGpt),
// record a built-in scenario program to a temporary trace, replay a trace, and rewrite a trace
// record by record.

#include <retrace/io.h>
#include <retrace/recorder.h>
#include <retrace/replayer.h>
#include <retrace/scenario.h>
#include <retrace/trace.h>
#include <retrace/trainer.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>
#include <unistd.h>

namespace retrace {

namespace fs = std::filesystem;

inline std::string temp_path_prefix() { return "retrace_replay_test_" + std::to_string(::getpid()) + "_"; }

inline std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / (temp_path_prefix() + name)).string();
}

// After the last test of the process, removes what temp_path() named in it and a test left
// behind (traces, .incomplete files, folders of rank traces): a CI run had left over a hundred of
// them in /tmp. RETRACE_KEEP_TEST_FILES=1 keeps them, to look at after a failure. (A gtest
// environment: a static's destructor would run after LibTorch's statics are gone.)
class TempPathSweeper : public ::testing::Environment {
 public:
  void TearDown() override {
    if (const char* keep = std::getenv("RETRACE_KEEP_TEST_FILES"); keep && std::string_view(keep) == "1") return;
    const std::string prefix = temp_path_prefix();
    std::error_code ec;
    std::vector<fs::path> left;
    for (fs::directory_iterator it(fs::temp_directory_path(ec), ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().filename().string().rfind(prefix, 0) == 0) left.push_back(it->path());
    }
    for (const fs::path& p : left) io::remove_tree(p.string());
  }
};
inline ::testing::Environment* const temp_path_sweeper = ::testing::AddGlobalTestEnvironment(new TempPathSweeper);

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
// `keep`: whether to write a record at all (default: every one).
inline void rewrite(const std::string& from, const std::string& to,
                    const std::function<void(Record&, std::vector<TensorToWrite>&)>& edit,
                    const std::function<void(nlohmann::json&)>& edit_header = nullptr,
                    const std::function<bool(const RecordInfo&)>& keep = nullptr) {
  const TraceReader in(from);
  nlohmann::json header = in.header();
  header.erase("format_version");
  header.erase("writer");
  if (edit_header) edit_header(header);
  TraceWriter out(to, header);
  for (std::size_t i = 0; i < in.records().size(); ++i) {
    if (keep && !keep(in.records()[i])) continue;
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
