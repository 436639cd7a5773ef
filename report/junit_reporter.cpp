// The JUnit reporter of `retrace run --junit`.
#include <retrace/reporter.h>

#include <ostream>
#include <sstream>

namespace retrace {

namespace {
std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') out += ' ';
        else out += c;
    }
  }
  return out;
}
}  // namespace

std::string junit_xml(const std::vector<ScenarioResult>& results, double seconds) {
  std::size_t failures = 0;
  for (const ScenarioResult& r : results) failures += r.passed ? 0 : 1;
  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  os << "<testsuites tests=\"" << results.size() << "\" failures=\"" << failures << "\" time=\"" << seconds << "\">\n";
  os << "  <testsuite name=\"retrace.scenarios\" tests=\"" << results.size() << "\" failures=\"" << failures
     << "\" time=\"" << seconds << "\">\n";
  for (const ScenarioResult& r : results) {
    os << "    <testcase classname=\"retrace.scenarios\" name=\"" << xml_escape(r.name) << "\" time=\"" << r.seconds
       << "\">\n";
    if (!r.passed) {
      std::string msg;
      for (const std::string& why : r.reasons) msg += (msg.empty() ? "" : "; ") + why;
      os << "      <failure message=\"" << xml_escape(msg) << "\">";
      for (const ExpectationCheck& c : r.checks) {
        os << xml_escape(std::string(c.name()) + ": expected " + c.expected + ", observed " + c.observed +
                         (c.passed ? "" : "  <-- failed"))
           << "\n";
      }
      os << "</failure>\n";
    }
    os << "      <system-out>"
       << xml_escape("fault: " + r.fault + "; defense: " + r.defense + "; outcome: " + r.outcome())
       << "</system-out>\n";
    os << "    </testcase>\n";
  }
  os << "  </testsuite>\n</testsuites>\n";
  return os.str();
}


void JunitReporter::suite_done(const SuiteRun& run) { out_ << junit_xml(run.results, run.seconds); }

}  // namespace retrace
