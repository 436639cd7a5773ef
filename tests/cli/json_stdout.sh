#!/usr/bin/env bash
# json_stdout.sh RETRACE: with --json -, stdout is one JSON document and nothing else (progress
# and the matrix go to stderr), for `run` and `diagnose` alike.
set -euo pipefail
retrace=$1
py=$(command -v python3)
"$retrace" run builtin:grad-nan-skip --json - 2>/dev/null |
  "$py" -c 'import json,sys; d=json.load(sys.stdin); assert d["failed"] == 0 and d["scenarios"][0]["name"] == "grad-nan-skip", d'
"$retrace" diagnose builtin:grad-nan-skip-off --json - 2>/dev/null |
  "$py" -c 'import json,sys; d=json.load(sys.stdin); assert d["failing_step"] == 3 and "skip non-finite" in d["fixing_variants"], d'
echo "ok: stdout carries only the JSON"
