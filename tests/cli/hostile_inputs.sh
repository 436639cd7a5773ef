#!/usr/bin/env bash
# hostile_inputs.sh RETRACE DATA_DIR [TABLE.md]
# Feeds retrace bad input -- arguments, scenario files, traces -- and checks that each gets the
# exit code it should and exactly one line on stderr (never a stack trace, never a crash).
# With TABLE.md, writes the results as the Markdown table in docs/hostile-inputs.md.
set -uo pipefail
retrace=$1 data=$2 table=${3:-}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
m='model: {type: tiny_gpt, layers: 2, d_model: 16, heads: 2}'
w() { printf '%b' "$2" >"$dir/$1"; }   # w FILE CONTENT
w empty.yaml ''
w notyaml.yaml 'model: [unclosed\n'
w unknown.yaml "$m\ntraining: {stpes: 3}\n"
w nan.yaml "$m\ntraining: {lr: .nan}\n"
w inf.yaml "$m\ntraining: {lr: .inf}\n"
w wordint.yaml "model: {type: tiny_gpt, layers: four}\n"
w hugeint.yaml "$m\ntraining: {steps: 99999999999999999999}\n"
w negbatch.yaml "$m\ndata: {batch: -4}\n"
w segs.yaml "$m\ntraining: {segments: 3}\n"
w selseg.yaml "$m\ntraining: {segments: 1, recompute: selective}\n"
w heads.yaml "model: {type: tiny_gpt, layers: 2, d_model: 10, heads: 3}\n"
w notype.yaml "model: {layers: 2}\n"
w nomodel.yaml "training: {steps: 2}\n"
w badtype.yaml "$m\ntraining: {segments: 1}\ninjections: [{type: meteor_strike}]\n"
w unusedkey.yaml "$m\ntraining: {segments: 1}\ninjections: [{type: loss_spike, bits: 3}]\n"
w badseg.yaml "$m\ntraining: {segments: 1}\ninjections: [{type: activation_overflow, segment: block9}]\n"
w noseg.yaml "$m\ninjections: [{type: activation_overflow}]\n"
w mapkey.yaml "$m\ndata: {[a, b]: 1}\n"
w growth.yaml "$m\ndefenses: {loss_scaling: {growth_factor: 1}}\n"
w factor0.yaml "$m\ntraining: {segments: 1}\ninjections: [{type: lr_spike, factor: 0}]\n"
w match.yaml "$m\nexpect: {raises_match: boom}\n"
w prob.yaml "$m\ntraining: {segments: 1}\ninjections: [{type: loss_spike, probability: 1.5}]\n"
w device.yaml "$m\ntraining: {device: tpu}\n"
w list.yaml "- just\n- a list\n"
w dupkey.yaml "$m\ntraining: {steps: 3}\ntraining: {steps: 4}\n"
w twodocs.yaml "$m\n---\ninjections: [{type: loss_spike}]\n"
w late.yaml "$m\ntraining: {steps: 4}\ninjections: [{type: loss_spike, step: 9}]\n"
w bits.yaml "$m\ninjections: [{type: bit_flip, bit_class: exponent, bits: 12}]\n"
w lstm16.yaml "model: {type: lstm}\ntraining: {precision: fp16}\n"
w prog.yaml "name: p\nprogram: no.such\n"
w yesbool.yaml "$m\nexpect: {diverges: yes}\n"
w quotednum.yaml "$m\ntraining: {lr: \"0.1\"}\n"
w falsefinite.yaml "$m\nexpect: {params_finite: false}\n"
w adammomentum.yaml "$m\ntraining: {optimizer: adamw, momentum: 0.9}\n"
w clipoff.yaml "$m\ndefenses: {clip: {mode: off, error_if_nonfinite: true}}\n"
w lstmln.yaml "model: {type: lstm}\ndefenses: {layernorm_fp32: true}\n"
w progmodel.yaml "name: p\nprogram: x\n$m\n"
w progtrain.yaml "name: p\nprogram: x\ntraining: {steps: 3, lr: 0.1}\n"
w progcfg.yaml "name: p\nprogram: x\nconfig: [1, 2]\n"
w cfgonly.yaml "$m\nconfig: {lr: 1}\n"
w ctrlname.yaml "name: \"bell\\\\a\"\n$m\n"
w clipmode.yaml "$m\ndefenses: {clip: {mode: adaptiv}}\n"
deep="model:\n"; for i in $(seq 1 600); do deep+="$(printf '%*s' $((2 * i)) '')a:\n"; done
w deep.yaml "$deep"
w zero.trace ''
head -c 10 "$data/golden-v1.trace" >"$dir/short.trace"
# Future format version (u32 at byte 8).
cp "$data/golden-v1.trace" "$dir/future.trace"; printf '\x63' | dd of="$dir/future.trace" bs=1 seek=8 conv=notrunc status=none
# A record header declaring a 4 GiB payload (u32 at byte 12+8).
cp "$data/golden-v1.trace" "$dir/hugelen.trace"; printf '\xff\xff\xff\xff' | dd of="$dir/hugelen.trace" bs=1 seek=20 conv=notrunc status=none
# One flipped bit in the middle of the file.
cp "$data/golden-v1.trace" "$dir/flipped.trace"
size=$(stat -c %s "$dir/flipped.trace"); off=$((size / 2))
byte=$(od -An -tu1 -j"$off" -N1 "$dir/flipped.trace" | tr -d ' ')
printf "\\x$(printf %02x $((byte ^ 4)))" | dd of="$dir/flipped.trace" bs=1 seek="$off" conv=notrunc status=none
# One flipped bit in a stored tensor of a version-4 trace, whose open reads no tensor bytes: the
# last byte of the step_begin record's tensors, just before the third record's magic ("RREC").
cp "$data/golden-v4.trace" "$dir/flipped-tensor.trace"
off=$(($(grep -obUa RREC "$dir/flipped-tensor.trace" | sed -n 3p | cut -d: -f1) - 1))
byte=$(od -An -tu1 -j"$off" -N1 "$dir/flipped-tensor.trace" | tr -d ' ')
printf "\\x$(printf %02x $((byte ^ 4)))" | dd of="$dir/flipped-tensor.trace" bs=1 seek="$off" conv=notrunc status=none
mkdir "$dir/emptydir"
# The header record twice (a duplicate record): the file header, the header record, the header
# record again, then the rest of the trace.
hdr=$((24 + $(od -An -tu4 -j20 -N4 "$data/golden-v1.trace" | tr -d ' ')))
{ head -c $((12 + hdr)) "$data/golden-v1.trace"; tail -c +13 "$data/golden-v1.trace" | head -c "$hdr"
  tail -c +$((13 + hdr)) "$data/golden-v1.trace"; } >"$dir/duplicate.trace"
# A read-only output folder. Root writes whatever the permission bits say, so for root it is a
# read-only bind mount in a private mount namespace (unshare -m: needs CAP_SYS_ADMIN, which root
# has outside a restricted container); for anyone else, a folder without write permission.
mkdir "$dir/readonly"
readonly_run=()
if [[ $(id -u) -ne 0 ]]; then
  chmod a-w "$dir/readonly"
elif unshare -m true 2>/dev/null; then
  readonly_run=(unshare -m sh -c 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"' sh "$dir/readonly")
else
  readonly_run=(skip)
fi
# A disk that fills up: a 64 KiB tmpfs in a private mount namespace (as root), which a full-mode
# recording overflows within its first step.
mkdir "$dir/small"
diskfull_run=(skip)
if [[ $(id -u) -eq 0 ]] && unshare -m true 2>/dev/null; then
  diskfull_run=(unshare -m sh -c 'mount -t tmpfs -o size=64k tmpfs "$1" && shift && exec "$@"' sh "$dir/small")
fi
# The generic program trace (program 'test') for diagnose.

fails=0 rows=() run=()
# case DESCRIPTION EXPECTED_CODE -- ARGS...   (retrace runs under the command in run=(...), if any)
case_() {
  local what=$1 want=$2; shift 3
  local err; err=$("${run[@]}" "$retrace" "$@" 2>&1 >/dev/null); local got=$?
  local lines; lines=$(printf '%s' "$err" | grep -c '' || true)
  local msg=${err//$dir/\$DIR}; msg=${msg//$data/\$DATA}
  local ok=yes
  if [[ $got -ne $want ]]; then ok="NO (exit $got)"; fi
  if [[ $want -ne 0 && $lines -ne 1 ]]; then ok="NO ($lines lines)"; fi
  if [[ $ok != yes ]]; then fails=$((fails + 1)); echo "FAIL: $what: exit $got, $lines lines: $err"; fi
  rows+=("| $what | \`retrace ${*//$dir/\$DIR}\` | $got | ${msg//|/\\|} |")
}
case_ "no command" 2 -- 
case_ "unknown command" 2 -- replya
case_ "unknown option" 2 -- demo --segmnets 2
case_ "a number that is not one" 2 -- demo --segments two
case_ "record without -o" 2 -- record "$dir/unknown.yaml"
case_ "record into a folder that does not exist" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o /nonexistent/dir/t.trace
# case_readonly DESCRIPTION EXPECTED_CODE -- ARGS...: with $dir/readonly read-only
case_readonly() {
  if [[ ${readonly_run[0]:-} == skip ]]; then
    echo "skipped: $1 (running as root, and unshare -m is not permitted here)"
    return
  fi
  run=("${readonly_run[@]}")
  case_ "$@"
  run=()
}
case_readonly "record into a read-only folder" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/readonly/t.trace"
case_readonly "export tensors into a read-only folder" 2 -- inspect "$data/golden-v1.trace" --export "$dir/readonly"
case_readonly "--json into a read-only folder" 2 -- run builtin:bf16-clean --json "$dir/readonly/r.json"
# case_diskfull DESCRIPTION EXPECTED_CODE -- ARGS...: with $dir/small a 64 KiB file system
case_diskfull() {
  if [[ ${diskfull_run[0]} == skip ]]; then
    echo "skipped: $1 (needs root and unshare -m for a small tmpfs)"
    return
  fi
  run=("${diskfull_run[@]}")
  case_ "$@"
  run=()
}
case_diskfull "the disk fills up while recording" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/small/t.trace" --mode full
case_diskfull "the disk fills up, --on-write-error continue" 1 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/small/t.trace" --mode full --on-write-error continue
case_ "a trace with its header record twice" 2 -- inspect "$dir/duplicate.trace"
case_ "unknown compression" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --compression tiny
case_ "negative encode threads" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --encode-threads -1
case_ "negative page cache window" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --page-cache-mib -1
case_ "unknown write-error policy" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --on-write-error ignore
case_ "unknown ring copy" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --ring 2 --ring-copy later
case_ "full snapshots every K steps in full mode" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --mode full --every 2
case_ "ring snapshots zero steps apart" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --ring 2 --ring-every 0
case_ "unknown record mode" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --mode fast
case_ "scenario file that does not exist" 2 -- run "$dir/nope.yaml"
case_ "empty scenario file" 2 -- run "$dir/empty.yaml"
case_ "not YAML" 2 -- run "$dir/notyaml.yaml"
case_ "a list instead of a mapping" 2 -- run "$dir/list.yaml"
case_ "unknown key (typo)" 2 -- run "$dir/unknown.yaml"
case_ "NaN in a number" 2 -- run "$dir/nan.yaml"
case_ "Inf in a number" 2 -- run "$dir/inf.yaml"
case_ "a word for an integer" 2 -- run "$dir/wordint.yaml"
case_ "an integer past 64 bits" 2 -- run "$dir/hugeint.yaml"
case_ "negative batch" 2 -- run "$dir/negbatch.yaml"
case_ "more segments than layers" 2 -- run "$dir/segs.yaml"
case_ "heads not dividing d_model" 2 -- run "$dir/heads.yaml"
case_ "model without type" 2 -- run "$dir/notype.yaml"
case_ "no model section" 2 -- run "$dir/nomodel.yaml"
case_ "unknown injection type" 2 -- run "$dir/badtype.yaml"
case_ "a key the injection type does not use" 2 -- run "$dir/unusedkey.yaml"
case_ "a segment that is not a stage" 2 -- run "$dir/badseg.yaml"
case_ "a segment fault without checkpointing" 2 -- run "$dir/noseg.yaml"
case_ "a list as a key" 2 -- run "$dir/mapkey.yaml"
case_ "loss scaler that never grows" 2 -- run "$dir/growth.yaml"
case_ "an injection factor of 0 (the default's placeholder)" 2 -- run "$dir/factor0.yaml"
case_ "raises_match without raises" 2 -- run "$dir/match.yaml"
case_ "probability above 1" 2 -- run "$dir/prob.yaml"
case_ "unknown device" 2 -- run "$dir/device.yaml"
case_ "a key twice" 2 -- run "$dir/dupkey.yaml"
case_ "a second YAML document" 2 -- run "$dir/twodocs.yaml"
case_ "an injection after the last step" 2 -- run "$dir/late.yaml"
case_ "more bits than the bit class has" 2 -- run "$dir/bits.yaml"
case_ "an LSTM under fp16 on the CPU" 2 -- run "$dir/lstm16.yaml"
case_ "600 levels of nesting" 2 -- run "$dir/deep.yaml"
case_ "a program and a built-in model" 2 -- run "$dir/progmodel.yaml"
case_ "a built-in training key on a program" 2 -- run "$dir/progtrain.yaml"
case_ "a program config that is not a mapping" 2 -- run "$dir/progcfg.yaml"
case_ "config without a program" 2 -- run "$dir/cfgonly.yaml"
case_ "a control character in the name" 2 -- run "$dir/ctrlname.yaml"
case_ "a misspelt clip mode" 2 -- run "$dir/clipmode.yaml"
case_ "record a program this binary lacks" 2 -- record "$dir/prog.yaml" -o "$dir/t.trace"
case_ "record --config in a binary without its own program" 2 -- record -o "$dir/t.trace" --config "$dir/nope.cfg"
case_ "record a scenario with --config" 2 -- record "$data/../../examples/scenarios/tiny-gpt.yaml" -o "$dir/t.trace" --config "$dir/nope.cfg"
case_ "unknown built-in scenario" 2 -- run builtin:nope
case_ "a folder without scenarios" 2 -- run "$dir/emptydir"
case_ "-j 0" 2 -- run -j 0
case_ "--threads 0" 2 -- run --threads 0 builtin:bf16-clean
case_ "record --threads 0" 2 -- record builtin:bf16-clean -o "$dir/t.trace" --threads 0
case_ "--threads 100000" 2 -- run --threads 100000 builtin:bf16-clean
case_ "yes for a boolean" 2 -- run "$dir/yesbool.yaml"
case_ "a quoted number" 2 -- run "$dir/quotednum.yaml"
case_ "params_finite: false without diverges" 2 -- run "$dir/falsefinite.yaml"
case_ "momentum under Adam" 2 -- run "$dir/adammomentum.yaml"
case_ "a clip setting with clip mode off" 2 -- run "$dir/clipoff.yaml"
case_ "a LayerNorm guard on an LSTM" 2 -- run "$dir/lstmln.yaml"
# A valid scenario and its trace: without the refusals these would record and replay (exit 0).
w own.yaml "$m\ntraining: {steps: 1}\n"
mkdir "$dir/ownfolder" && cp "$dir/own.yaml" "$dir/ownfolder/"
"$retrace" record "$dir/own.yaml" -o "$dir/own.trace" >/dev/null 2>&1
case_ "record -o onto its own scenario file" 2 -- record "$dir/own.yaml" -o "$dir/own.yaml"
case_ "record -o a folder" 2 -- record "$dir/own.yaml" -o "$dir/emptydir"
case_ "replay --json onto the trace" 2 -- replay "$dir/own.trace" --json "$dir/own.trace"
case_ "run --json onto the scenario it runs" 2 -- run "$dir/own.yaml" --json "$dir/own.yaml"
case_ "run --report onto a scenario of the folder it runs" 2 -- run "$dir/ownfolder" --report "$dir/ownfolder/own.yaml"
case_ "run --junit onto a scenario file (the scenario read as its path)" 2 -- run --junit "$dir/own.yaml"
case_ "run --junit with an empty path" 2 -- run "$dir/own.yaml" --junit ''
case_ "run --json and --junit onto one file" 2 -- run "$dir/own.yaml" --json "$dir/r.out" --junit "$dir/./r.out"
case_ "--json into a folder that does not exist" 2 -- run builtin:bf16-clean --json "$dir/no/such/r.json"
case_ "--junit into a folder that does not exist" 2 -- run builtin:bf16-clean --junit "$dir/no/such/r.xml"
case_ "selective recompute with segments" 2 -- run "$dir/selseg.yaml"
case_ "trace that does not exist" 2 -- replay "$dir/nope.trace"
case_ "a folder as a trace" 2 -- inspect "$dir/emptydir"
case_ "a YAML file as a trace" 2 -- replay "$dir/unknown.yaml"
case_ "an empty trace" 2 -- inspect "$dir/zero.trace"
case_ "a trace cut inside its file header" 2 -- inspect "$dir/short.trace"
case_ "a trace from a future format version" 2 -- inspect "$dir/future.trace"
case_ "a record declaring a 4 GiB payload" 2 -- inspect "$dir/hugelen.trace"
case_ "one flipped bit mid-file" 2 -- inspect "$dir/flipped.trace"
case_ "one flipped bit in a stored tensor (format 4)" 2 -- inspect "$dir/flipped-tensor.trace"
case_ "a trace of a program this binary lacks" 2 -- replay "$data/golden-v1.trace"
case_ "diagnose without a source" 2 -- diagnose
case_ "diagnose a trace of another program" 2 -- diagnose "$data/golden-v1.trace"
case_ "diagnose --steps -1" 2 -- diagnose builtin:grad-nan-skip-off --steps -1
case_ "diagnose --steps 0" 2 -- diagnose builtin:grad-nan-skip-off --steps 0
case_ "diagnose --steps short of the failing step" 2 -- diagnose builtin:grad-nan-skip-off --steps 1

if [[ -n $table ]]; then
  {
    echo "| input | command | exit | the one line on stderr |"
    echo "| --- | --- | ---: | --- |"
    printf '%s\n' "${rows[@]}"
  } >"$table"
fi
echo "${#rows[@]} hostile inputs, $fails not handled as expected"
[[ $fails -eq 0 ]]
