#!/usr/bin/env bash
# format_check.sh CLANG_FORMAT SOURCE_DIR: every C++ source of the tree is formatted as
# .clang-format says, or the files that are not are named with a command that fixes them.
# Control first: a copy of a source with its indentation broken must fail the same check.
set -euo pipefail
clang_format=$1 root=$2
cd "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mapfile -t files < <(find core spec recorder replayer dist injectors defenses harness suite report tools include tests bench examples \
  -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) | sort)
((${#files[@]} > 100)) || { echo "found only ${#files[@]} sources under $root"; exit 1; }
# The control: the same style file, one source with its first indented line's indentation doubled.
cp .clang-format "$tmp/.clang-format"
sed '0,/^  [a-z]/s//    &/' core/diff.cpp >"$tmp/bad.cpp"
if "$clang_format" --dry-run -Werror "$tmp/bad.cpp" 2>/dev/null; then
  echo "control: a misformatted file passed the check"; exit 1
fi
bad=()
for f in "${files[@]}"; do
  "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "${#bad[@]} sources are not formatted as .clang-format says: ${bad[*]}"
  echo "fix: $clang_format -i ${bad[*]}"
  exit 1
fi
echo "ok: ${#files[@]} sources formatted (control failed as it must)"
