#!/usr/bin/env bash
# example.installed_package: `cmake --install` this build into a prefix, then configure, build
# and run examples/ as a project of its own against the installed package (find_package(retrace)),
# as a user's project would.
#   installed_package.sh BUILD_DIR EXAMPLES_DIR TORCH_DIR CMAKE
set -euo pipefail
build=$1 examples=$2 torch_dir=$3 cmake=$4
work=$build/installed-package  # a fixed place under the build: ccache hits on later runs
prefix=$work/prefix
rm -rf "$prefix" "$work/build"
mkdir -p "$work"

"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log"
test -f "$prefix/lib/cmake/retrace/retraceConfig.cmake" || { echo "no retraceConfig.cmake installed"; exit 1; }
test -x "$prefix/bin/retrace" || { echo "no retrace CLI installed"; exit 1; }

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(cd "$examples/.." && pwd)}
  export CCACHE_NOHASHDIR=1
fi
# Only the install prefix and LibTorch: nothing from the source tree or its build.
"$cmake" -S "$examples" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix;$torch_dir/../../.." >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
if grep -q "$(cd "$examples/.." && pwd)/include" "$work/build/build.ninja"; then
  echo "the outside build reaches into the source tree's include/"; exit 1
fi
"$cmake" --build "$work/build" -j "${RETRACE_JOBS:-2}" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }

"$work/build/retrace_example_minimal"
trace=$work/custom.trace
rm -f "$trace"
"$work/build/retrace_example_custom" record -o "$trace" --steps 4 --ring 2
"$work/build/retrace_example_custom" replay "$trace" --from 1 | tee "$work/replay.txt"
grep -q 'replayed steps 1..4: reproduced bitwise' "$work/replay.txt"
"$prefix/bin/retrace" --version
echo "installed package: find_package(retrace) from $prefix built and ran both examples"
