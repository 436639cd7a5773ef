// The HTML reporter of `retrace run --report` (the page itself: report.cpp, report_chart.cpp).
#include <retrace/reporter.h>

#include <retrace/report.h>

#include <ostream>

namespace retrace {

void HtmlReporter::suite_done(const SuiteRun& run) { out_ << html_run_report(run.results, run.seconds); }

}  // namespace retrace
