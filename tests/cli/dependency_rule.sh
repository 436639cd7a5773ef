#!/usr/bin/env bash
# dependency_rule.sh CXX LIB=DIR:DIR... ...: each library's include path (its INCLUDE_DIRECTORIES,
# as it compiles) shows the public headers of the libraries it may use and none above it
# (docs/architecture.md, "Dependency rule"). Checked with __has_include in a preprocessed
# translation unit, so an upward include fails here as it fails to compile in the library.
# Control: the same check asked to find a header from above must fail.
set -euo pipefail
cxx=$1
shift
declare -A dirs
for arg in "$@"; do dirs[${arg%%=*}]=${arg#*=}; done

# LIB: headers it must see | headers it must not see (one per component above or beside it).
declare -A see hide
see[core]="diff.h trace.h records.h collectives.h"; hide[core]="scenario.h recorder.h replayer.h dist.h injectors.h defenses.h models.h runner.h report.h cli.h"
see[spec]="scenario.h injection_spec.h diff.h"; hide[spec]="injectors.h defenses.h recorder.h replayer.h models.h runner.h"
see[recorder]="recorder.h trace.h";          hide[recorder]="replayer.h dist.h scenario.h injectors.h defenses.h models.h runner.h"
see[replayer]="replayer.h trace.h";          hide[replayer]="recorder.h dist.h scenario.h injectors.h defenses.h models.h runner.h"
see[dist]="dist.h collective_backend.h collectives.h"; hide[dist]="recorder.h replayer.h scenario.h injectors.h defenses.h models.h runner.h"
see[injectors]="injectors.h scenario.h";     hide[injectors]="defenses.h recorder.h replayer.h models.h runner.h"
see[defenses]="defenses.h injectors.h collectives.h"; hide[defenses]="dist.h models.h trainer.h recorder.h replayer.h runner.h"
see[harness]="models.h trainer.h defenses.h dist.h"; hide[harness]="runner.h diagnose.h recorder.h replayer.h report.h"
see[suite]="runner.h recorder.h replayer.h models.h"; hide[suite]="report.h reporter.h cli.h"
see[report]="reporter.h report.h runner.h";  hide[report]="cli.h"

check() {  # check LIB SEE HIDE: exit status of preprocessing the checks
  local lib=$1 want=$2 not=$3 flags=() IFS=:
  for d in ${dirs[$lib]}; do flags+=("-I$d"); done
  unset IFS
  {
    for h in $want; do printf '#if !__has_include(<retrace/%s>)\n#error "%s does not see retrace/%s"\n#endif\n' "$h" "$lib" "$h"; done
    for h in $not; do printf '#if __has_include(<retrace/%s>)\n#error "%s sees retrace/%s, from a library it must not use"\n#endif\n' "$h" "$lib" "$h"; done
  } | "$cxx" -E -x c++ - "${flags[@]}" -o /dev/null
}

for lib in "${!see[@]}"; do
  [[ -n ${dirs[$lib]:-} ]] || { echo "no include path given for $lib"; exit 1; }
  check "$lib" "${see[$lib]}" "${hide[$lib]}" || { echo "the dependency rule is broken for retrace::$lib"; exit 1; }
done
# Control: core asked to see the recorder's header must fail.
if check core "recorder.h" "" 2>/dev/null; then echo "control: core sees retrace/recorder.h"; exit 1; fi
echo "ok: ${#see[@]} libraries see what they link and nothing above (control failed as it must)"
