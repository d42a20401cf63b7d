#!/usr/bin/env bash
# tests/lint/check-format.sh — fails when a C++ file in git differs from what clang-format
# makes of it with the repository's .clang-format (Google style, 100 columns), and names the
# files. Fix with: clang-format -i FILE... (Debian 12's clang-format 14; deploy/dev/setup.sh
# installs it).
#
#   bash tests/lint/check-format.sh
set -uo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
cd "$repo_root" || exit 1
clang_format=${CLANG_FORMAT:-clang-format}
if ! command -v "$clang_format" >/dev/null; then
  echo "check-format.sh: $clang_format not found; install clang-format (deploy/dev/setup.sh does)" >&2
  exit 1
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "check-format.sh: $repo_root is not a git checkout; the files to check come from git" >&2
  exit 1
fi

mapfile -t files < <(git ls-files -- '*.cc' '*.h')
if ((${#files[@]} == 0)); then
  echo "check-format.sh: git lists no C++ files" >&2
  exit 1
fi
unformatted=()
for file in "${files[@]}"; do
  if ! "$clang_format" --dry-run -Werror "$file" >/dev/null 2>&1; then
    unformatted+=("$file")
  fi
done
if ((${#unformatted[@]})); then
  echo "check-format.sh: ${#unformatted[@]} of ${#files[@]} files are not clang-formatted:"
  printf '  %s\n' "${unformatted[@]}"
  echo "fix with: $clang_format -i ${unformatted[*]}"
  exit 1
fi
echo "check-format.sh: ${#files[@]} files clang-formatted ($("$clang_format" --version | head -n 1))"
