#!/usr/bin/env bash
# progress.sh RETRACE: `retrace run` draws its progress bar only on a terminal. With stderr going
# to a file, stderr stays empty (no carriage return, no escape); under a pseudo-terminal
# (util-linux `script`, when installed) the bar is drawn with \r and erased at the end.
set -euo pipefail
retrace=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
scenarios=(builtin:grad-nan-skip builtin:grad-nan-skip-off)

"$retrace" run -j 1 "${scenarios[@]}" >"$dir/out" 2>"$dir/err" || fail "retrace run failed: $(cat "$dir/err")"
[[ ! -s $dir/err ]] || fail "stderr is not a terminal, yet something was written to it: $(od -c "$dir/err" | head)"
! grep -q $'\r' "$dir/out" || fail "a carriage return on stdout"
grep -q '2 scenarios, 2 as expected' "$dir/out" || fail "no summary"
echo "ok: silent when stderr is not a terminal"

if ! command -v script >/dev/null; then
  echo "script (util-linux) is not installed: the terminal half is not checked"
  exit 0
fi
# Under a pseudo-terminal: stdout and stderr both go to it, and `script` records what was shown.
script -q -e -c "$(printf '%q ' "$retrace" run -j 1 "${scenarios[@]}")" "$dir/typescript" </dev/null >/dev/null ||
  fail "retrace run under script failed: $(cat "$dir/typescript")"
grep -q $'\r\\[' "$dir/typescript" || fail "no bar redrawn with \\r: $(od -c "$dir/typescript" | head -20)"
grep -aq '/2 scenarios' "$dir/typescript" || fail "the bar does not count scenarios"
grep -aq $'\r\e\\[K' "$dir/typescript" || fail "the bar is never erased"
grep -aq '2 scenarios, 2 as expected' "$dir/typescript" || fail "no summary under a terminal"
echo "ok: drawn and erased under a pseudo-terminal"
