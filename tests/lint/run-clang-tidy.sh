#!/usr/bin/env bash
# tests/lint/run-clang-tidy.sh — clang-tidy over gpurpc's own sources (server/, client/cpp/,
# common/; not the tests, not protoc's code) with the small check set CI enforces: every
# finding fails. The set: clang's thread-safety analysis of the ABSL_GUARDED_BY /
# ABSL_*_LOCKS_REQUIRED annotations (GCC ignores them), and bug finders that have no false
# positives on this code base (use after move, dangling string_view/span handles, memset
# and string constructor mistakes, ignored results that must be used, undelegated
# constructors, override/nullptr). The broader .clang-tidy at the root is for editors and
# reviews; it is not enforced.
#
#   bash tests/lint/run-clang-tidy.sh BUILD_DIR     (a configured build: compile_commands.json)
#
# Environment: GPURPC_JOBS (default: all cores), CLANG_TIDY (default clang-tidy).
set -uo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
cd "$repo_root" || exit 1
build_dir=${1:?usage: run-clang-tidy.sh BUILD_DIR}
jobs=${GPURPC_JOBS:-$(nproc)}
clang_tidy=${CLANG_TIDY:-clang-tidy}
checks='-*,clang-diagnostic-thread-safety*,bugprone-use-after-move,bugprone-dangling-handle,bugprone-suspicious-memset-usage,bugprone-string-constructor,bugprone-unused-return-value,bugprone-undelegated-constructor,bugprone-move-forwarding-reference,modernize-use-override,modernize-use-nullptr'

if ! command -v "$clang_tidy" >/dev/null; then
  echo "run-clang-tidy.sh: $clang_tidy not found; install clang-tidy (deploy/dev/setup.sh does)" >&2
  exit 1
fi
if [[ ! -f "$build_dir/compile_commands.json" ]]; then
  echo "run-clang-tidy.sh: $build_dir/compile_commands.json is missing; configure the build first" >&2
  exit 1
fi
# Our sources that the build compiles (the database names each once).
mapfile -t files < <("${PYTHON:-python3}" - "$build_dir/compile_commands.json" "$repo_root" <<'PY'
import json, os, sys
root = sys.argv[2] + "/"
seen = set()
for entry in json.load(open(sys.argv[1])):
    path = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    rel = path[len(root):] if path.startswith(root) else None
    if rel and rel.startswith(("server/", "client/cpp/", "common/")) and rel not in seen:
        seen.add(rel)
        print(rel)
PY
)
if ((${#files[@]} == 0)); then
  echo "run-clang-tidy.sh: the compilation database lists none of our sources" >&2
  exit 1
fi
log_dir=$(mktemp -d)
trap 'rm -rf -- "$log_dir"' EXIT
start=$(date +%s)
# One clang-tidy per file, $jobs at once; each writes its findings to its own log. Of the
# compiler's own warnings only the thread-safety analysis is on (-Wno-everything first): GCC's
# -Werror build owns the rest, and clang reads some of GCC's flags differently (it calls
# libseccomp's SCMP_A0 macros C99 extensions under -Wpedantic).
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} sh -c '
  log="$1/$(echo "$2" | tr / _).log"
  "$3" -p "$4" --quiet --checks="$5" --warnings-as-errors="*" --extra-arg=-Wno-everything \
    --extra-arg=-Wthread-safety "$2" >"$log" 2>&1 || echo "$2" >>"$1/failed"
' _ "$log_dir" {} "$clang_tidy" "$build_dir" "$checks"
if [[ -s "$log_dir/failed" ]]; then
  mapfile -t failed < "$log_dir/failed"
  for file in "${failed[@]}"; do
    grep -E "(warning|error):" "$log_dir/$(echo "$file" | tr / _).log" | sort -u | sed 's/^/  /'
  done
  echo "run-clang-tidy.sh: ${#failed[@]} of ${#files[@]} files have findings (checks: $checks)"
  exit 1
fi
echo "run-clang-tidy.sh: ${#files[@]} files clean in $(($(date +%s) - start)) s ($("$clang_tidy" --version | grep -o 'version [0-9.]*'))"
