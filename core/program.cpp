#include <retrace/program.h>

#include <retrace/error.h>

#include <cmath>
#include <map>
#include <mutex>

namespace retrace {

bool StepOutcome::finite() const { return std::isfinite(loss) && std::isfinite(grad_norm); }

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
  return factory(config);
}

}  // namespace retrace
