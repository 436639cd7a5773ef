#pragma once
// Non-finite numbers in retrace's outputs, one codec for all of them: trace metadata (step_end's
// loss, grad_norm, ...), replay's --json and the text lines of replay and inspect. JSON has no
// NaN or infinity, so they are the strings "nan", "inf" and "-inf"; a NaN's sign bit is dropped
// everywhere (x86 makes "-nan" of inf - inf, and it means nothing more than "nan").

#include <nlohmann/json.hpp>

#include <optional>
#include <string>

namespace retrace {

// v as a JSON number, or "nan", "inf", "-inf".
nlohmann::json json_number(double v);
// Reads json_number's output back; nullopt for anything else (another string, another type).
std::optional<double> number_from_json(const nlohmann::json& j);
// v as text for people: "nan" (whatever its sign), "inf", "-inf", else `precision` significant
// digits (printf's %g).
std::string number_text(double v, int precision = 6);
// The least precision from `least` (up to 17, which tells any two doubles apart) at which
// number_text prints a and b apart; `least` where they are equal.
int digits_apart(double a, double b, int least = 6);

}  // namespace retrace
