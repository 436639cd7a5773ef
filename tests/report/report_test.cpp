// The HTML report writer: text is escaped, NaN and Inf become labelled markers (never
// coordinates), every scenario gets its four charts, the replay page names the divergence and the
// first non-finite op, and per-step series survive the child process's JSON.
#include <retrace/error.h>
#include <retrace/report.h>

#include "report/report_chart.h"
#include <retrace/runner.h>
#include <retrace/trace.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <regex>
#include <string>

namespace retrace {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

std::size_t count(const std::string& haystack, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + needle.size()))
    ++n;
  return n;
}

std::vector<StepPoint> steps_with_losses(const std::vector<double>& losses) {
  std::vector<StepPoint> steps;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    StepPoint p;
    p.step = static_cast<std::int64_t>(i) + 1;
    p.loss = losses[i];
    p.grad_norm = std::isfinite(losses[i]) ? 0.5 * static_cast<double>(i + 1) : losses[i];
    p.loss_scale = 65536;
    p.lr = 0.003;
    steps.push_back(p);
  }
  return steps;
}

// Every geometric attribute is a plain finite number, every points list numbers only.
void expect_finite_geometry(const std::string& svg) {
  const std::regex attr(R"re(\s(x|y|x1|x2|y1|y2|cx|cy|r|width|height)="([^"]*)")re");
  const std::regex number(R"(-?[0-9]+(\.[0-9]+)?)");
  std::size_t seen = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), attr); it != std::sregex_iterator(); ++it, ++seen) {
    EXPECT_TRUE(std::regex_match((*it)[2].str(), number)) << (*it)[0].str();
  }
  EXPECT_GT(seen, 10u);
  const std::regex points(R"re(points="([^"]*)")re");
  const std::regex point_list(R"(-?[0-9]+\.[0-9]+,-?[0-9]+\.[0-9]+( -?[0-9]+\.[0-9]+,-?[0-9]+\.[0-9]+)*)");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), points); it != std::sregex_iterator(); ++it) {
    EXPECT_TRUE(std::regex_match((*it)[1].str(), point_list)) << (*it)[0].str();
  }
}

TEST(Report, EscapesMarkupQuotesControlCharactersAndBadUtf8) {
  EXPECT_EQ(html_escape("<a href=\"x\">'&'</a>"), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
  EXPECT_EQ(html_escape("a\x01"
                        "b\tc\nd\x7f"),
            "ab\tc\nd");
  EXPECT_EQ(html_escape("caf\xC3\xA9 \xE2\x9C\x93"), "caf\xC3\xA9 \xE2\x9C\x93");  // valid UTF-8 kept
  EXPECT_EQ(html_escape("x\xFFy"), "x\xEF\xBF\xBDy");                              // a stray byte
  EXPECT_EQ(html_escape("\xC3"), "\xEF\xBF\xBD");                                  // cut short
  EXPECT_EQ(html_escape("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong '/'
  EXPECT_EQ(html_escape("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
}

TEST(Report, NonFiniteValuesAreLabelledMarkersNotCoordinates) {
  const std::vector<StepPoint> steps = steps_with_losses({4.0, 3.0, kNaN, kInf, -kInf, 2.0});
  const std::string svg = step_chart_svg(steps, ChartSeries::kLoss);
  expect_finite_geometry(svg);
  EXPECT_NE(svg.find(">NaN</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">Inf</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">-Inf</text>"), std::string::npos) << svg;
  EXPECT_EQ(count(svg, "<polygon class=\"off\""), 3u);
  EXPECT_EQ(count(svg, "<circle"), 3u);    // the finite values
  EXPECT_EQ(count(svg, "<polyline"), 1u);  // steps 1-2; step 6 alone has no line
  // The scale is the finite values': 2..4 on a linear axis.
  EXPECT_NE(svg.find(">linear</tspan>"), std::string::npos);
  EXPECT_NE(svg.find(">2.0</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">4.0</text>"), std::string::npos) << svg;

  // Nothing finite at all, and no step at all: still a well-formed chart.
  const std::string all_nan = step_chart_svg(steps_with_losses({kNaN, kNaN}), ChartSeries::kLoss);
  expect_finite_geometry(all_nan);
  EXPECT_EQ(count(all_nan, ">NaN</text>"), 1u);  // one label for the run of NaNs
  EXPECT_NE(step_chart_svg({}, ChartSeries::kLoss).find("no step ran"), std::string::npos);
}

TEST(Report, GradientNormAndLossScaleUseALogAxisAndSaySo) {
  std::vector<StepPoint> steps = steps_with_losses({4.0, 3.9, 3.8});
  steps[1].grad_norm = 0;  // not on a log axis: a marker at the bottom, labelled
  const std::string norm = step_chart_svg(steps, ChartSeries::kGradNorm);
  EXPECT_NE(norm.find(">log scale</tspan>"), std::string::npos);
  EXPECT_NE(norm.find(">0</text>"), std::string::npos) << norm;
  expect_finite_geometry(norm);
  EXPECT_NE(step_chart_svg(steps, ChartSeries::kLossScale).find(">log scale</tspan>"), std::string::npos);
  EXPECT_NE(step_chart_svg(steps, ChartSeries::kLr).find(">linear</tspan>"), std::string::npos);
  // A loss spanning six decades goes on a log axis too.
  const std::string spike = step_chart_svg(steps_with_losses({4.0, 4e6, 3.0}), ChartSeries::kLoss);
  EXPECT_NE(spike.find(">log scale</tspan>"), std::string::npos);
  EXPECT_NE(spike.find(">1e6</text>"), std::string::npos) << spike;
}

TEST(Report, MarksInjectionsSkipsRollbacksAndTheReplaysSteps) {
  std::vector<StepPoint> steps = steps_with_losses({4.0, 3.9, kNaN, 3.7});
  steps[2].injected = true;
  steps[2].skipped = true;
  steps[2].rolled_back = true;
  ChartMarks marks;
  marks.notes[3] = "injected <grad_nonfinite>";
  marks.replay_from = 3;
  marks.replay_to = 4;
  marks.divergence_step = 4;
  marks.nonfinite_step = 3;
  const std::string svg = step_chart_svg(steps, ChartSeries::kLoss, marks);
  EXPECT_EQ(count(svg, "class=\"injected\""), 1u);
  EXPECT_EQ(count(svg, "class=\"skipped\""), 1u);
  EXPECT_EQ(count(svg, "class=\"rollback\""), 1u);
  EXPECT_EQ(count(svg, "class=\"replayed\""), 1u);
  EXPECT_EQ(count(svg, "class=\"divergence\""), 1u);
  EXPECT_EQ(count(svg, "class=\"nonfinite\""), 1u);
  EXPECT_NE(svg.find("injected &lt;grad_nonfinite&gt;"), std::string::npos);
  EXPECT_EQ(svg.find("<grad_nonfinite>"), std::string::npos);
  expect_finite_geometry(svg);
}

ScenarioResult result(const std::string& name, std::vector<StepPoint> steps, bool passed) {
  ScenarioResult r;
  r.name = name;
  r.fault = "grad_nonfinite:nan";
  r.defense = "skip_nonfinite";
  r.steps = std::move(steps);
  r.steps_run = static_cast<std::int64_t>(r.steps.size());
  r.passed = passed;
  r.broke = !passed;
  return r;
}

TEST(Report, EveryScenarioGetsItsChartsAndAMatrixRow) {
  std::vector<ScenarioResult> results;
  results.push_back(result("plain", steps_with_losses({4.0, 3.5, 3.0}), true));
  results.back().notes = {{2, StepNoteKind::kInjected, "grad_nonfinite grad.w: element 4 = nan"}};
  ScenarioResult crashed = result("crashed", {}, false);  // a child that died: no steps
  crashed.raised = true;
  crashed.error = "the scenario's process died by signal 9 (Killed)";
  results.push_back(crashed);
  ScenarioResult hostile = result("<script>alert(\"x\")</script>", steps_with_losses({4.0, kNaN}), false);
  hostile.checks.push_back({CheckKind::kFinalLossBelow, "< 3 & <b>", "nan", false});
  hostile.reasons.push_back("final_loss_below: expected < 3 & <b>, got nan");  // as evaluate() words it
  results.push_back(hostile);

  const std::string html = html_run_report(results, 12.5);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(count(html, "<svg class=\"chart\""), 12u);  // four per scenario, the crashed one too
  EXPECT_EQ(count(html, "<tr class=\"row\">"), 3u);
  EXPECT_EQ(count(html, "<section class=\"scenario\""), 3u);
  EXPECT_EQ(count(html, "no step ran"), 4u);
  for (const char* series : {"loss", "grad_norm", "loss_scale", "lr"}) {
    EXPECT_EQ(count(html, "data-series=\"" + std::string(series) + "\""), 3u) << series;
  }
  EXPECT_NE(html.find("3 scenarios, 1 as expected, 2 not"), std::string::npos);
  EXPECT_NE(html.find("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<b>"), std::string::npos);
  EXPECT_NE(html.find("&lt; 3 &amp; &lt;b&gt;"), std::string::npos);
  EXPECT_NE(html.find("died by signal 9"), std::string::npos);
  EXPECT_NE(html.find("class=\"verdict failed\""), std::string::npos);
  EXPECT_NE(html.find("class=\"verdict ok\""), std::string::npos);
  // Self-contained: nothing fetched, nothing run.
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));
}

TEST(Report, StepNotesGoToTheirOwnStep) {
  // The notes are data: each lands on its step's markers, whatever its text says.
  std::vector<StepPoint> steps = steps_with_losses({4.0, 3.5, 3.0});
  steps[1].injected = true;
  steps[2].skipped = true;
  ScenarioResult r = result("notes", steps, true);
  r.notes = {{2, StepNoteKind::kInjected, "loss_spike x100: step 3: looks like a prefix"},
             {3, StepNoteKind::kSkipped, "non-finite gradients"}};
  const std::string html = html_run_report({r}, 1.0);
  // The chart's tooltip of step 2's injection line carries its note, step 3's skip band its own.
  EXPECT_NE(html.find("step 2: injected fault\ninjected step 2: loss_spike x100: step 3: looks like a prefix"),
            std::string::npos);
  EXPECT_NE(html.find("step 3 skipped\nskipped step 3: non-finite gradients"), std::string::npos);
  EXPECT_NE(html.find("<li>injected: step 2: loss_spike x100: step 3: looks like a prefix</li>"), std::string::npos);
  EXPECT_NE(html.find("<li>skipped: step 3: non-finite gradients</li>"), std::string::npos);
  // Control: a note on another step is not on step 2's markers.
  r.notes[0].step = 1;
  const std::string moved = html_run_report({r}, 1.0);
  EXPECT_EQ(moved.find("step 2: injected fault\ninjected"), std::string::npos);
  EXPECT_NE(moved.find("<li>injected: step 1: loss_spike"), std::string::npos);
}

TEST(Report, ReplayPageNamesTheDivergenceAndTheFirstNonFiniteOp) {
  ReplayResult r;
  r.reproduced = false;
  r.from_step = 2;
  r.to_step = 3;
  Divergence d;
  d.step = 3;
  d.segment = "block0..block1";
  d.phase = "forward";
  d.tensor = "output.0";
  DiffReport diff;
  diff.numel = 10;
  diff.differing = 3;
  diff.first_index = 7;
  diff.max_abs_diff = 0.25;
  diff.max_ulp = 12;
  d.diff = diff;
  r.first_divergence = d;
  NonFiniteOrigin n;
  n.step = 3;
  n.segment = "block0..block1";
  n.phase = "forward";
  n.op = "aten::native_layer_norm";
  n.inputs.push_back({"input 0", "Float[4, 16, 32]", -3e24, 5e24, 5e24, {}});
  TensorStats out{"output 0", "Float[4, 16, 32]", kNaN, kNaN, kNaN, {}};
  out.nonfinite.nan = 2048;
  n.outputs.push_back(out);
  r.first_nonfinite = n;
  r.notes.push_back("step 3 carries injected faults (not real ones): <x>");
  RecordedRun recorded;
  recorded.program = "retrace.scenario";
  recorded.steps = steps_with_losses({4.0, 1e7, kNaN});

  const std::string html = html_replay_report("run<1>.trace", r, recorded);
  EXPECT_NE(html.find("DIVERGED"), std::string::npos);
  EXPECT_NE(html.find("run&lt;1&gt;.trace"), std::string::npos);
  EXPECT_NE(html.find("aten::native_layer_norm"), std::string::npos);
  EXPECT_NE(html.find("output.0"), std::string::npos);
  EXPECT_NE(html.find("3 of 10"), std::string::npos);
  EXPECT_NE(html.find("5e+24"), std::string::npos);
  EXPECT_NE(html.find(">2048</td>"), std::string::npos);
  // The output has no finite element: its min/max/|max| say so, not "NaN" (the input's are numbers).
  EXPECT_EQ(count(html, "<td class=\"num\" colspan=\"3\">no finite element</td>"), 1u);
  EXPECT_NE(html.find("(not real ones): &lt;x&gt;"), std::string::npos);
  EXPECT_EQ(count(html, "<svg class=\"chart\""), 4u);
  EXPECT_EQ(count(html, "class=\"divergence\""), 4u);  // a line on each chart
  EXPECT_EQ(count(html, "class=\"nonfinite\""), 4u);
  EXPECT_EQ(html.find("infinity by design"), std::string::npos);  // the control for the next report

  // An infinity by design that turned into NaN names the op that did, in the report as in the text.
  r.first_nonfinite->op = "aten::fill_";
  r.first_nonfinite->given_infinity = true;
  r.first_nonfinite->nan_op = "aten::addcdiv_";
  r.first_nonfinite->nan_phase = "optimizer";
  const std::string given = html_replay_report("run.trace", r, recorded);
  EXPECT_NE(given.find("given to it as an argument; <span class=\"mono\">aten::addcdiv_</span> turned it into NaN in "
                       "(outside segments), phase optimizer"),
            std::string::npos);
  r.first_nonfinite->nan_op.clear();
  r.first_nonfinite->carried_to = "aten::norm";
  const std::string carried = html_replay_report("run.trace", r, recorded);
  EXPECT_NE(carried.find("no later op absorbed it: <span class=\"mono\">aten::norm</span> was the last op"),
            std::string::npos);
}

TEST(Report, RecordedRunReadsTheStepEndRecords) {
  const std::string path = ::testing::TempDir() + "retrace_report_test.trace";
  {
    TraceWriter w(path, {{"program", {{"name", "retrace.scenario"}, {"config", ""}}}});
    w.append(RecordType::kStepEnd,
             {{"step", 1},
              {"loss", 4.5},
              {"grad_norm", 0.9},
              {"loss_scale", 1},
              {"lr", 0.003},
              {"skipped", false},
              {"finite", true}},
             {});
    w.append(RecordType::kStepEnd,
             {{"step", 2},
              {"loss", "nan"},
              {"grad_norm", "inf"},
              {"loss_scale", 1},
              {"lr", 0.003},
              {"skipped", true},
              {"finite", false},
              {"skip_reason", "non-finite gradients"},
              {"rolled_back", true},
              {"injected", {"grad_nonfinite grad.w: nan"}}},
             {});
    w.close();
  }
  const RecordedRun run = recorded_run(TraceReader(path));
  std::remove(path.c_str());
  EXPECT_EQ(run.program, "retrace.scenario");
  ASSERT_EQ(run.steps.size(), 2u);
  EXPECT_EQ(run.steps[0].step, 1);
  EXPECT_DOUBLE_EQ(run.steps[0].loss, 4.5);
  EXPECT_FALSE(run.steps[0].skipped);
  EXPECT_TRUE(std::isnan(run.steps[1].loss));
  EXPECT_TRUE(std::isinf(run.steps[1].grad_norm));
  EXPECT_TRUE(run.steps[1].skipped);
  EXPECT_TRUE(run.steps[1].rolled_back);
  EXPECT_TRUE(run.steps[1].injected);
  ASSERT_EQ(run.notes.count(2), 1u);
  EXPECT_NE(run.notes.at(2).find("non-finite gradients"), std::string::npos);
}

TEST(Report, PerStepSeriesSurviveTheResultJson) {
  ScenarioResult r = result("json", steps_with_losses({4.0, kNaN, kInf}), true);
  r.steps[1].skipped = true;
  r.steps[1].injected = true;
  r.steps[2].rolled_back = true;
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  ASSERT_EQ(back.steps.size(), 3u);
  EXPECT_EQ(back.steps[2].step, 3);
  EXPECT_TRUE(std::isnan(back.steps[1].loss));
  EXPECT_TRUE(std::isinf(back.steps[2].loss));
  EXPECT_TRUE(back.steps[1].skipped && back.steps[1].injected && back.steps[2].rolled_back);
  EXPECT_DOUBLE_EQ(back.steps[0].loss_scale, 65536);
  EXPECT_EQ(back.to_json(), r.to_json());
  // Older result files, without "steps", still read.
  std::string old = r.to_json().dump();
  const auto at = old.find("\"steps\":");
  ASSERT_NE(at, std::string::npos);
  const auto end = old.find("],", at);
  old.erase(at, end + 2 - at);
  EXPECT_TRUE(ScenarioResult::from_json(nlohmann::json::parse(old)).steps.empty());
}

TEST(Report, StepNotesSurviveTheResultJson) {
  ScenarioResult r = result("notes", steps_with_losses({4.0, 3.5}), true);
  r.notes = {{2, StepNoteKind::kInjected, "grad_nonfinite grad.w: element 4 = nan"},
             {2, StepNoteKind::kSkipped, "non-finite gradients"}};
  const ScenarioResult back = ScenarioResult::from_json(r.to_json());
  EXPECT_EQ(back.notes, r.notes);
  EXPECT_EQ(back.to_json(), r.to_json());
  // Control: a kind the reader does not know is an error, not a guess.
  std::string bad = r.to_json().dump();
  const std::string kind = "\"kind\":\"skipped\"";
  const auto at = bad.find(kind);
  ASSERT_NE(at, std::string::npos) << bad;
  bad.replace(at, kind.size(), "\"kind\":\"shipped\"");
  EXPECT_THROW(ScenarioResult::from_json(nlohmann::json::parse(bad)), Error);
}

}  // namespace
}  // namespace retrace
