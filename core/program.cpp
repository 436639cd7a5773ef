#include <retrace/program.h>

#include <retrace/diff.h>
#include <retrace/error.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <mutex>

namespace retrace {

bool StepOutcome::finite() const { return std::isfinite(loss) && std::isfinite(grad_norm); }

const char* to_string(TensorKind kind) {
  switch (kind) {
    case TensorKind::kOther: return "other";
    case TensorKind::kParameter: return "parameter";
    case TensorKind::kBuffer: return "buffer";
    case TensorKind::kOptimizerState: return "optimizer_state";
    case TensorKind::kDefenseState: return "defense_state";
    case TensorKind::kInput: return "input";
    case TensorKind::kTarget: return "target";
    case TensorKind::kGradient: return "gradient";
  }
  return "?";
}

TensorKind tensor_kind_from_string(const std::string& name) {
  for (TensorKind k : {TensorKind::kParameter, TensorKind::kBuffer, TensorKind::kOptimizerState,
                       TensorKind::kDefenseState, TensorKind::kInput, TensorKind::kTarget, TensorKind::kGradient}) {
    if (name == to_string(k)) return k;
  }
  return TensorKind::kOther;
}

std::vector<NamedTensor> clone_all(const std::vector<NamedTensor>& tensors) {
  std::vector<NamedTensor> out;
  out.reserve(tensors.size());
  for (const NamedTensor& n : tensors) out.push_back({n.name, n.tensor.detach().clone(), n.kind});
  return out;
}

std::vector<NamedTensor> of_kind(const std::vector<NamedTensor>& tensors, TensorKind kind) {
  std::vector<NamedTensor> out;
  for (const NamedTensor& n : tensors) {
    if (n.kind == kind) out.push_back(n);
  }
  return out;
}

bool parameters_finite(const std::vector<NamedTensor>& state) {
  for (const NamedTensor& n : state) {
    if (n.kind == TensorKind::kParameter && !all_finite(n.tensor)) {
      return false;
    }
  }
  return true;
}

namespace {
std::mutex g_mutex;
std::map<std::string, ProgramFactory>& registry() {
  static std::map<std::string, ProgramFactory> r;
  return r;
}
}  // namespace

void register_program(const std::string& name, ProgramFactory factory) {
  std::lock_guard<std::mutex> lock(g_mutex);
  registry()[name] = std::move(factory);
}

std::vector<std::string> registered_programs() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::string> names;
  for (const auto& [name, _] : registry()) names.push_back(name);
  return names;
}

namespace {
thread_local bool g_restoring_state = false;
}  // namespace

bool restoring_state() { return g_restoring_state; }
RestoringStateScope::RestoringStateScope() : previous_(g_restoring_state) { g_restoring_state = true; }
RestoringStateScope::~RestoringStateScope() { g_restoring_state = previous_; }

std::unique_ptr<Program> make_program(const std::string& name, const std::string& config) {
  ProgramFactory factory;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = registry().find(name);
    if (it != registry().end()) factory = it->second;
  }
  if (!factory) {
    std::string known;
    for (const std::string& n : registered_programs()) known += (known.empty() ? "" : ", ") + n;
    throw Error("the trace was recorded by program '" + name + "', which this binary does not know (it has: " +
                (known.empty() ? "none" : known) + "); replay it with the binary that recorded it");
  }
  try {
    return factory(config);
  } catch (const std::exception& e) {  // whatever the factory throws (std::stod's "stod" too): its config
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));  // c10::Error appends a C++ backtrace
    throw Error("program '" + name + "' refuses its config: " + what);
  }
}

}  // namespace retrace
