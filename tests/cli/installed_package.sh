#!/usr/bin/env bash
# example.installed_package: `cmake --install` this build into a prefix, then configure, build
# and run examples/ as a project of its own against the installed package (find_package(retrace)),
# as a user's project would. The package must travel: the install tree is copied elsewhere and the
# original prefix removed before examples/ is configured against the copy, and no file of the
# copy's CMake package may name this machine's build tree, source tree, install prefix, or a
# LibTorch/CUDA library by absolute path (the consumer finds those through its own find_package).
#   installed_package.sh BUILD_DIR EXAMPLES_DIR TORCH_DIR CMAKE
set -euo pipefail
build=$(cd "$1" && pwd) examples=$2 torch_dir=$3 cmake=$4
source_dir=$(cd "$examples/.." && pwd)
work=$build/installed-package  # a fixed place under the build: ccache hits on later runs
prefix=$work/prefix
moved=$work/moved  # the install tree as another machine would have it
rm -rf "$prefix" "$moved" "$work/build"
mkdir -p "$work"

"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log"
test -f "$prefix/lib/cmake/retrace/retraceConfig.cmake" || { echo "no retraceConfig.cmake installed"; exit 1; }
test -x "$prefix/bin/retrace" || { echo "no retrace CLI installed"; exit 1; }

# Move the package: copy it, and remove the prefix it was installed to.
cp -a "$prefix" "$moved"
rm -rf "$prefix"

# No path of this machine in the moved CMake package.
pkg=$moved/lib/cmake/retrace
leaks=0
for p in "$build" "$source_dir" "$prefix"; do
  if grep -rlF -- "$p" "$pkg"; then echo "^ these files name '$p'"; leaks=1; fi
done
if grep -nE -- '/site-packages/|/usr/local/cuda|/torch/lib/' "$pkg"/retraceTargets*.cmake; then
  echo "^ the exported targets name a LibTorch/CUDA library by absolute path"; leaks=1
fi
# Any absolute path among the exported link libraries (';'-separated entries in quotes, maybe
# inside a generator expression such as $<LINK_ONLY:...>).
if grep -h -- 'INTERFACE_LINK_LIBRARIES' "$pkg"/retraceTargets*.cmake | grep -E -- '[";:>]/'; then
  echo "^ an exported link interface holds an absolute path"; leaks=1
fi
((leaks == 0)) || { echo "the installed package names paths of the build machine"; exit 1; }

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(cd "$examples/.." && pwd)}
  export CCACHE_NOHASHDIR=1
fi
# Only the moved package and LibTorch: nothing from the source tree, its build or the prefix.
"$cmake" -S "$examples" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$moved;$torch_dir/../../.." >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
if grep -Eq "$source_dir/([a-z]+/)?include" "$work/build/build.ninja"; then
  echo "the outside build reaches into the source tree's include/ or a FOLDER/include/"; exit 1
fi
grep -q "$moved/lib/libretrace_core.a" "$work/build/build.ninja" ||
  { echo "the outside build does not link the moved package's libraries"; exit 1; }
"$cmake" --build "$work/build" -j "${RETRACE_JOBS:-2}" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }

"$work/build/retrace_example_minimal"
trace=$work/custom.trace
rm -f "$trace"
"$work/build/retrace_example_custom" record -o "$trace" --steps 4 --ring 2
"$work/build/retrace_example_custom" replay "$trace" --from 1 | tee "$work/replay.txt"
grep -q 'replayed steps 1..4: reproduced bitwise' "$work/replay.txt"
# The user's own program under its fault x defense scenarios, built against the moved package.
"$work/build/retrace_example_encoder" run "$examples/encoder/scenarios" -j 2 >"$work/encoder.txt" ||
  { cat "$work/encoder.txt"; exit 1; }
grep -q '6 scenarios, 6 as expected, 0 not' "$work/encoder.txt" || { cat "$work/encoder.txt"; exit 1; }
# The CLI's RUNPATH is the build machine's LibTorch lib/ (INSTALL_RPATH_USE_LINK_PATH): it runs
# where that LibTorch is.
"$moved/bin/retrace" --version
echo "installed package: find_package(retrace) from a moved copy ($moved) built and ran the examples"
