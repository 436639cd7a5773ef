#!/usr/bin/env bash
# Data-parallel runs through the CLI (2 ranks, Gloo over loopback, a file store), as a user runs
# them. Every wait is bounded: RETRACE_DIST_TIMEOUT for the ranks, `timeout` for each command.
#   ranks.sh CASE RETRACE_BIN RETRACE_CRASHABLE_BIN SCENARIO_DIR
# CASE: replay_alone | culprit | sigkill | stopped | config_mismatch | counterfactual | merge
set -euo pipefail
case_name=$1 bin=$2 crashable=$3 scenarios=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export RETRACE_DIST_TIMEOUT=15
scenario() {  # scenario NAME [EXTRA_YAML_LINES]
  cat >"$work/$1.yaml" <<YAML
name: $1
world_size: 2
model: {type: tiny_gpt, layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1}
data: {batch: 4, seed: 1}
training: {steps: 4, optimizer: adamw, lr: 0.003, segments: 2}
$2
YAML
}

case $case_name in
replay_alone)
  # Each rank of a clean run replays alone, from step 1, bitwise; the ranks end with the same
  # parameters (the last step_end's state digests agree).
  scenario clean ""
  timeout 120 "$bin" record "$work/clean.yaml" -o "$work/clean.trace" --mode full >"$work/out" 2>&1 ||
    fail "record: $(cat "$work/out")"
  for r in 0 1; do
    [[ -f "$work/clean.rank$r.trace" ]] || fail "no trace of rank $r"
    timeout 120 "$bin" replay "$work/clean.rank$r.trace" --from 1 >"$work/replay$r" 2>&1 ||
      fail "rank $r did not replay alone: $(cat "$work/replay$r")"
    grep -q "replayed steps 1..4: reproduced bitwise" "$work/replay$r" || fail "rank $r: $(cat "$work/replay$r")"
    "$bin" inspect "$work/clean.rank$r.trace" --tensors | awk '/step_end step 4/{on=1; next} /^#/{on=0} on && /state\.param/' \
      >"$work/params$r"
  done
  [[ -s "$work/params0" ]] || fail "no parameter digests in step 4's step_end"
  cmp -s "$work/params0" "$work/params1" || fail "the ranks' final parameters differ"
  # Control: a rank's trace in digest mode holds no collective results to serve: a clear refusal.
  timeout 120 "$bin" record "$work/clean.yaml" -o "$work/digest.trace" >/dev/null 2>&1 || fail "digest record"
  set +e
  timeout 120 "$bin" replay "$work/digest.rank1.trace" --from 1 >"$work/err" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 2 ]] && grep -q "holds only the digest of its result" "$work/err" || fail "digest replay: exit $rc, $(cat "$work/err")"
  # Both ranks' traces together: no culprit, and each replays alone.
  timeout 120 "$bin" replay "$work/clean.rank0.trace" "$work/clean.rank1.trace" >"$work/both" 2>&1 ||
    fail "replay of both ranks: $(cat "$work/both")"
  grep -q "no rank went bad" "$work/both" && [[ $(grep -c "reproduced bitwise" "$work/both") -eq 2 ]] ||
    fail "$(cat "$work/both")"
  # diagnose re-runs one process: a rank's trace is refused, one line, exit 2 (its variants had each
  # "raised" the world_size refusal, and the step was called persistent).
  set +e
  timeout 120 "$bin" diagnose "$work/clean.rank1.trace" >"$work/diag" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 2 ]] && grep -q "this is rank 1's trace of a data-parallel run of 2 ranks, and diagnose re-runs" "$work/diag" ||
    fail "diagnose of a rank trace: exit $rc, $(cat "$work/diag")"
  ;;
culprit)
  # Rank 1's gradient goes NaN at step 3: inspect names rank 1, step 3, the all-reduce; replay of
  # the rank traces replays rank 1 to its first non-finite op.
  scenario nan "injections: [{type: grad_nonfinite, step: 3, mode: nan, rank: 1}]"
  set +e
  timeout 120 "$bin" record "$work/nan.yaml" -o "$work/nan.trace" --ring 4 >"$work/out" 2>&1
  set -e
  timeout 60 "$bin" inspect "$work/nan.rank0.trace" "$work/nan.rank1.trace" >"$work/inspect" || fail "inspect"
  grep -q "culprit: step 3 collective #0 allreduce(sum): rank 1's contribution went non-finite" "$work/inspect" ||
    fail "attribution: $(cat "$work/inspect") / $(cat "$work/out")"
  timeout 120 "$bin" replay "$work/nan.rank1.trace" "$work/nan.rank0.trace" >"$work/replay" 2>&1 || fail "replay: $(cat "$work/replay")"
  grep -q "rank 1 alone: replayed steps 3..3: reproduced bitwise" "$work/replay" &&
    grep -q "first non-finite value at step 3" "$work/replay" || fail "culprit replay: $(cat "$work/replay")"
  # Rank 0 alone, the victim: its first non-finite op is where it computed with rank 1's NaN, and
  # the replay says the NaN came in through the all-reduce (it had named rank 0's own op alone).
  # Control: rank 1's replay, whose own contribution went non-finite, does not say so.
  timeout 120 "$bin" replay "$work/nan.rank0.trace" >"$work/victim" 2>&1
  grep -q "step 3 collective #0 allreduce(sum) handed rank 0 [0-9]* non-finite value(s) though its own contribution was finite: they came from another rank" "$work/victim" ||
    fail "victim replay: $(cat "$work/victim")"
  if grep -q "though its own contribution was finite" "$work/replay"; then fail "culprit said to be a victim: $(cat "$work/replay")"; fi
  # Control: the same on rank 0 names rank 0.
  scenario nan0 "injections: [{type: grad_nonfinite, step: 2, mode: nan, rank: 0}]"
  set +e
  timeout 120 "$bin" record "$work/nan0.yaml" -o "$work/nan0.trace" >/dev/null 2>&1
  set -e
  timeout 60 "$bin" inspect "$work/nan0.rank0.trace" "$work/nan0.rank1.trace" >"$work/nan0.inspect" || true
  grep -q "step 2 collective #0 allreduce(sum): rank 0's" "$work/nan0.inspect" ||
    fail "control: rank 0 not named"
  # An exponent bit flip of one element of rank 1's gradients (finite, but ~2^100 too large): named
  # as a magnitude outlier at that step's all-reduce.
  scenario flip "injections: [{type: bit_flip, target: gradients, bit: 30, step: 2, rank: 1}]"
  set +e
  timeout 120 "$bin" record "$work/flip.yaml" -o "$work/flip.trace" --ring 4 >"$work/out" 2>&1
  set -e
  timeout 60 "$bin" inspect "$work/flip.rank0.trace" "$work/flip.rank1.trace" >"$work/inspect" || fail "inspect flip"
  grep -q "culprit: step 2 collective #0 allreduce(sum): rank 1's contribution is an outlier in magnitude" "$work/inspect" ||
    fail "bit flip attribution: $(cat "$work/inspect") / $(cat "$work/out")"
  # A run whose only fault on rank 1 never acted (its LR spike was due on the step every rank
  # skipped) is "not exercised", not held: rank 1's failed check is the merged run's too.
  scenario idle "defenses: {skip_nonfinite_ranks: true}
injections: [{type: grad_nonfinite, step: 3, mode: nan, rank: 1}, {type: lr_spike, step: 3, factor: 1.0e6, rank: 1}]
expect: {params_finite: true}"
  set +e
  timeout 120 "$bin" run "$work/idle.yaml" -j 1 --threads 1 --json "$work/idle.json" >"$work/out" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 1 ]] || fail "idle run: exit $rc, $(cat "$work/out")"
  grep -q '"outcome": "not exercised"' "$work/idle.json" || fail "idle outcome: $(cat "$work/out")"
  grep -q '"observed": "rank 1: did not fire; every step it was due on was skipped' "$work/idle.json" ||
    fail "rank 1's check: $(cat "$work/idle.json")"
  # Control: the spike on a step no rank skips fires, and the run breaks.
  sed 's/lr_spike, step: 3/lr_spike, step: 4/' "$work/idle.yaml" >"$work/spike.yaml"
  set +e
  timeout 120 "$bin" run "$work/spike.yaml" -j 1 --threads 1 --json "$work/spike.json" >"$work/out" 2>&1
  set -e
  grep -q '"outcome": "broke"' "$work/spike.json" || fail "spike control: $(cat "$work/out")"
  # Traces of different runs are refused.
  set +e
  timeout 60 "$bin" inspect "$work/nan.rank0.trace" "$work/nan0.rank1.trace" >/dev/null 2>"$work/err"
  rc=$?
  set -e
  [[ $rc -eq 2 ]] && grep -q "of another run" "$work/err" || fail "mixed runs: exit $rc, $(cat "$work/err")"
  ;;
sigkill)
  # Rank 1 is killed (SIGKILL) at the start of step 3; rank 0 times out in that step's all-reduce
  # and says so. Rank 0's trace reads and replays up to step 2; inspect names rank 1.
  scenario kill ""
  set +e
  RETRACE_DIST_TIMEOUT=5 RETRACE_FAULT_KILL_AT_STEP=3 RETRACE_FAULT_KILL_RANK=1 \
    timeout 120 "$crashable" record "$work/kill.yaml" -o "$work/kill.trace" --write-ahead >"$work/out" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 1 ]] || fail "record with a killed rank: exit $rc, $(cat "$work/out")"
  grep -q "rank 1 died by signal 9" "$work/out" || fail "the launcher did not name the killed rank: $(cat "$work/out")"
  [[ -f "$work/kill.rank0.trace" ]] || fail "rank 0's trace was not closed"
  timeout 120 "$bin" replay "$work/kill.rank0.trace" --from 1 >"$work/replay" 2>&1 || fail "survivor replay: $(cat "$work/replay")"
  grep -q "replayed steps 1..2 of 1..3: reproduced bitwise" "$work/replay" &&
    grep -q "the replay ended before step 3: the recorded run stopped in step 3; step 3 was not replayed" \
      "$work/replay" || fail "survivor: $(cat "$work/replay")"
  timeout 120 "$bin" replay "$work/kill.rank1.trace.incomplete" --from 1 >"$work/replay1" 2>&1 || fail "killed rank replay: $(cat "$work/replay1")"
  grep -q "reproduced bitwise" "$work/replay1" || fail "killed rank: $(cat "$work/replay1")"
  timeout 60 "$bin" inspect "$work/kill.rank0.trace" "$work/kill.rank1.trace.incomplete" >"$work/inspect"
  grep -q "culprit: step 3: rank 1 stopped recording" "$work/inspect" || fail "attribution: $(cat "$work/inspect")"
  ;;
stopped)
  # Rank 1 is stopped (SIGSTOP) mid-run; rank 0 times out in a collective and ends. The launcher
  # kills rank 1 once rank 0 has been gone RETRACE_DIST_TIMEOUT and 10 s more, and says so (it had
  # waited for good).
  scenario long ""
  sed -i 's/steps: 4,/steps: 100000,/' "$work/long.yaml"
  RETRACE_DIST_TIMEOUT=5 timeout 120 "$bin" record "$work/long.yaml" -o "$work/long.trace" >"$work/out" 2>&1 &
  launcher=$!  # the timeout process
  rank1=""
  for _ in $(seq 1 600); do  # up to 60 s for the ranks to start
    retrace_pid=$(pgrep -P "$launcher" | head -1 || true)  # timeout's child: the launcher
    for p in $(pgrep -P "${retrace_pid:-0}" || true); do
      if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=1"; then rank1=$p; fi
    done
    [[ -n $rank1 && -f "$work/long.rank1.trace.incomplete" ]] && break
    sleep 0.1
  done
  [[ -n $rank1 ]] || fail "rank 1 never started: $(cat "$work/out")"
  sleep 1
  kill -STOP "$rank1"
  set +e
  wait "$launcher"
  rc=$?
  set -e
  [[ $rc -ne 124 ]] || fail "the launcher waited for the stopped rank until timeout killed it: $(cat "$work/out")"
  [[ $rc -eq 1 ]] || fail "record with a stopped rank: exit $rc, $(cat "$work/out")"
  grep -q "retrace: rank 1 was still running 15 s after another rank ended (RETRACE_DIST_TIMEOUT 5 s, and 10 s more); killed" \
    "$work/out" || fail "the launcher did not say it killed rank 1: $(cat "$work/out")"
  ;;
config_mismatch)
  # Two ranks launched by hand (torchrun's variables) with different configs: both refuse at the
  # rendezvous, naming the line, within the timeout -- no hang in the first all-reduce.
  scenario a ""
  sed 's/lr: 0.003/lr: 0.004/' "$work/a.yaml" >"$work/b.yaml"
  common=(WORLD_SIZE=2 RETRACE_STORE="$work/store" RETRACE_DIST_TIMEOUT=10 OMP_NUM_THREADS=1)
  set +e
  env "${common[@]}" RANK=0 timeout 60 "$bin" record "$work/a.yaml" -o "$work/a.trace" >"$work/out0" 2>&1 &
  p0=$!
  env "${common[@]}" RANK=1 timeout 60 "$bin" record "$work/b.yaml" -o "$work/b.trace" >"$work/out1" 2>&1 &
  p1=$!
  wait $p0; rc0=$?
  wait $p1; rc1=$?
  set -e
  for r in 0 1; do
    rc=$([[ $r -eq 0 ]] && echo $rc0 || echo $rc1)
    [[ $rc -eq 2 ]] || fail "rank $r: exit $rc, $(cat "$work/out$r")"
    grep -q "runs another config (line .*lr: 0.00" "$work/out$r" || fail "rank $r: $(cat "$work/out$r")"
  done
  # --ranks against the scenario's world_size: one line, exit 2, before any rank starts.
  set +e
  timeout 60 "$bin" record "$work/a.yaml" -o "$work/x.trace" --ranks 3 >"$work/out" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 2 ]] && grep -q "ranks 3 but the scenario's world_size is 2" "$work/out" || fail "--ranks 3: exit $rc, $(cat "$work/out")"
  # A rank that never comes: the other gives up within RETRACE_DIST_TIMEOUT, naming it.
  set +e
  env WORLD_SIZE=2 RANK=0 RETRACE_STORE="$work/store2" RETRACE_DIST_TIMEOUT=3 OMP_NUM_THREADS=1 \
    timeout 60 "$bin" record "$work/a.yaml" -o "$work/c.trace" >"$work/out" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 2 ]] && grep -q "rank 1 did not join within 3 s" "$work/out" || fail "absent rank: exit $rc, $(cat "$work/out")"
  # Control: the same configs by hand rendezvous and train.
  set +e
  env "${common[@]}" RETRACE_STORE="$work/store3" RANK=0 timeout 60 "$bin" record "$work/a.yaml" -o "$work/ok.trace" >"$work/ok0" 2>&1 &
  p0=$!
  env "${common[@]}" RETRACE_STORE="$work/store3" RANK=1 timeout 60 "$bin" record "$work/a.yaml" -o "$work/ok.trace" >"$work/ok1" 2>&1 &
  p1=$!
  wait $p0; rc0=$?
  wait $p1; rc1=$?
  set -e
  [[ $rc0 -eq 0 && $rc1 -eq 0 ]] || fail "same configs by hand: $rc0 $rc1 $(cat "$work/ok0" "$work/ok1")"
  [[ -f "$work/ok.rank0.trace" && -f "$work/ok.rank1.trace" ]] || fail "rank traces by hand"
  # torchrun's TCP rendezvous (MASTER_ADDR, MASTER_PORT; rank 0 serves the store) trains the same
  # bits as the file store: the last step's parameter digests agree. A port taken by someone else
  # is retried on another.
  tcp_ok=0
  for attempt in 1 2 3; do
    port=$((20000 + RANDOM % 30000))
    tcp=(WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RETRACE_DIST_TIMEOUT=10 OMP_NUM_THREADS=1)
    set +e
    env "${tcp[@]}" RANK=0 timeout 60 "$bin" record "$work/a.yaml" -o "$work/tcp.trace" >"$work/tcp0" 2>&1 &
    p0=$!
    env "${tcp[@]}" RANK=1 timeout 60 "$bin" record "$work/a.yaml" -o "$work/tcp.trace" >"$work/tcp1" 2>&1 &
    p1=$!
    wait $p0; rc0=$?
    wait $p1; rc1=$?
    set -e
    if [[ $rc0 -eq 0 && $rc1 -eq 0 ]]; then tcp_ok=1; break; fi
  done
  [[ $tcp_ok -eq 1 ]] || fail "TCP rendezvous: $(cat "$work/tcp0" "$work/tcp1")"
  for t in ok tcp; do
    "$bin" inspect "$work/$t.rank1.trace" --tensors | awk '/step_end step 4/{on=1; next} /^#/{on=0} on && /state\.param/' >"$work/$t.params"
  done
  [[ -s "$work/ok.params" ]] && cmp -s "$work/ok.params" "$work/tcp.params" || fail "TCP and file-store runs differ"
  ;;
counterfactual)
  # A verdict on a data-parallel run is weighed against the same run without the fault or the
  # defenses, its ranks launched again (docs/scenarios.md, "Did the fault do it?").
  outcome() {  # outcome NAME: run it; prints the outcome, the counterfactual's kind and its check
    timeout 200 "$bin" run "$work/$1.yaml" -j 1 --threads 1 --json "$work/$1.json" >"$work/$1.out" 2>&1 || true
    python3 - "$work/$1.json" <<'PY' || fail "$1: no result: $(cat "$work/$1.out")"
import json, sys
r = json.load(open(sys.argv[1]))["scenarios"][0]
cf = [c for c in r["checks"] if c["name"] in ("fault_bites", "fault_caused")]
print(r["outcome"], r["counterfactual"]["kind"], *(f'{c["name"]}={c["passed"]}' for c in cf))
PY
  }
  # A harmless flip (the lowest mantissa bit of one gradient element on rank 1) and a defense that
  # never acts: the undefended ranks hold too, so the scenario held nothing.
  scenario harmless "defenses: {skip_nonfinite_ranks: true}
injections: [{type: bit_flip, target: gradients, bit: 0, step: 2, rank: 1}]
expect: {params_finite: true}"
  got=$(outcome harmless)
  [[ $got == "not exercised undefended fault_bites=False" ]] || fail "harmless: $got, $(cat "$work/harmless.out")"
  # Control: rank 1's NaN gradient, which breaks the undefended ranks: held, earned.
  scenario nan "defenses: {skip_nonfinite_ranks: true}
injections: [{type: grad_nonfinite, step: 2, mode: nan, rank: 1}]
expect: {params_finite: true}"
  got=$(outcome nan)
  [[ $got == "held undefended fault_bites=True" ]] || fail "nan: $got, $(cat "$work/nan.out")"
  # trained measures from the step after rank 1's fault on every rank: the ranks share their
  # parameters (was rank 0: from step 1, the fault being another rank's).
  python3 - "$work/nan.json" <<'PY' || fail "nan: trained not measured after rank 1's fault: $(cat "$work/nan.json")"
import json, sys
r = json.load(open(sys.argv[1]))["scenarios"][0]
sys.exit(0 if (r["fault_last_step"], r["param_movement_from"]) == (2, 3) else 1)
PY
  # A negative control whose configuration breaks it anyway (SGD at lr 1e12): the fault-free ranks
  # break as early, so the flip did not.
  scenario config "injections: [{type: bit_flip, target: gradients, bit: 0, step: 2, rank: 1}]
expect: {params_finite: true, diverges: true}"
  sed -i 's/optimizer: adamw, lr: 0.003/optimizer: sgd, lr: 1.0e12/' "$work/config.yaml"
  got=$(outcome config)
  [[ $got == "broke without the fault fault_free fault_caused=False" ]] || fail "config: $got, $(cat "$work/config.out")"
  grep -q "fault_caused: expected the run without its injections does not break so within the run, got it broke too: parameters non-finite from step 2 on" \
    "$work/config.out" || fail "config: $(cat "$work/config.out")"
  # Control: the NaN without its defense breaks what the fault-free ranks do not.
  scenario nanoff "injections: [{type: grad_nonfinite, step: 2, mode: nan, rank: 1}]
expect: {params_finite: true, diverges: true}"
  got=$(outcome nanoff)
  [[ $got == "broke fault_free fault_caused=True" ]] || fail "nanoff: $got, $(cat "$work/nanoff.out")"
  # A control whose fault breaks rank 1 alone (an exponent flip of one of its weights at the last
  # step): rank 0 alone held, the combined run broke -- rank 1's breakage is the run's evidence,
  # and the fault-free ranks do not show it.
  scenario alone "injections: [{type: bit_flip, target: weights, bit: 30, step: 4, rank: 1}]
expect: {params_finite: true, diverges: true}"
  got=$(outcome alone)
  [[ $got == "broke fault_free fault_caused=True" ]] || fail "alone: $got, $(cat "$work/alone.out")"
  grep -q "ok (broke: rank 1: parameters non-finite from step 4 on)" "$work/alone.out" || fail "alone: $(cat "$work/alone.out")"
  # The combined result says what fired on rank 1: its tally, its note, the step's mark.
  python3 - "$work/alone.json" <<'PY' || fail "alone: rank 1's injection is missing from the combined result"
import json, sys
r = json.load(open(sys.argv[1]))["scenarios"][0]
assert r["injections"][0]["fired"] == [4], r["injections"]
assert any(n["kind"] == "injected" and n["step"] == 4 and n["text"].startswith("rank 1: bit_flip") for n in r["notes"]), r["notes"]
assert [s["step"] for s in r["steps"] if s["injected"]] == [4], r["steps"]
PY
  ;;
merge)
  # The combined verdict speaks of every rank (red-team findings).
  outcome() {  # outcome NAME: run it; prints the outcome and the verdict's line
    timeout 200 "$bin" run "$work/$1.yaml" -j 1 --threads 1 --json "$work/$1.json" >"$work/$1.out" 2>&1 || true
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))["scenarios"][0]; print(r["outcome"], r["passed"])' \
      "$work/$1.json" || fail "$1: no result: $(cat "$work/$1.out")"
  }
  # An LR spike on rank 1 splits the ranks' parameters; a clip refusing an Inf gradient on every rank
  # at the last step then stops the run as the scenario expects. The ranks raised together, each
  # before that step's update: their state is compared still (it had been skipped: "held, ok").
  raising="defenses: {clip: {mode: global, max_norm: 1.0, error_if_nonfinite: true}}
expect: {raises: true, raises_match: 'clipping refuses it'}"
  scenario splitraise "$raising
injections: [{type: lr_spike, step: 2, rank: 1, factor: 100}, {type: grad_nonfinite, step: 4, mode: inf}]"
  got=$(outcome splitraise)
  [[ $got == "broke False" ]] || fail "splitraise: $got, $(cat "$work/splitraise.out")"
  grep -q "the ranks' state split: rank 1's differs from rank 0's" "$work/splitraise.out" || fail "$(cat "$work/splitraise.out")"
  # Control: the raise alone leaves the ranks equal, and the run held by raising.
  scenario raiseonly "$raising
injections: [{type: grad_nonfinite, step: 4, mode: inf}]"
  got=$(outcome raiseonly)
  [[ $got == "held True" ]] || fail "raiseonly: $got, $(cat "$work/raiseonly.out")"
  # A control crashing rank 1 (a token out of range): rank 1's raise is the run's, not the peer
  # closure rank 0 raised after it (it had been "held: the fault did not bite").
  scenario crash "injections: [{type: corrupt_batch, step: 2, rank: 1}]
expect: {params_finite: true, raises: true, raises_match: 'index out of range', diverges: true}"
  got=$(RETRACE_DIST_TIMEOUT=10 outcome crash)
  [[ $got == "broke True" ]] || fail "crash: $got, $(cat "$work/crash.out")"
  grep -q "ok (broke: rank 1: step 2 raised: index out of range in self)" "$work/crash.out" || fail "$(cat "$work/crash.out")"
  # Control: a raises_match no rank raised fails.
  sed -i "s/raises_match: 'index out of range'/raises_match: 'no rank raises this'/" "$work/crash.yaml"
  got=$(RETRACE_DIST_TIMEOUT=10 outcome crash)
  [[ $got == *" False" ]] || fail "crash (no match): $got, $(cat "$work/crash.out")"
  # injections_fired counts every rank's injections: rank 1's NaN fired (rank 0's count alone had
  # said "0 fired", the run "not exercised").
  scenario fired "defenses: {skip_nonfinite_ranks: true}
injections: [{type: grad_nonfinite, step: 2, mode: nan, rank: 1}]
expect: {params_finite: true, injections_fired: true}"
  got=$(outcome fired)
  [[ $got == "held True" ]] || fail "fired: $got, $(cat "$work/fired.out")"
  python3 - "$work/fired.json" <<'PY' || fail "fired: $(cat "$work/fired.json")"
import json, sys
r = json.load(open(sys.argv[1]))["scenarios"][0]
assert [(c["observed"], c["passed"]) for c in r["checks"] if c["name"] == "injections_fired"] == [("1 fired (every rank's)", True)]
PY
  # record: rank 0 does not call rank 1's injection "never fired" (it had, and exited 1).
  timeout 120 "$bin" record "$work/fired.yaml" -o "$work/fired.trace" >"$work/record.out" 2>&1 ||
    fail "record of a rank 1 injection: $(cat "$work/record.out")"
  ! grep -q "never fired" "$work/record.out" || fail "$(cat "$work/record.out")"
  # Control: expecting none to fire fails on the same count.
  sed -i 's/injections_fired: true/injections_fired: false/' "$work/fired.yaml"
  got=$(outcome fired)
  [[ $got == "not exercised False" ]] || fail "fired (false): $got, $(cat "$work/fired.out")"
  ;;
*) fail "unknown case $case_name" ;;
esac
echo "ok: $case_name"
