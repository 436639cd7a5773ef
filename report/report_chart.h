#pragma once
// The HTML report's pieces: escaping, number text and the SVG step charts. Internals of
// retrace::report (not installed); its tests include this as "report/report_chart.h".

#include <retrace/report.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace retrace {

// Text for HTML element content and attribute values: & < > " ' escaped, control characters
// other than tab and newline dropped, invalid UTF-8 replaced by U+FFFD.
std::string html_escape(std::string_view text);

// A value for a table or a tooltip: %.6g, or NaN, Inf, -Inf.
std::string value_text(double v);

enum class ChartSeries { kLoss, kGradNorm, kLossScale, kLr };

struct ChartMarks {
  std::map<std::int64_t, std::string> notes;      // step -> tooltip text (injections, skips)
  std::int64_t replay_from = -1, replay_to = -1;  // shaded: the replayed steps (-1: none)
  std::int64_t divergence_step = -1;              // the first divergence (-1: none)
  std::int64_t nonfinite_step = -1;               // the step of the first non-finite op (-1: none)
};

// One chart, `<svg class="chart" data-series="...">` of fixed size: the series over the steps,
// skipped steps shaded, injections, rollbacks and the marks drawn as vertical lines. Gradient
// norm and loss scale use a log axis; loss and LR use one when positive and spanning 100x or
// more. The axis title says "log scale" when it is one. `steps` must be in step order.
std::string step_chart_svg(const std::vector<StepPoint>& steps, ChartSeries series, const ChartMarks& marks = {});

}  // namespace retrace
