#!/usr/bin/env bash
# A data-parallel scenario (world_size 2) on a user's program that joins no rank group: each rank
# would train alone, as rank 0, and a verdict on it would rest on runs that synced nothing.
# Refused on every rank, naming the key, before any step.
#   user_program_ranks.sh ENCODER_BIN
set -euo pipefail
bin=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export RETRACE_DIST_TIMEOUT=15 OMP_NUM_THREADS=1
cat >"$work/dp.yaml" <<YAML
name: dp
program: example.encoder
world_size: 2
training: {steps: 3}
defenses: {skip_nonfinite: true}
injections: [{type: grad_nonfinite, step: 2, mode: nan, rank: 1}]
expect: {params_finite: true}
YAML
set +e
timeout 120 "$bin" record "$work/dp.yaml" -o "$work/dp.trace" >"$work/out" 2>&1
rc=$?
set -e
[[ $rc -eq 2 ]] || fail "record: exit $rc, $(cat "$work/out")"
grep -q "key 'world_size': the scenario asks for 2 ranks, but program 'example.encoder' trains as one of 1" "$work/out" ||
  fail "record: $(cat "$work/out")"
set +e
timeout 120 "$bin" run "$work/dp.yaml" -j 2 --threads 1 --json "$work/dp.json" >"$work/out" 2>&1
rc=$?
set -e
[[ $rc -eq 1 ]] || fail "run: exit $rc, $(cat "$work/out")"
grep -q '"passed": false' "$work/dp.json" && grep -q "joins no rank group" "$work/dp.json" || fail "run: $(cat "$work/out")"
# Control: the same scenario in one process (no world_size, no rank) runs and holds.
sed '/world_size/d; s/, rank: 1//' "$work/dp.yaml" >"$work/one.yaml"
timeout 120 "$bin" run "$work/one.yaml" -j 1 --threads 1 >"$work/out" 2>&1 || fail "one process: $(cat "$work/out")"
echo "ok"
