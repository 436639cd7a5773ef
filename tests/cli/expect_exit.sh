#!/usr/bin/env bash
# expect_exit.sh CODE REGEX -- COMMAND...
# Runs COMMAND; passes when it exits with CODE and its stderr is one line matching REGEX
# (bad input gets one clear line, never a stack trace).
set -u
code=$1 regex=$2
shift 3
err=$(mktemp)
"$@" >/dev/null 2>"$err"
got=$?
lines=$(wc -l <"$err")
msg=$(cat "$err")
rm -f "$err"
if [[ $got -ne $code ]]; then echo "exit code $got, expected $code; stderr: $msg"; exit 1; fi
if [[ $code -ne 0 ]]; then
  if [[ $lines -ne 1 ]]; then echo "expected one line on stderr, got $lines: $msg"; exit 1; fi
  if ! grep -Eq -- "$regex" <<<"$msg"; then echo "stderr '$msg' does not match '$regex'"; exit 1; fi
fi
echo "ok: exit $got; $msg"
