#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time from its seed corpus (the ctest tests fuzz.*):
#
#   tests/fuzz/run_fuzzer.sh BINARY SEED_CORPUS_DIR [DICT]
#
# RETRACE_FUZZ_SECONDS (default 60) bounds the run: 3600 is the long tier. Inputs the fuzzer
# finds go to a temporary folder, never into the seed corpus in the repository. A crash, a leak, a
# sanitizer report, an input slower than 30 s or a broken invariant fails the run; the input is
# kept as BUILD/fuzz-artifacts/NAME/crash-... (or leak-, timeout-, oom-) and the output says how
# to reproduce it. The full libFuzzer log of the last run is BUILD/fuzz-artifacts/NAME/last-run.log.
set -euo pipefail
(($# >= 2)) || { echo "usage: $0 BINARY SEED_CORPUS_DIR [DICT]" >&2; exit 2; }
bin=$1 seeds=$2 dict=${3:-}
seconds=${RETRACE_FUZZ_SECONDS:-60}
[[ $seconds =~ ^[1-9][0-9]*$ ]] || { echo "RETRACE_FUZZ_SECONDS must be a whole number of seconds > 0, got '$seconds'" >&2; exit 2; }
name=$(basename "$bin")
artifacts=$(cd "$(dirname "$bin")/.." && pwd)/fuzz-artifacts/$name
mkdir -p "$artifacts"
work=$(mktemp -d "${TMPDIR:-/tmp}/$name.XXXXXX")
trap 'rm -rf "$work"' EXIT
log=$artifacts/last-run.log

# LibTorch's libraries put a fuzzer at 0.5-1 GiB resident before the first input, and ASan's
# default 256 MiB quarantine then grows the scenario fuzzer toward libFuzzer's 2 GiB RSS limit
# within the hour-long tier (1.3 GiB after 190 s). With 64 MiB it stays under 1 GiB after 1.3
# million inputs. ASAN_OPTIONS from the environment still win.
export ASAN_OPTIONS=quarantine_size_mb=64${ASAN_OPTIONS:+:$ASAN_OPTIONS}
args=(-max_total_time="$seconds" -timeout=30 -print_final_stats=1 -artifact_prefix="$artifacts/")
[[ -n $dict ]] && args+=(-dict="$dict")
echo "$name: fuzzing for ${seconds} s from $seeds (log: $log)"
rc=0
# A watchdog: libFuzzer's own OOM handler has been seen to hang after reporting (a run that never
# ends instead of failing). SIGTERM 120 s past the budget, SIGKILL 30 s after that.
timeout -k 30 $((seconds + 120)) "$bin" "${args[@]}" "$work" "$seeds" >"$log" 2>&1 || rc=$?
if ((rc == 124 || rc == 137)); then
  echo "$name: the fuzzer did not end within $((seconds + 120)) s of a ${seconds} s budget (exit $rc): hung, e.g. in its out-of-memory handler"
fi

# libFuzzer prints a line per new input; show how it started and how it ended.
grep -m1 -E '^#[0-9]+[[:space:]]+INITED' "$log" || true
grep -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)' "$log" | tail -n 1 || true
grep -E '^(Done [0-9]+ runs|stat::)' "$log" || true
if ((rc != 0)); then
  echo "---- the end of the log ----"
  tail -n 120 "$log"
  echo "----"
  for f in "$artifacts"/crash-* "$artifacts"/leak-* "$artifacts"/timeout-* "$artifacts"/oom-*; do
    [[ -e $f && $f -nt $work ]] && echo "$name: FAILED on input $f; reproduce: $bin $f"
  done
  echo "$name: FAILED (libFuzzer exit code $rc)"
  exit 1
fi
echo "$name: ok, no crash, leak or sanitizer report in ${seconds} s"
