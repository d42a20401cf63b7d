#!/usr/bin/env bash
# tests/fuzz/run-fuzzers.sh — builds the libFuzzer targets of tests/fuzz (clang,
# -DGPURPC_FUZZ=ON, in their own build folder) and, for each target, replays its saved
# reproducers (tests/fuzz/regressions/<target>/), then fuzzes it for a bounded time starting
# from a copy of its seed corpus (tests/fuzz/corpus/<target>/; the repository's corpus is
# never written to). Prints each target's executions and exec/s from libFuzzer's final
# stats, and exits non-zero when a reproducer fails or fuzzing found a crash, a leak, a
# timeout or an out-of-memory, naming the input that shows it.
#
#   bash tests/fuzz/run-fuzzers.sh [SECONDS_PER_TARGET]     (default 45)
#
# Environment: GPURPC_FUZZ_BUILD_DIR (default build-fuzz), GPURPC_JOBS (build jobs, default:
# all cores), GPURPC_FUZZ_TARGETS (default: every target, space-separated), CC / CXX (default
# clang / clang++). Found inputs and new corpus units stay in $GPURPC_FUZZ_BUILD_DIR/fuzz-out.
# To reproduce a finding: $GPURPC_FUZZ_BUILD_DIR/tests/fuzz/fuzz_<target> FILE.
set -uo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
cd "$repo_root" || exit 1
seconds=${1:-45}
build_dir=${GPURPC_FUZZ_BUILD_DIR:-build-fuzz}
jobs=${GPURPC_JOBS:-$(nproc)}
targets=(${GPURPC_FUZZ_TARGETS:-fuzz_compile_checks fuzz_module_image fuzz_command_batch fuzz_metadata})
cc=${CC:-clang}
cxx=${CXX:-clang++}

if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "run-fuzzers.sh: '$seconds' is not a number of seconds per target (e.g. 45)" >&2
  exit 2
fi
for tool in "$cc" "$cxx"; do
  if ! command -v "$tool" >/dev/null; then
    echo "run-fuzzers.sh: $tool not found; install clang and libclang-rt-dev" \
      "(deploy/dev/setup.sh does)" >&2
    exit 1
  fi
done

# --- build ---------------------------------------------------------------------------------
# Warnings are errors in the fuzz targets themselves (tests/fuzz/CMakeLists.txt); the
# libraries are built as by GCC's -Werror build, whose flags clang reads differently.
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
start=$(date +%s)
mkdir -p "$build_dir"
if ! cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DGPURPC_FUZZ=ON -DGPURPC_WERROR=OFF \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" "${launcher[@]}" \
  >"$build_dir/fuzz-configure.log" 2>&1; then
  cat "$build_dir/fuzz-configure.log"
  echo "run-fuzzers.sh: configure failed" >&2
  exit 1
fi
if ! cmake --build "$build_dir" --parallel "$jobs" --target gpurpc_fuzzers; then
  echo "run-fuzzers.sh: build failed" >&2
  exit 1
fi
echo "run-fuzzers.sh: configure and build took $(($(date +%s) - start)) s"

# --- run -----------------------------------------------------------------------------------
out_dir="$build_dir/fuzz-out"
rm -rf -- "$out_dir"
mkdir -p "$out_dir/tmp"
# Scratch files of the targets (fuzz_metadata's tokens and config files) stay in here, also
# when a crash skips their clean-up.
export TMPDIR="$repo_root/$out_dir/tmp"
[[ "$out_dir" == /* ]] && export TMPDIR="$out_dir/tmp"
summary=()
failed=0

stat() {  # stat NAME LOG: a libFuzzer final statistic
  sed -n "s/^stat::$1: *//p" "$2" | tail -n 1
}

report_findings() {  # report_findings TARGET LOG: the failing input and why
  local target=$1 log=$2 file
  grep -a -A1 -m 1 "FUZZ INVARIANT FAILED" "$log" | sed 's/^/    /'
  grep -a -m 2 -E "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|SUMMARY: |runtime error:" "$log" |
    sed 's/^/    /'
  for file in "$out_dir/$target"-*; do
    [[ -e "$file" ]] && echo "    reproducer: $file  (run: $build_dir/tests/fuzz/$target $file)"
  done
}

for target in "${targets[@]}"; do
  binary="$build_dir/tests/fuzz/$target"
  echo
  echo "=== run-fuzzers.sh: $target"

  # Saved reproducers of earlier findings must pass.
  regressions=(tests/fuzz/regressions/"$target"/*)
  if [[ -e "${regressions[0]}" ]]; then
    log="$out_dir/$target.regressions.log"
    if "$binary" -runs=1 "${regressions[@]}" >"$log" 2>&1; then
      echo "  regressions: ${#regressions[@]} reproducer(s) pass"
    else
      echo "  regressions: a reproducer of tests/fuzz/regressions/$target fails:"
      grep -a -E "^Running: " "$log" | tail -n 1 | sed 's/^Running: /    reproducer: /'
      report_findings "$target" "$log"
      summary+=("$(printf '%-22s FAILED: a saved reproducer fails (%s)' "$target" "$log")")
      failed=1
      continue
    fi
  fi

  # Fuzz from a copy of the seeds; new units go to the copy.
  corpus="$out_dir/$target.corpus"
  mkdir -p "$corpus"
  cp -- tests/fuzz/corpus/"$target"/* "$corpus"/ 2>/dev/null
  dict=()
  [[ -f "tests/fuzz/dict/$target.dict" ]] && dict=(-dict="tests/fuzz/dict/$target.dict")
  log="$out_dir/$target.log"
  "$binary" "$corpus" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$out_dir/$target-" >"$log" 2>&1
  rc=$?
  runs=$(stat number_of_executed_units "$log")
  rate=$(stat average_exec_per_sec "$log")
  line=$(printf '%-22s %10s executions, %6s exec/s in %s s' "$target" "${runs:-?}" "${rate:-?}" "$seconds")
  if ((rc == 0)); then
    summary+=("$line: ok")
  else
    echo "  FOUND a failure (libFuzzer exit $rc):"
    report_findings "$target" "$log"
    summary+=("$line: FAILED (exit $rc, log $log)")
    failed=1
  fi
  echo "  $line"
done

echo
echo "=== run-fuzzers.sh: summary"
printf '  %s\n' "${summary[@]}"
if ((failed)); then
  echo "run-fuzzers.sh: FAILED (reproduce with the reproducer paths above; save a fixed one in" \
    "tests/fuzz/regressions/<target>/)"
  exit 1
fi
echo "run-fuzzers.sh: every target ran clean"
