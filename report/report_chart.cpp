// The per-step charts of the HTML reports: inline SVG, one series per chart.
#include <retrace/report.h>

#include "report_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace retrace {

namespace {

// Geometry (px). The plot area is [kLeft, kWidth - kRight] x [kTop, kHeight - kBottom]; the strip
// above it holds the markers of values off the scale (NaN, +Inf).
constexpr double kWidth = 282, kHeight = 172;
constexpr double kLeft = 50, kRight = 10, kTop = 36, kBottom = 26;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;

const char* kLine = "#1a73e8";
const char* kOffScale = "#c5221f";

// A coordinate: finite by construction, two decimals.
std::string c(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", std::isfinite(v) ? v : 0.0);
  return buf;
}

// "1.5e+06" -> "1.5e6", "1e-04" -> "1e-4".
std::string compact_exponent(std::string s) {
  const auto e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  const bool neg = !exp.empty() && exp[0] == '-';
  if (!exp.empty() && (exp[0] == '+' || exp[0] == '-')) exp.erase(0, 1);
  while (exp.size() > 1 && exp[0] == '0') exp.erase(0, 1);
  return mant + "e" + (neg ? "-" : "") + exp;
}

std::string linear_tick_label(double v, double step) {
  if (std::abs(v) < step * 1e-6) return "0";
  const double a = std::abs(v);
  char buf[48];
  if (a >= 1e5 || a < 1e-3) {
    const int digits =
        std::clamp(static_cast<int>(std::floor(std::log10(a) + 1e-9) - std::floor(std::log10(step) + 1e-9)), 0, 4);
    std::snprintf(buf, sizeof buf, "%.*e", digits, v);
    return compact_exponent(buf);
  }
  const int decimals = std::clamp(static_cast<int>(-std::floor(std::log10(step) + 1e-9)), 0, 6);
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

std::string decade_label(int exponent) {
  if (exponent >= 0 && exponent <= 3)
    return std::to_string(static_cast<long long>(std::llround(std::pow(10.0, exponent))));
  if (exponent == -1) return "0.1";
  if (exponent == -2) return "0.01";
  return "1e" + std::to_string(exponent);
}

double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

double series_value(const StepPoint& p, ChartSeries s) {
  switch (s) {
    case ChartSeries::kLoss: return p.loss;
    case ChartSeries::kGradNorm: return p.grad_norm;
    case ChartSeries::kLossScale: return p.loss_scale;
    case ChartSeries::kLr: return p.lr;
  }
  return p.loss;
}

const char* series_id(ChartSeries s) {
  switch (s) {
    case ChartSeries::kLoss: return "loss";
    case ChartSeries::kGradNorm: return "grad_norm";
    case ChartSeries::kLossScale: return "loss_scale";
    case ChartSeries::kLr: return "lr";
  }
  return "loss";
}

const char* series_title(ChartSeries s) {
  switch (s) {
    case ChartSeries::kLoss: return "loss";
    case ChartSeries::kGradNorm: return "gradient norm";
    case ChartSeries::kLossScale: return "loss scale";
    case ChartSeries::kLr: return "learning rate";
  }
  return "";
}

// The y axis: linear or log10, its domain and ticks.
struct YAxis {
  bool log = false;
  double lo = 0, hi = 1;                              // in axis units (log10 of the value on a log axis)
  std::vector<std::pair<double, std::string>> ticks;  // axis units, label
  double y(double value) const {
    const double u = log ? std::log10(value) : value;
    return kTop + kPlotH * (1.0 - (u - lo) / (hi - lo));
  }
  bool plottable(double v) const { return std::isfinite(v) && (!log || v > 0); }
};

YAxis make_axis(const std::vector<double>& values, ChartSeries series) {
  double mn = INFINITY, mx = -INFINITY, pos_min = INFINITY;
  bool any_nonpositive = false;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    mn = std::min(mn, v);
    mx = std::max(mx, v);
    if (v > 0) pos_min = std::min(pos_min, v);
    else any_nonpositive = true;
  }
  YAxis axis;
  const bool always_log = series == ChartSeries::kGradNorm || series == ChartSeries::kLossScale;
  axis.log = always_log ? std::isfinite(pos_min) : (!any_nonpositive && std::isfinite(pos_min) && mx / pos_min >= 100);
  if (axis.log) {
    const double lmin = std::log10(pos_min), lmax = std::log10(mx);
    double lo = std::floor(lmin + 1e-9), hi = std::ceil(lmax - 1e-9);
    if (hi - lo < 1) {  // within one decade: show the decades either side
      lo = std::floor(lmin + 1e-9) - (lmax - lmin < 1e-12 ? 1 : 0);
      hi = lo + 2;
    }
    axis.lo = lo;
    axis.hi = hi;
    const int span = static_cast<int>(hi - lo);
    const int every = std::max(1, (span + 4) / 5);
    for (int e = static_cast<int>(lo); e <= static_cast<int>(hi); e += every)
      axis.ticks.push_back({e, decade_label(e)});
    return axis;
  }
  if (!std::isfinite(mn)) {  // nothing finite to scale by
    axis.lo = 0;
    axis.hi = 1;
    return axis;
  }
  if (mx - mn <= std::abs(mx) * 1e-12) {  // a constant: a band around it ([0, 1] around 0)
    const double pad = std::abs(mn) * 0.05;
    mn = mn == 0 ? 0 : mn - pad;
    mx = mx == 0 ? 1 : mx + pad;
  }
  const double step = nice_step(mx - mn, 4);
  axis.lo = std::floor(mn / step + 1e-9) * step;
  axis.hi = std::ceil(mx / step - 1e-9) * step;
  if (axis.hi <= axis.lo) axis.hi = axis.lo + step;
  for (double t = axis.lo; t <= axis.hi + step * 1e-6; t += step) axis.ticks.push_back({t, linear_tick_label(t, step)});
  return axis;
}

}  // namespace

std::string value_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Inf" : "-Inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string step_chart_svg(const std::vector<StepPoint>& steps, ChartSeries series, const ChartMarks& marks) {
  std::ostringstream os;
  std::vector<double> values;
  for (const StepPoint& p : steps) values.push_back(series_value(p, series));
  const YAxis axis = make_axis(values, series);

  os << "<svg class=\"chart\" data-series=\"" << series_id(series) << "\" xmlns=\"http://www.w3.org/2000/svg\" width=\""
     << kWidth << "\" height=\"" << kHeight << "\" viewBox=\"0 0 " << kWidth << " " << kHeight << "\" role=\"img\">";
  os << "<title>" << series_title(series) << (axis.log ? " (log scale)" : "") << " per step</title>";
  // The title and, after it, the axis's kind (left-aligned: the right end of the strip above the
  // plot is where a last step's NaN label goes).
  os << "<text x=\"4\" y=\"13\"><tspan class=\"ct\">" << series_title(series) << "</tspan><tspan class=\"cs\" dx=\"7\">"
     << (axis.log ? "log scale" : "linear") << "</tspan></text>";
  os << "<rect class=\"plot\" x=\"" << c(kLeft) << "\" y=\"" << c(kTop) << "\" width=\"" << c(kPlotW) << "\" height=\""
     << c(kPlotH) << "\"/>";
  if (steps.empty()) {
    os << "<text class=\"empty\" x=\"" << c(kLeft + kPlotW / 2) << "\" y=\"" << c(kTop + kPlotH / 2)
       << "\" text-anchor=\"middle\">no step ran</text></svg>";
    return os.str();
  }

  const std::int64_t first = steps.front().step, last = std::max(steps.back().step, first);
  const double spacing = kPlotW / static_cast<double>(last - first + 1);
  auto x = [&](std::int64_t s) { return kLeft + (static_cast<double>(s - first) + 0.5) * spacing; };
  auto band = [&](std::int64_t from, std::int64_t to, const char* cls, const std::string& title) {
    const std::int64_t a = std::max(from, first), b = std::min(to, last);
    if (b < a) return;
    os << "<rect class=\"" << cls << "\" x=\"" << c(x(a) - spacing / 2) << "\" y=\"" << c(kTop) << "\" width=\""
       << c(spacing * static_cast<double>(b - a + 1)) << "\" height=\"" << c(kPlotH) << "\"><title>"
       << html_escape(title) << "</title></rect>";
  };
  auto note = [&](std::int64_t s) {
    const auto it = marks.notes.find(s);
    return it == marks.notes.end() ? std::string() : "\n" + it->second;
  };

  // Backgrounds: the replayed range, skipped steps.
  if (marks.replay_from >= 0 && marks.replay_to >= marks.replay_from) {
    band(marks.replay_from, marks.replay_to, "replayed",
         "replayed steps " + std::to_string(marks.replay_from) + ".." + std::to_string(marks.replay_to));
  }
  for (const StepPoint& p : steps) {
    if (p.skipped) band(p.step, p.step, "skipped", "step " + std::to_string(p.step) + " skipped" + note(p.step));
  }

  // Y grid and labels.
  for (const auto& [u, label] : axis.ticks) {
    const double yy = kTop + kPlotH * (1.0 - (u - axis.lo) / (axis.hi - axis.lo));
    os << "<line class=\"grid\" x1=\"" << c(kLeft) << "\" y1=\"" << c(yy) << "\" x2=\"" << c(kLeft + kPlotW)
       << "\" y2=\"" << c(yy) << "\"/>";
    os << "<text class=\"tick\" x=\"" << c(kLeft - 4) << "\" y=\"" << c(yy + 3) << "\" text-anchor=\"end\">"
       << html_escape(label) << "</text>";
  }
  // X labels: every step up to 12 steps, else every 2, 5, 10, ... steps.
  const std::int64_t n = last - first + 1;
  std::int64_t every = 1;
  for (std::int64_t k : {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000}) {
    every = k;
    if (n / k <= 10) break;
  }
  while (n / every > 10) every *= 10;
  for (std::int64_t s = first; s <= last; ++s) {
    if (every > 1 && s % every != 0) continue;
    os << "<text class=\"tick\" x=\"" << c(x(s)) << "\" y=\"" << c(kTop + kPlotH + 12) << "\" text-anchor=\"middle\">"
       << s << "</text>";
  }
  os << "<text class=\"axis\" x=\"4\" y=\"" << c(kTop + kPlotH + 12) << "\">step</text>";

  // Events: injections, rollbacks, and the replay's marks.
  auto vline = [&](std::int64_t s, const char* cls, const std::string& title) {
    if (s < first || s > last) return;
    os << "<line class=\"" << cls << "\" x1=\"" << c(x(s)) << "\" y1=\"" << c(kTop) << "\" x2=\"" << c(x(s))
       << "\" y2=\"" << c(kTop + kPlotH) << "\"><title>" << html_escape(title) << "</title></line>";
  };
  for (const StepPoint& p : steps) {
    if (p.injected) vline(p.step, "injected", "step " + std::to_string(p.step) + ": injected fault" + note(p.step));
    if (p.rolled_back) {
      // At the end of the step (its cell's right edge), with a rewind arrowhead at the top.
      const double xr = x(p.step) + spacing / 2 - 1;
      const std::string title = html_escape("step " + std::to_string(p.step) + ": rolled back" + note(p.step));
      os << "<line class=\"rollback\" x1=\"" << c(xr) << "\" y1=\"" << c(kTop) << "\" x2=\"" << c(xr) << "\" y2=\""
         << c(kTop + kPlotH) << "\"><title>" << title << "</title></line><polygon class=\"rollback-head\" points=\""
         << c(xr - 1) << "," << c(kTop + 1) << " " << c(xr - 1) << "," << c(kTop + 9) << " " << c(xr - 7) << ","
         << c(kTop + 5) << "\"><title>" << title << "</title></polygon>";
    }
  }
  if (marks.divergence_step >= 0)
    vline(marks.divergence_step, "divergence", "first divergence at step " + std::to_string(marks.divergence_step));
  if (marks.nonfinite_step >= 0)
    vline(marks.nonfinite_step, "nonfinite", "first non-finite op at step " + std::to_string(marks.nonfinite_step));

  // The series: polylines through runs of plottable points, a dot per point (hollow when the
  // step was skipped), off-scale values as labelled triangles at the top or bottom edge.
  std::string run;
  auto flush = [&]() {
    if (run.find(' ') != std::string::npos)
      os << "<polyline class=\"series\" stroke=\"" << kLine << "\" points=\"" << run << "\"/>";
    run.clear();
  };
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const double v = values[i];
    if (!axis.plottable(v)) {
      flush();
      continue;
    }
    if (i > 0 && steps[i].step != steps[i - 1].step + 1) flush();  // a gap in the steps
    run += (run.empty() ? "" : " ") + c(x(steps[i].step)) + "," + c(axis.y(v));
  }
  flush();
  double last_label_x = -1e9;
  std::string last_label;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const StepPoint& p = steps[i];
    const double v = values[i];
    const std::string title = "step " + std::to_string(p.step) + ": " + series_title(series) + " " + value_text(v) +
                              (p.skipped ? " (skipped)" : "") + note(p.step);
    if (axis.plottable(v)) {
      os << "<circle class=\"" << (p.skipped ? "pt skip" : "pt") << "\" cx=\"" << c(x(p.step)) << "\" cy=\""
         << c(axis.y(v)) << "\" r=\"2.6\"><title>" << html_escape(title) << "</title></circle>";
      last_label.clear();
      continue;
    }
    // Off the scale: NaN and +Inf at the top, -Inf and (log axis) zero or negative at the bottom.
    const bool top = std::isnan(v) || v > 0;
    const std::string label = std::isnan(v) ? "NaN" : std::isinf(v) ? (v > 0 ? "Inf" : "-Inf") : (v == 0 ? "0" : "<0");
    const double xx = x(p.step);
    const double base = top ? kTop - 3 : kTop + kPlotH - 9, tip = top ? kTop - 11 : kTop + kPlotH - 1;
    os << "<polygon class=\"off\" fill=\"" << kOffScale << "\" points=\"" << c(xx - 4.5) << "," << c(base) << " "
       << c(xx + 4.5) << "," << c(base) << " " << c(xx) << "," << c(tip) << "\"><title>"
       << html_escape(title + " (off the scale)") << "</title></polygon>";
    // The label above a top marker (inside the plot above a bottom one), for the first of a run
    // of the same kind, where it does not crowd the previous label.
    if (label != last_label && xx - last_label_x > 24) {
      os << "<text class=\"offlabel\" x=\"" << c(xx) << "\" y=\"" << c(top ? kTop - 13 : kTop + kPlotH - 11)
         << "\" text-anchor=\"middle\">" << label << "</text>";
      last_label_x = xx;
    }
    last_label = label;
  }
  os << "</svg>";
  return os.str();
}

}  // namespace retrace
