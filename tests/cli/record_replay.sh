#!/usr/bin/env bash
# End-to-end through the CLI, as a user runs it: record, replay, inspect, --export (opened by
# LibTorch's pickle loader, and by Python's torch.load(weights_only=True) where the setup's
# Python is found), a run forced to NaN, a SIGKILL mid-step with write-ahead, and SIGTERM with
# a flight ring.
#   record_replay.sh RETRACE_BIN SCENARIO_DIR PICKLE_CHECK_BIN RETRACE_CRASHABLE_BIN
set -euo pipefail
bin=$1 scenarios=$2 pickle_check=$3 crashable=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# grep ARGS... over `retrace inspect TRACE`, read from a file: a pipe into grep -q that exits at its
# first match would kill inspect with SIGPIPE mid-output, which pipefail reports as a failure.
inspect_has() {
  local trace=$1
  shift
  "$bin" inspect "$trace" >"$work/inspect.txt" || return 2
  grep "$@" "$work/inspect.txt"
}

# 1. A clean run replays bitwise, in digest and full mode.
for mode in digest full; do
  "$bin" record "$scenarios/tiny-gpt.yaml" -o "$work/$mode.trace" --mode "$mode" --steps 3 >/dev/null
  "$bin" replay "$work/$mode.trace" --from 1 --json "$work/$mode.json" >/dev/null || fail "$mode replay diverged"
  grep -q '"reproduced": true' "$work/$mode.json" || fail "$mode json lacks reproduced: true"
done
"$bin" inspect "$work/full.trace" --json >"$work/inspect.json"
grep -q '"complete": true' "$work/inspect.json" || fail "inspect --json"
inspect_has "$work/digest.trace" -q "step_begin step 1 full" || fail "inspect text"
inspect_has "$work/digest.trace" -q "step_begin step 2 state as step_end 1" || fail "inspect text"
# Full mode stores the state once between two steps: step 3's step_begin points at step_end 2.
inspect_has "$work/full.trace" -q "step_begin step 3 state as step_end 2" || fail "inspect text (full)"

set +e
"$bin" replay "$work/digest.trace" --step 99 2>"$work/err" >/dev/null
rc=$?
set -e
[[ $rc -eq 2 ]] && grep -q "holds no step 99; it has steps 1..3" "$work/err" || fail "--step 99: exit $rc, $(cat "$work/err")"
set +e
"$bin" replay "$work/digest.trace" --from 5 2>"$work/err" >/dev/null
rc=$?
set -e
[[ $rc -eq 2 ]] && grep -q "replay from step 5: the trace's last step is 3" "$work/err" || fail "--from 5: exit $rc, $(cat "$work/err")"

# Recorded under --deterministic: the fingerprint says so and replay applies the same settings.
"$bin" record "$scenarios/tiny-gpt.yaml" -o "$work/det.trace" --steps 2 --deterministic >/dev/null
inspect_has "$work/det.trace" -q "deterministic_algorithms=on" || fail "--deterministic not in the fingerprint"
"$bin" replay "$work/det.trace" >/dev/null || fail "deterministic trace did not replay"

# 2. --export writes .pt files LibTorch's pickle loader (and Python's torch.load) open.
"$bin" inspect "$work/full.trace" --export "$work/export" 2>/dev/null >/dev/null
n=$(ls "$work/export" | wc -l)
[[ $n -gt 100 ]] || fail "exported only $n tensors"
"$pickle_check" "$work/export"/*.pt || fail "pickle loader rejected an export"
py=${RETRACE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/retrace/torch-2.11.0}/bin/python
if [[ -x "$py" ]]; then
  "$py" - "$work/export" <<'PY' || fail "torch.load(weights_only=True) rejected an export"
import sys, glob, warnings
warnings.filterwarnings("ignore")
import torch
files = sorted(glob.glob(sys.argv[1] + "/*.pt"))
for f in files:
    t = torch.load(f, weights_only=True)
    assert isinstance(t, torch.Tensor), f
print(f"python: torch.load(weights_only=True) opened {len(files)} files")
PY
fi

# 3. A run forced to NaN: exit 1, ring dumped, replay names the op.
set +e
"$bin" record "$scenarios/tiny-gpt-lr-explosion.yaml" -o "$work/nan.trace" --ring 2 >"$work/nan.out"
rc=$?
set -e
[[ $rc -eq 1 ]] || fail "NaN record exited $rc, expected 1"
grep -q "flight ring dumped" "$work/nan.out" || fail "no ring dump reported"
"$bin" replay "$work/nan.trace" --json - 2>/dev/null >"$work/nan.json" || fail "NaN replay did not reproduce"
grep -q '"op": "aten::native_layer_norm"' "$work/nan.json" || fail "first non-finite op not named: $(cat "$work/nan.json")"
inspect_has "$work/nan.trace" -Eq "step_end step [0-9]+ loss (nan|inf|-inf) grad_norm" || fail "inspect does not print the non-finite loss bare"
if inspect_has "$work/nan.trace" -q -- '-nan\|"nan"'; then fail "inspect prints -nan or a quoted nan"; fi

# 4. SIGKILL during step 3 with write-ahead: the .incomplete trace replays the dying step.
set +e
RETRACE_FAULT_KILL_AT_STEP=3 "$crashable" record "$scenarios/tiny-gpt.yaml" -o "$work/crash.trace" --write-ahead >/dev/null 2>&1
rc=$?
set -e
[[ $rc -eq 137 ]] || fail "the fault point did not kill the recorder (exit $rc)"
# Control: the crash point is a test seam; the retrace binary ignores the variable.
RETRACE_FAULT_KILL_AT_STEP=3 "$bin" record "$scenarios/tiny-gpt.yaml" -o "$work/nocrash.trace" --steps 3 >/dev/null 2>&1 \
  || fail "the retrace binary has a crash point (RETRACE_FAULT_KILL_AT_STEP killed it)"
[[ -f "$work/crash.trace.incomplete" && ! -f "$work/crash.trace" ]] || fail "no .incomplete trace after SIGKILL"
# By default from the snapshot before the dying step: step 2 is compared, step 3 re-executed.
"$bin" replay "$work/crash.trace.incomplete" >"$work/crash.out" || fail "crash replay failed: $(cat "$work/crash.out")"
grep -q "step 3 has no recorded outcome" "$work/crash.out" || fail "crash step not re-executed: $(cat "$work/crash.out")"
grep -q "replayed steps 2..3: reproduced bitwise" "$work/crash.out" || fail "crash replay: $(cat "$work/crash.out")"
# The dying step alone (--from 3: its write-ahead snapshot): nothing recorded of its outcome to
# compare, so not shown to reproduce (exit 1; it had said "reproduced bitwise").
set +e
"$bin" replay "$work/crash.trace.incomplete" --from 3 >"$work/crash3.out"
rc=$?
set -e
[[ $rc -eq 1 ]] || fail "the dying step alone replayed with exit $rc, not 1: $(cat "$work/crash3.out")"
grep -q "replayed steps 3..3: NOT SHOWN (nothing recorded to compare: step 3 has no recorded outcome" "$work/crash3.out" ||
  fail "the dying step alone was not said to show nothing: $(cat "$work/crash3.out")"

# 5. SIGTERM with a flight ring: the ring is written, the process dies by the signal.
"$bin" record "$scenarios/tiny-gpt.yaml" -o "$work/term.trace" --ring 2 --steps 100000 >/dev/null 2>&1 &
pid=$!
# Wait until the recorder is well into its steps (its signal handler is installed before the
# first record; 2 MB is dozens of steps in). Bounded, and generous: a cold page cache and a loaded
# CI machine once took over 10 s to get LibTorch loaded, and a SIGTERM before the handler kills the
# process with no ring to dump.
started=0
for _ in $(seq 1200); do
  if [[ -f "$work/term.trace.incomplete" ]] && [[ $(stat -c %s "$work/term.trace.incomplete") -gt 2000000 ]]; then
    started=1
    break
  fi
  kill -0 $pid 2>/dev/null || break
  sleep 0.1
done
if [[ $started == 0 ]]; then
  kill -KILL $pid 2>/dev/null || true
  fail "SIGTERM case: the recorder did not write 2 MB within 120 s (or exited); nothing to signal"
fi
kill -TERM $pid
set +e
wait $pid
rc=$?
set -e
[[ $rc -eq 143 ]] || fail "SIGTERM: exit $rc, expected 143"
trace=$work/term.trace
[[ -f $trace ]] || trace=$work/term.trace.incomplete
inspect_has "$trace" -q "ring_dump: exception: signal SIGTERM" || fail "no ring dump after SIGTERM"
"$bin" replay "$trace" >/dev/null || fail "SIGTERM trace did not replay"

# 6. A step that raised (clipping refuses an Inf gradient norm, defenses.clip.error_if_nonfinite):
# replay raises the same at the same step, a verdict like any other -- exit 0, --json and --report
# written. (Traces whose replay raises otherwise, exit 1: ReplayCli.* in replayer_tests.)
# record says so and exits 1, a run's outcome -- not 2, bad input (it had said "retrace record:
# ... clipping refuses it" and exited 2).
set +e
"$bin" record "$scenarios/../../suite/scenarios/grad-inf-clip-error.yaml" -o "$work/raise.trace" >"$work/record.out" 2>&1
rc=$?
set -e
[[ $rc -eq 1 ]] || fail "record of a defense refusing: exit $rc, $(cat "$work/record.out")"
grep -q "record: a defense stopped the run: .*clipping refuses it" "$work/record.out" &&
  grep -q "raise.trace holds the steps up to it and the raise" "$work/record.out" || fail "$(cat "$work/record.out")"
set +e
"$bin" replay "$work/raise.trace" --json "$work/raise.json" --report "$work/raise.html" >"$work/raise.out" 2>&1
rc=$?
set -e
[[ $rc -eq 0 ]] || fail "raised step: exit $rc, $(cat "$work/raise.out")"
grep -q "step 3 raised, as the recorded run did: step 3: .*clipping refuses it" "$work/raise.out" || fail "no raise verdict: $(cat "$work/raise.out")"
grep -q '"raised": {' "$work/raise.json" && grep -q '"reproduced": true' "$work/raise.json" || fail "raise not in --json: $(cat "$work/raise.json")"
grep -q "clipping refuses it" "$work/raise.html" || fail "raise not in --report"

# 7. A run that never recovers: a weight flipped to 3.4e38 at step 3 makes every later loss NaN,
# and skip_nonfinite skips each step -- handled one by one, but nothing trains after step 3. Exit
# 1, and the replay of its last step names the op and the weight. Control: grad-nan-skip, whose
# skipped NaN gradient at step 3 is followed by finite steps, exits 0.
cat >"$work/stuck.yaml" <<'YAML'
name: stuck
model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2, vocab: 32, seq_len: 8, dropout: 0.1}
data: {batch: 4}
training: {steps: 5, optimizer: adamw, lr: 0.003, segments: 2}
defenses: {skip_nonfinite: true}
injections: [{type: bit_flip, step: 3, target: weights, bit: 30}]
YAML
set +e
"$bin" record "$work/stuck.yaml" -o "$work/stuck.trace" >"$work/stuck.out" 2>&1
rc=$?
set -e
[[ $rc -eq 1 ]] || fail "a run stuck on skipped steps: exit $rc, $(cat "$work/stuck.out")"
grep -q "the run did not recover: every step from step 3 on was non-finite and skipped" "$work/stuck.out" ||
  fail "stuck: $(cat "$work/stuck.out")"
"$bin" replay "$work/stuck.trace" >"$work/stuck-replay.out" 2>&1 || fail "stuck replay: $(cat "$work/stuck-replay.out")"
grep -q "first non-finite value at step 5: op aten::native_layer_norm in segment 'block1'.*input 1 Float\[16\] .*max 3.39978e+38" \
  "$work/stuck-replay.out" || fail "stuck replay names no op: $(cat "$work/stuck-replay.out")"
"$bin" record "$scenarios/../../suite/scenarios/grad-nan-skip.yaml" -o "$work/skip.trace" >"$work/skip.out" 2>&1 ||
  fail "a skipped step the run recovered from: $(cat "$work/skip.out")"
grep -q "non-finite, skipped" "$work/skip.out" || fail "grad-nan-skip skipped nothing: $(cat "$work/skip.out")"

echo "ok: record/replay/inspect/export/NaN/SIGKILL/SIGTERM/raised step/stuck run"
