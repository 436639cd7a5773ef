#!/usr/bin/env bash
# report.sh MODE RETRACE SCENARIO_FILES
#   MODE html:   `retrace run --report` and `retrace replay --report` write self-contained pages
#                with four charts per scenario, the matrix, NaN markers, and every user text escaped.
#   MODE render: the same pages rendered by headless Chromium: the parsed DOM holds the charts,
#                the matrix rows and the scenario names (and no element injected by a hostile
#                name), and the 1200x2000 screenshot is not blank and shows the NaN markers' red.
#                Exits 77 (ctest: skipped) when chromium is not installed.
set -euo pipefail
mode=$1 retrace=$2 files=$3
here=$(cd "$(dirname "$0")" && pwd)
if [[ $mode == render ]]; then
  chromium=$(command -v chromium || command -v chromium-browser || true)
  if [[ -z $chromium ]]; then
    echo "SKIP: chromium is not installed (scripts/setup installs it)"
    exit 77
  fi
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
count() { grep -o -- "$1" "$2" | wc -l; }

# A scenario whose name would inject markup if it were not escaped.
sed -e "s/^name: .*/name: '<img src=x onerror=alert(1)> \& \"quoted\"'/" \
  "$(dirname "$(dirname "$files")")/suite/scenarios/grad-nan-skip.yaml" >"$dir/hostile.yaml"
grep -q "^name: '<img" "$dir/hostile.yaml" || fail "could not write the hostile scenario"

set +e
"$retrace" run -j 2 builtin:grad-nan-skip-off builtin:fp16-overflow-loss-scaling builtin:bitflip-weights-rollback \
  "$dir/hostile.yaml" --report "$dir/run.html" >"$dir/run.out" 2>&1
code=$?
set -e
[[ $code -eq 0 ]] || { cat "$dir/run.out"; fail "retrace run exited $code"; }
grep -q "wrote the HTML report to $dir/run.html" "$dir/run.out" || fail "no report line"
html=$dir/run.html
[[ $(head -c 15 "$html") == "<!DOCTYPE html>" ]] || fail "not an HTML page"
[[ $(count '<svg class="chart"' "$html") -eq 16 ]] || fail "expected 16 charts, got $(count '<svg class="chart"' "$html")"
[[ $(count '<tr class="row">' "$html") -eq 4 ]] || fail "expected 4 matrix rows"
[[ $(count '<section class="scenario"' "$html") -eq 4 ]] || fail "expected 4 scenario sections"
grep -q '&lt;img src=x onerror=alert(1)&gt; &amp; &quot;quoted&quot;' "$html" || fail "the hostile name is not escaped"
! grep -q '<img' "$html" || fail "markup from a scenario name reached the page"
! grep -qi '<script' "$html" || fail "the page holds a script"
grep -q '>NaN</text>' "$html" || fail "no NaN marker"
for cls in injected skipped rollback; do grep -q "class=\"$cls\"" "$html" || fail "no $cls marker"; done
grep -q '>log scale</tspan>' "$html" || fail "no log axis"

"$retrace" record "$files/tiny-gpt-lr-explosion.yaml" -o "$dir/run.trace" --ring 4 >/dev/null 2>&1 && fail "the run was expected to go non-finite"
"$retrace" replay "$dir/run.trace" --report "$dir/replay.html" >"$dir/replay.out" 2>&1 || { cat "$dir/replay.out"; fail "replay failed"; }
rhtml=$dir/replay.html
grep -q 'reproduced bitwise' "$rhtml" || fail "no verdict in the replay report"
grep -q 'aten::native_layer_norm' "$rhtml" || fail "the first non-finite op is not named"
[[ $(count '<svg class="chart"' "$rhtml") -eq 4 ]] || fail "expected 4 charts in the replay report"
grep -q 'class="nonfinite"' "$rhtml" || fail "the non-finite step is not marked"
grep -q 'class="replayed"' "$rhtml" || fail "the replayed steps are not shaded"

# A report that cannot be written is bad input, found before anything runs.
set +e
"$retrace" run builtin:grad-nan-skip --report /nonexistent/dir/r.html >/dev/null 2>"$dir/err"
code=$?
set -e
[[ $code -eq 2 ]] && grep -q "does not exist" "$dir/err" || fail "an unwritable --report exited $code: $(cat "$dir/err")"

if [[ $mode != render ]]; then
  echo "ok: both reports written and well-formed"
  exit 0
fi

# Render: the DOM as Chromium parsed it, and a screenshot.
render() {  # render OUT.png URL -> dump-dom on stdout
  timeout 120 "$chromium" --headless --no-sandbox --disable-gpu --user-data-dir="$dir/profile" \
    --screenshot="$1" --window-size=1200,2000 "file://$2" >"$dir/chromium.log" 2>&1 ||
    { cat "$dir/chromium.log"; fail "chromium could not take a screenshot of $2"; }
  timeout 120 "$chromium" --headless --no-sandbox --disable-gpu --user-data-dir="$dir/profile" \
    --dump-dom "file://$2" 2>"$dir/chromium.log" || { cat "$dir/chromium.log"; fail "chromium could not load $2"; }
}
render "$dir/run.png" "$html" >"$dir/run.dom"
[[ $(count '<svg class="chart"' "$dir/run.dom") -eq 16 ]] || fail "the rendered DOM has $(count '<svg class="chart"' "$dir/run.dom") charts, expected 16"
[[ $(count '<tr class="row">' "$dir/run.dom") -eq 4 ]] || fail "the rendered DOM has not 4 matrix rows"
for name in grad-nan-skip-off fp16-overflow-loss-scaling bitflip-weights-rollback '&lt;img src=x onerror=alert(1)&gt;'; do
  grep -q -- "$name" "$dir/run.dom" || fail "the rendered DOM lacks the scenario $name"
done
[[ $(count '<img' "$dir/run.dom") -eq 0 ]] || fail "the hostile name became an element"
python3 "$here/png_check.py" "$dir/run.png" 1200 2000 c5221f 1a73e8 || fail "the run report's screenshot"

render "$dir/replay.png" "$rhtml" >"$dir/replay.dom"
[[ $(count '<svg class="chart"' "$dir/replay.dom") -eq 4 ]] || fail "the rendered replay DOM has not 4 charts"
grep -q 'aten::native_layer_norm' "$dir/replay.dom" || fail "the rendered replay DOM lacks the op"
python3 "$here/png_check.py" "$dir/replay.png" 1200 2000 c5221f 1a73e8 || fail "the replay report's screenshot"
echo "ok: both reports render in Chromium"
