#include <retrace/autocast.h>

#include <ATen/autocast_mode.h>

namespace retrace {

namespace {
constexpr c10::DeviceType kAutocastDevices[] = {c10::DeviceType::CPU, c10::DeviceType::CUDA};
}

AutocastState AutocastState::capture() {
  AutocastState s;
  for (c10::DeviceType type : kAutocastDevices) {
    s.entries.push_back({type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
  }
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return s;
}

bool AutocastState::any_enabled() const {
  for (const Entry& e : entries) {
    if (e.enabled) return true;
  }
  return false;
}

std::string AutocastState::to_string() const {
  std::string out;
  for (const Entry& e : entries) {
    if (!out.empty()) out += ' ';
    out += c10::DeviceTypeName(e.device_type, /*lower_case=*/true);
    out += ':';
    out += e.enabled ? c10::toString(e.dtype) : "off";
  }
  return out;
}

namespace {
void apply(const AutocastState& s) {
  for (const AutocastState::Entry& e : s.entries) {
    at::autocast::set_autocast_enabled(e.device_type, e.enabled);
    at::autocast::set_autocast_dtype(e.device_type, e.dtype);
  }
  at::autocast::set_autocast_cache_enabled(s.cache_enabled);
}
}  // namespace

AutocastGuard::AutocastGuard(const AutocastState& state) : previous_(AutocastState::capture()) {
  apply(state);
  if (state.any_enabled()) {
    at::autocast::increment_nesting();
    nested_ = true;
  }
}

AutocastGuard::~AutocastGuard() {
  if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  apply(previous_);
}

}  // namespace retrace
