#!/usr/bin/env bash
# crash_kills.sh RETRACE SCENARIO [KILLS] [SEED]
# Crash consistency: `retrace record --write-ahead` is killed with SIGKILL at seeded random
# moments. After each kill the trace left behind (PATH.incomplete) must read -- every completely
# written record recovered, a cut tail reported as a clean end -- or fail with one typed line
# (exit 2) when the kill came before the file header; replay of the recovered steps must then
# reproduce them bitwise (exit 0; 2 when no step is complete). The long tier: KILLS=200.
set -uo pipefail
retrace=$1 scenario=$2 kills=${3:-10} seed=${4:-1}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
RANDOM=$seed
recovered=0 early=0
for ((i = 1; i <= kills; i++)); do
  t="$dir/k$i.trace"
  "$retrace" record "$scenario" -o "$t" --steps 400 --write-ahead >/dev/null 2>&1 &
  pid=$!
  # 0.2 .. 2.2 s: from before the first record to well into the run.
  delay=$(printf '0.%03d' $((RANDOM % 1000)))
  sleep "$delay"; sleep $((RANDOM % 2))
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  [[ -e "$t" ]] && { echo "kill $i: a finished trace exists after SIGKILL"; exit 1; }
  if [[ ! -e "$t.incomplete" ]]; then early=$((early + 1)); continue; fi
  err=$("$retrace" inspect "$t.incomplete" 2>&1 >"$dir/inspect.txt"); code=$?
  if [[ $code -ge 128 ]]; then echo "kill $i: inspect crashed (exit $code)"; exit 1; fi
  if [[ $code -eq 2 ]]; then
    [[ $(printf '%s' "$err" | grep -c '') -eq 1 ]] || { echo "kill $i: more than one line: $err"; exit 1; }
    early=$((early + 1))
  elif [[ $code -eq 0 ]]; then
    recovered=$((recovered + 1))
    "$retrace" replay "$t.incomplete" --no-provenance >/dev/null 2>&1; rc=$?
    if [[ $rc -ge 3 ]]; then echo "kill $i: replay of the recovered trace crashed (exit $rc)"; exit 1; fi
    if [[ $rc -eq 1 ]]; then echo "kill $i: the recovered steps did not replay bitwise"; exit 1; fi
    [[ -n ${VERBOSE:-} ]] && echo "kill $i after ${delay}s: replay exit $rc"
  else
    echo "kill $i: inspect exit $code: $err"; exit 1
  fi
  rm -f "$t.incomplete"
done
echo "$kills kills: $recovered traces recovered and replayed without a crash, $early killed before a readable header"
[[ $recovered -gt 0 ]]
