#!/usr/bin/env bash
# run_isolation.sh RETRACE_CRASHABLE: one scenario's process dying by SIGKILL must not take down the
# suite: the others still run and report, the dead one is reported with its signal, a negative
# control that dies fails too (a dead process tells nothing of whether the fault bit), and the
# exit code is 1. RETRACE_CRASHABLE is the CLI with the recorder's crash point armed from
# RETRACE_FAULT_KILL_AT_STEP (tests/cli/crashable_main.cpp).
set -euo pipefail
retrace=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
model='model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8}'
printf 'name: survives\n%s\ntraining: {steps: 3, segments: 1}\nexpect: {params_finite: true}\n' "$model" >"$dir/a.yaml"
# replay_bitwise records the run, and the recorder's fault point kills the process at step 2.
printf 'name: killed\n%s\ntraining: {steps: 3, segments: 1}\nexpect: {replay_bitwise: true}\n' "$model" >"$dir/b.yaml"
printf 'name: killed-negative-control\n%s\ntraining: {steps: 3, segments: 1}\nexpect: {replay_bitwise: true, diverges: true}\n' "$model" >"$dir/c.yaml"
mkdir "$dir/tmp"
set +e
out=$(TMPDIR="$dir/tmp" RETRACE_FAULT_KILL_AT_STEP=2 "$retrace" run -j 2 --junit "$dir/junit.xml" --json "$dir/results.json" "$dir" 2>&1)
code=$?
set -e
echo "$out"
[[ $code -eq 1 ]] || { echo "exit code $code, expected 1"; exit 1; }
grep -q '^ok     survives' <<<"$out" || { echo "the surviving scenario did not report ok"; exit 1; }
grep -q '^FAILED killed ' <<<"$out" || { echo "the killed scenario was not reported as failed"; exit 1; }
grep -q 'died by signal 9' <<<"$out" || { echo "the signal was not reported"; exit 1; }
grep -q '^FAILED killed-negative-control' <<<"$out" || { echo "a dying negative control must not pass"; exit 1; }
grep -q '3 scenarios, 1 as expected, 2 not' <<<"$out" || { echo "wrong summary"; exit 1; }
grep -q '<testsuite name="retrace.scenarios" tests="3" failures="2"' "$dir/junit.xml" || { echo "bad junit"; cat "$dir/junit.xml"; exit 1; }
grep -q '"failed": 2' "$dir/results.json" || { echo "bad json"; exit 1; }
[[ -z "$(ls -A "$dir/tmp")" ]] || { echo "files were left behind:"; ls -la "$dir/tmp"; exit 1; }
echo "ok: a crashed scenario was isolated"
