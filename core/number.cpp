#include <retrace/number.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace retrace {

nlohmann::json json_number(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

std::optional<double> number_from_json(const nlohmann::json& j) {
  if (j.is_number()) return j.get<double>();
  if (!j.is_string()) return std::nullopt;
  const std::string& s = j.get_ref<const std::string&>();
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  return std::nullopt;
}

std::string number_text(double v, int precision) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream os;
  os.precision(precision);
  os << v;
  return os.str();
}

int digits_apart(double a, double b, int least) {
  int digits = least;
  while (digits < 17 && a != b && number_text(a, digits) == number_text(b, digits)) ++digits;
  return digits;
}

}  // namespace retrace
