// The HTML pages of `retrace run --report` and `retrace replay --report` (charts: report_chart.cpp).
#include <retrace/report.h>

#include "report_chart.h"

#include <retrace/number.h>
#include <retrace/records.h>
#include <retrace/version.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

namespace retrace {

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned char b = s[i];
    if (b < 0x80) {
      switch (b) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&quot;"; break;
        case '\'': out += "&#39;"; break;
        case '\t':
        case '\n': out += static_cast<char>(b); break;
        default:
          if (b >= 0x20 && b != 0x7f) out += static_cast<char>(b);
      }
      ++i;
      continue;
    }
    // A UTF-8 sequence: its length from the lead byte, continuation bytes checked, overlong
    // forms, surrogates and code points past U+10FFFF refused.
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if (b >= 0xC2 && b <= 0xDF) len = 2, cp = b & 0x1F;
    else if (b >= 0xE0 && b <= 0xEF) len = 3, cp = b & 0x0F;
    else if (b >= 0xF0 && b <= 0xF4) len = 4, cp = b & 0x07;
    bool valid = len > 0 && i + len <= n;
    for (std::size_t k = 1; valid && k < len; ++k) {
      valid = (s[i + k] & 0xC0) == 0x80;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (valid) {
      valid = !(len == 3 && cp < 0x800) && !(len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) &&
              !(cp >= 0xD800 && cp <= 0xDFFF);
    }
    if (valid) {
      out.append(text.substr(i, len));
      i += len;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    }
  }
  return out;
}

namespace {

const char* kStyle = R"css(
body{font:13px/1.45 "DejaVu Sans",system-ui,sans-serif;margin:16px auto;max-width:1180px;padding:0 10px;color:#202124;background:#fff}
h1{font-size:20px;margin:0 0 2px}
h2{font-size:16px;margin:18px 0 6px;border-bottom:1px solid #dadce0;padding-bottom:2px}
h3{font-size:14px;margin:0;display:inline}
.sub{color:#5f6368;margin:0 0 8px}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-weight:700;font-size:12px}
.ok{background:#e6f4ea;color:#137333}
.failed{background:#fce8e6;color:#a50e0e}
.held{color:#137333;font-weight:600}
.broke{color:#b06000;font-weight:600}
.idle{color:#5f6368;font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:4px 18px;font-size:12px;color:#3c4043;margin:6px 0 10px}
.legend span{white-space:nowrap}
.legend svg{vertical-align:middle;margin-right:4px}
table{border-collapse:collapse;font-size:12px}
th,td{padding:2px 7px;border-bottom:1px solid #e8eaed;text-align:left;vertical-align:top}
th{background:#f1f3f4;font-weight:600}
table.matrix{width:100%}
table.matrix td.verdict{font-weight:700}
table.kv th{background:none;color:#5f6368;font-weight:600;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.bad{color:#a50e0e;font-weight:700}
code,.mono{font-family:"DejaVu Sans Mono",monospace;font-size:11.5px}
a{color:#1a0dab;text-decoration:none}
section.scenario{border:1px solid #dadce0;border-radius:6px;padding:6px 8px 4px;margin:8px 0}
section.scenario .head{display:flex;flex-wrap:wrap;gap:4px 12px;align-items:baseline}
section.scenario .meta{color:#5f6368;font-size:12px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(240px,1fr));gap:2px 10px;margin-top:2px}
svg.chart{width:100%;height:auto;max-width:340px}
ul.events{margin:2px 0 2px;padding-left:18px;font-size:12px;color:#3c4043}
ul.events li.err{color:#a50e0e}
ul.notes{padding-left:18px}
svg.chart .plot{fill:#fbfbfb;stroke:#c8cacd}
svg.chart .grid{stroke:#e8eaed}
svg.chart text{font-size:9.5px;fill:#5f6368}
svg.chart .ct{font-size:11.5px;font-weight:700;fill:#202124}
svg.chart .cs{font-size:9.5px;font-style:italic}
svg.chart .empty{font-size:12px;fill:#80868b}
svg.chart .series{fill:none;stroke-width:1.6;stroke-linejoin:round}
svg.chart .pt{fill:#1a73e8}
svg.chart .pt.skip{fill:#fff;stroke:#1a73e8;stroke-width:1.3}
svg.chart .skipped{fill:#c8cacd;opacity:.6}
svg.chart .replayed{fill:#d2e3fc;opacity:.7}
svg.chart .injected{stroke:#d93025;stroke-width:1.6;stroke-dasharray:4 3}
svg.chart .rollback{stroke:#8e24aa;stroke-width:2}
svg.chart .rollback-head{fill:#8e24aa}
svg.chart .divergence{stroke:#e37400;stroke-width:2}
svg.chart .nonfinite{stroke:#a50e0e;stroke-width:2}
svg.chart .offlabel{font-weight:700;fill:#c5221f;font-size:10px}
)css";

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

void page_begin(std::ostringstream& os, const std::string& title) {
  os << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
     << "<meta name=\"generator\" content=\"retrace " << kVersion << "\"><title>" << html_escape(title)
     << "</title><style>" << kStyle << "</style></head><body>\n";
}

// The markers' key, with the same strokes and fills as the charts (class "legend", not "chart").
void legend(std::ostringstream& os, bool replay) {
  auto icon = [&](const std::string& shape, const std::string& label) {
    os << "<span><svg class=\"key\" width=\"22\" height=\"14\" xmlns=\"http://www.w3.org/2000/svg\">" << shape
       << "</svg>" << label << "</span>";
  };
  os << "<div class=\"legend\">";
  icon("<polyline points=\"1,11 8,5 14,8 21,2\" fill=\"none\" stroke=\"#1a73e8\" stroke-width=\"1.6\"/>"
       "<circle cx=\"8\" cy=\"5\" r=\"2.4\" fill=\"#1a73e8\"/>",
       "value per step (hollow dot: step skipped)");
  icon("<rect x=\"6\" y=\"0\" width=\"10\" height=\"14\" fill=\"#c8cacd\" opacity=\".6\"/>", "skipped step");
  icon(
      "<line x1=\"11\" y1=\"0\" x2=\"11\" y2=\"14\" stroke=\"#d93025\" stroke-width=\"1.6\" stroke-dasharray=\"4 3\"/>",
      "injected fault");
  icon("<line x1=\"16\" y1=\"0\" x2=\"16\" y2=\"14\" stroke=\"#8e24aa\" stroke-width=\"2\"/>"
       "<polygon points=\"15,1 15,9 9,5\" fill=\"#8e24aa\"/>",
       "rollback at the end of the step");
  icon("<polygon points=\"6,12 16,12 11,3\" fill=\"#c5221f\"/>",
       "NaN / Inf: off the scale, at the top edge (-Inf, and 0 on a log scale, at the bottom)");
  if (replay) {
    icon("<rect x=\"3\" y=\"0\" width=\"16\" height=\"14\" fill=\"#d2e3fc\"/>", "replayed steps");
    icon("<line x1=\"11\" y1=\"0\" x2=\"11\" y2=\"14\" stroke=\"#e37400\" stroke-width=\"2\"/>", "first divergence");
    icon("<line x1=\"11\" y1=\"0\" x2=\"11\" y2=\"14\" stroke=\"#a50e0e\" stroke-width=\"2\"/>", "first non-finite op");
  }
  os << "</div>\n";
}

void charts(std::ostringstream& os, const std::vector<StepPoint>& steps, const ChartMarks& marks) {
  os << "<div class=\"charts\">";
  for (ChartSeries s : {ChartSeries::kLoss, ChartSeries::kGradNorm, ChartSeries::kLossScale, ChartSeries::kLr}) {
    os << step_chart_svg(steps, s, marks);
  }
  os << "</div>\n";
}

void add_note(std::map<std::int64_t, std::string>& notes, std::int64_t step, const std::string& text) {
  std::string& n = notes[step];
  n += (n.empty() ? "" : "\n") + text;
}

const char* verdict_class(const ScenarioResult& r) { return r.passed ? "ok" : "failed"; }

// The outcome's colour: held green, broke (early, or without the fault, too) amber, not exercised grey.
const char* outcome_class(const ScenarioResult& r) {
  switch (r.outcome_kind()) {
    case Outcome::kHeld: return "held";
    case Outcome::kBroke:
    case Outcome::kBrokeEarly:
    case Outcome::kBrokeWithoutFault: return "broke";
    case Outcome::kNotExercised: return "idle";
  }
  return "";
}

}  // namespace

std::string html_run_report(const std::vector<ScenarioResult>& results, double seconds) {
  std::size_t failed = 0;
  for (const ScenarioResult& r : results) failed += r.passed ? 0 : 1;
  std::ostringstream os;
  page_begin(os, "retrace run: " + std::to_string(results.size()) + " scenarios");
  os << "<h1>retrace run: " << results.size() << " scenarios, " << results.size() - failed << " as expected, " << failed
     << " not</h1>\n<p class=\"sub\">in " << seconds_text(seconds) << "; each scenario trained in its own process. "
     << "Outcome: <span class=\"held\">held</span> (the defense held) or <span class=\"broke\">broke</span> (the fault "
     << "got through); a negative control is expected to break.</p>\n";

  os << "<h2>Outcome matrix</h2>\n<table class=\"matrix\"><thead><tr><th>scenario</th><th>fault</th><th>defense</th>"
     << "<th>outcome</th><th>expected</th><th>verdict</th></tr></thead><tbody>\n";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const ScenarioResult& r = results[i];
    const std::string expected = r.expected_to_break ? "broke" : "held";
    os << "<tr class=\"row\"><td><a href=\"#s" << i << "\">" << html_escape(r.name) << "</a></td><td class=\"mono\">"
       << html_escape(r.fault) << "</td><td class=\"mono\">" << html_escape(r.defense) << "</td><td class=\""
       << outcome_class(r) << "\">" << r.outcome() << "</td><td>" << expected << "</td><td class=\"verdict "
       << verdict_class(r) << "\">" << html_escape(r.verdict()) << "</td></tr>\n";
  }
  os << "</tbody></table>\n";

  os << "<h2>Per step</h2>\n";
  legend(os, false);
  for (std::size_t i = 0; i < results.size(); ++i) {
    const ScenarioResult& r = results[i];
    ChartMarks marks;
    const std::vector<StepNote> injected = r.notes_of(StepNoteKind::kInjected);
    const std::vector<StepNote> skipped = r.notes_of(StepNoteKind::kSkipped);
    for (const StepNote& n : injected) add_note(marks.notes, n.step, "injected " + n.line());
    for (const StepNote& n : skipped) add_note(marks.notes, n.step, "skipped " + n.line());
    os << "<section class=\"scenario\" id=\"s" << i << "\"><div class=\"head\"><h3>" << html_escape(r.name) << "</h3>"
       << "<span class=\"badge " << verdict_class(r) << "\">" << (r.passed ? "ok" : "FAILED") << "</span>"
       << "<span class=\"meta mono\">" << html_escape(r.fault) << " &#215; " << html_escape(r.defense) << "</span>"
       << "<span class=\"meta\"><span class=\"" << outcome_class(r) << "\">" << r.outcome() << "</span>, expected "
       << (r.expected_to_break ? "broke" : "held") << "; " << r.steps_run << " steps, " << r.skipped_steps
       << " skipped";
    if (r.rollbacks) os << ", " << r.rollbacks << " rollbacks";
    if (r.scale_backoffs || r.scale_growths)
      os << ", scale backoffs " << r.scale_backoffs << ", growths " << r.scale_growths;
    os << "; final loss " << value_text(r.final_loss) << "; " << seconds_text(r.seconds) << "</span></div>\n";
    charts(os, r.steps, marks);
    std::ostringstream events;
    if (r.raised) events << "<li class=\"err\">raised: " << html_escape(r.error) << "</li>";
    for (const StepNote& n : injected) events << "<li>injected: " << html_escape(n.line()) << "</li>";
    for (const StepNote& n : skipped) events << "<li>skipped: " << html_escape(n.line()) << "</li>";
    for (const std::string& why : r.reasons) events << "<li class=\"err\">" << html_escape(why) << "</li>";
    if (const Breakage* x = r.expected_to_break ? r.evidence() : nullptr) {
      events << "<li>broke: " << html_escape(x->detail) << "</li>";
    }
    if (!r.replay_report.empty()) events << "<li>replay: " << html_escape(r.replay_report) << "</li>";
    if (!events.str().empty()) os << "<ul class=\"events\">" << events.str() << "</ul>";
    os << "</section>\n";
  }
  os << "</body></html>\n";
  return os.str();
}

RecordedRun recorded_run(const TraceReader& trace) {
  RecordedRun run;
  const TraceHeader header = TraceHeader::decode(trace);
  if (header.program) run.program = header.program->name;
  for (const StepEndRecord& e : recorded_steps(trace).steps) {  // a damaged record: the curves go without it
    StepPoint p;
    p.step = e.step;
    p.loss = e.loss;
    p.grad_norm = e.grad_norm;
    p.loss_scale = e.loss_scale;
    p.lr = e.lr;
    p.skipped = e.skipped;
    p.rolled_back = e.rolled_back;
    for (const std::string& line : e.injected) {
      p.injected = true;
      add_note(run.notes, p.step, "injected " + line);
    }
    if (!e.skip_reason.empty()) add_note(run.notes, p.step, "skipped: " + e.skip_reason);
    run.steps.push_back(p);
  }
  return run;
}

namespace {

void kv(std::ostringstream& os, const char* key, const std::string& escaped_value) {
  os << "<tr><th>" << key << "</th><td>" << escaped_value << "</td></tr>";
}

void tensor_rows(std::ostringstream& os, const char* role, const std::vector<TensorStats>& stats) {
  for (const TensorStats& s : stats) {
    auto count = [&](std::int64_t n) { os << "<td class=\"num" << (n ? " bad" : "") << "\">" << n << "</td>"; };
    os << "<tr><td>" << role << "</td><td>" << html_escape(s.name) << "</td><td class=\"mono\">" << html_escape(s.meta)
       << "</td>";
    if (std::isnan(s.min)) {  // min, max and |max| are over the finite elements: there are none
      os << "<td class=\"num\" colspan=\"3\">no finite element</td>";
    } else {
      os << "<td class=\"num\">" << value_text(s.min) << "</td><td class=\"num\">" << value_text(s.max)
         << "</td><td class=\"num\">" << value_text(s.abs_max) << "</td>";
    }
    count(s.nonfinite.nan);
    count(s.nonfinite.pos_inf);
    count(s.nonfinite.neg_inf);
    os << "</tr>\n";
  }
}

std::string digest_text(const Digest& d) { return d.algorithm == DigestAlgorithm::kNone ? "-" : d.hex(); }

}  // namespace

std::string html_replay_report(const std::string& trace_name, const ReplayResult& result, const RecordedRun& recorded) {
  std::ostringstream os;
  page_begin(os, "retrace replay: " + trace_name);
  os << "<h1>retrace replay: <span class=\"mono\">" << html_escape(trace_name) << "</span></h1>\n<p class=\"sub\">"
     << "<span class=\"badge " << (result.reproduced ? "ok" : "failed") << "\">"
     << (result.reproduced ? "reproduced bitwise" : "DIVERGED") << "</span> replayed steps " << result.from_step << ".."
     << result.to_step;
  if (!recorded.program.empty())
    os << " of program <span class=\"mono\">" << html_escape(recorded.program) << "</span>";
  os << "; the trace records " << recorded.steps.size() << " step outcomes.";
  if (result.first_nonfinite) os << " A step went non-finite: the first op to produce NaN/Inf is named below.";
  os << "</p>\n";

  if (!result.notes.empty()) {
    os << "<h2>Notes</h2><ul class=\"notes\">";
    for (const std::string& n : result.notes) os << "<li>" << html_escape(n) << "</li>";
    os << "</ul>\n";
  }
  if (!result.environment.empty()) {
    os << "<h2>Environment differences "
          "(forced)</h2><table><thead><tr><th>field</th><th>recorded</th><th>current</th></tr>"
          "</thead><tbody>";
    for (const auto& d : result.environment) {
      os << "<tr><td>" << html_escape(d.field) << "</td><td>" << html_escape(d.recorded) << "</td><td>"
         << html_escape(d.current) << "</td></tr>";
    }
    os << "</tbody></table>\n";
  }

  os << "<h2>First divergence</h2>\n";
  if (const auto& d = result.first_divergence) {
    os << "<table class=\"kv divergence\"><tbody>";
    kv(os, "step", std::to_string(d->step));
    kv(os, "segment", d->segment.empty() ? "(outside segments)" : html_escape(d->segment));
    kv(os, "phase", html_escape(d->phase));
    kv(os, "tensor", "<span class=\"mono\">" + html_escape(d->tensor.empty() ? "-" : d->tensor) + "</span>");
    if (!d->detail.empty()) kv(os, "detail", html_escape(d->detail));
    kv(os, "recorded digest", "<span class=\"mono\">" + digest_text(d->recorded) + "</span>");
    kv(os, "replayed digest", "<span class=\"mono\">" + digest_text(d->replayed) + "</span>");
    if (d->diff) {
      const DiffReport& x = *d->diff;
      if (!x.comparable()) {
        kv(os, "not comparable", html_escape(x.mismatch));
      } else {
        kv(os, "differing elements", std::to_string(x.differing) + " of " + std::to_string(x.numel));
        kv(os, "first differing index",
           std::to_string(x.first_index) + " (recorded " + value_text(x.first_expected) + ", replayed " +
               value_text(x.first_actual) + ")");
        kv(os, "max |diff|", value_text(x.max_abs_diff));
        kv(os, "max ULP", std::to_string(x.max_ulp));
        if (x.nonfinite_mismatches) kv(os, "non-finite mismatches", std::to_string(x.nonfinite_mismatches));
      }
    } else if (d->detail.empty()) {
      kv(os, "values", "the trace holds digests only (record with --mode full for the diff statistics)");
    }
    os << "</tbody></table>\n";
  } else {
    os << "<p>None: every recorded digest and tensor of the replayed steps matched bit for bit.</p>\n";
  }

  os << "<h2>First non-finite op</h2>\n";
  if (const auto& n = result.first_nonfinite) {
    os << "<table class=\"kv nonfinite\"><tbody>";
    kv(os, "step", std::to_string(n->step));
    kv(os, "op", "<span class=\"mono\">" + html_escape(n->op) + "</span>");
    if (!n->inner_op.empty()) {
      kv(os, "made inside it, first returned by", "<span class=\"mono\">" + html_escape(n->inner_op) + "</span>");
    }
    kv(os, "segment",
       n->segment.empty()
           ? "(outside segments)"
           : html_escape(n->segment) +
                 (n->by_observer ? " (by an observer of its output, an injection: not the segment's own code)" : ""));
    kv(os, "phase", html_escape(n->phase));
    if (n->given_infinity && !n->nan_op.empty()) {
      kv(os, "infinity by design",
         "given to it as an argument; <span class=\"mono\">" + html_escape(n->nan_op) +
             "</span> turned it into NaN in " +
             (n->nan_segment.empty() ? "(outside segments)" : "segment " + html_escape(n->nan_segment)) + ", phase " +
             html_escape(n->nan_phase));
    } else if (n->given_infinity) {
      kv(os, "infinity by design",
         "given to it as an argument; no later op absorbed it" +
             (n->carried_to.empty()
                  ? std::string()
                  : ": <span class=\"mono\">" + html_escape(n->carried_to) + "</span> was the last op to carry it on"));
    }
    os << "</tbody></table>\n<table "
          "class=\"stats\"><thead><tr><th></th><th>tensor</th><th>dtype[shape]</th><th>min</th>"
          "<th>max</th><th>|max|</th><th>NaN</th><th>+Inf</th><th>-Inf</th></tr></thead><tbody>\n";
    tensor_rows(os, "input", n->inputs);
    tensor_rows(os, "output", n->outputs);
    os << "</tbody></table>\n";
  } else {
    os << "<p>None: no replayed step went non-finite, or a defense skipped it (see the notes).</p>\n";
  }

  os << "<h2>Recorded steps</h2>\n";
  if (recorded.steps.empty()) {
    os << "<p>The trace holds no step outcomes (the run died in its first step).</p>\n";
  } else {
    legend(os, true);
    ChartMarks marks;
    marks.notes = recorded.notes;
    marks.replay_from = result.from_step;
    marks.replay_to = result.to_step;
    if (result.first_divergence) marks.divergence_step = result.first_divergence->step;
    if (result.first_nonfinite) marks.nonfinite_step = result.first_nonfinite->step;
    charts(os, recorded.steps, marks);
  }
  os << "</body></html>\n";
  return os.str();
}

}  // namespace retrace
