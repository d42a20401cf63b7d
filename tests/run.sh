#!/usr/bin/env bash
# tests/run.sh — sets this machine up, builds gpurpc with warnings as errors and runs every test
# that needs no GPU: ctest (labels `unit` and `service`; `gpu` is left out), the Python stub
# check and the Python tests against a daemon on the fake backend, then checks that the
# relocatable install is self-contained and that its C++ client builds and runs out of tree.
# Before building, every C++ file must be clang-formatted (tests/lint/check-format.sh); after
# it, clang-tidy's enforced checks run over our sources (tests/lint/run-clang-tidy.sh).
# Exits non-zero when any step failed; every step runs even after an earlier one failed, so
# one run shows everything.
#
#   bash tests/run.sh
#
# Then the same unit and service tests once more from a second build with AddressSanitizer
# and UndefinedBehaviorSanitizer (GPURPC_SANITIZE=ON, in <build dir>-asan), so that memory
# errors and undefined behaviour fail CI. Last, the libFuzzer targets (tests/fuzz, a clang
# build in build-fuzz): their saved reproducers, then each target for a bounded time
# (tests/fuzz/run-fuzzers.sh).
#
# Environment: GPURPC_BUILD_DIR (default build), GPURPC_JOBS (default: all cores),
# GPURPC_SKIP_SETUP=1 to skip deploy/dev/setup.sh, GPURPC_SKIP_SANITIZE=1 to skip the
# sanitizer build, GPURPC_SKIP_FUZZ=1 to skip the fuzzing, GPURPC_FUZZ_SECONDS (fuzzing per
# target, default 45), PYTHON (default python3).
# The GPU tests run elsewhere: `ctest --test-dir build -L gpu`, or gpurpc-run-tests from a
# relocatable install on a GPU box (README.md).
set -uo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$repo_root" || exit 1
build_dir=${GPURPC_BUILD_DIR:-build}
jobs=${GPURPC_JOBS:-$(nproc)}
python=${PYTHON:-python3}

results=()
failed=0
step() { echo; echo "=== tests/run.sh: $*"; }
record() {  # record NAME STATUS
  results+=("$(printf '%-14s %s' "$1" "$2")")
  # Only ok passes: a step that ran no tests (nothing collected, its folder gone) fails.
  [[ "$2" == ok* ]] || failed=1
}
finish() {
  echo
  echo "=== tests/run.sh: summary"
  printf '  %s\n' "${results[@]}"
  if ((failed)); then
    echo "tests/run.sh: FAILED"
    exit 1
  fi
  echo "tests/run.sh: all steps passed"
  exit 0
}

if [[ "${GPURPC_SKIP_SETUP:-0}" != 1 ]]; then
  step "setup"
  if ! bash deploy/dev/setup.sh; then
    record setup FAILED
    finish
  fi
fi

step "clang-format (tests/lint/check-format.sh)"
if bash tests/lint/check-format.sh; then record clang-format ok; else record clang-format FAILED; fi

# Same configuration as deploy/dev/run-daemon.sh and the Dockerfile, plus -Werror.
step "configure ($build_dir)"
if ! cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DGPURPC_WERROR=ON; then
  record configure FAILED
  finish
fi
step "build ($jobs jobs)"
if ! cmake --build "$build_dir" --parallel "$jobs"; then
  record build FAILED
  finish
fi
record build ok

# clang's thread-safety analysis of the lock annotations and a few clang-tidy bug finders,
# over our own sources, from this build's compile_commands.json.
step "clang-tidy (tests/lint/run-clang-tidy.sh)"
if GPURPC_JOBS="$jobs" bash tests/lint/run-clang-tidy.sh "$build_dir"; then
  record clang-tidy ok
else
  record clang-tidy FAILED
fi

step "ctest -LE gpu"
ctest --test-dir "$build_dir" -LE gpu --output-on-failure --timeout 300 --parallel "$jobs" \
  --no-tests=error
rc=$?
if ((rc == 0)); then record ctest ok; else record ctest "FAILED (exit $rc)"; fi

if [[ -f client/python/tools/check_stubs.py ]]; then
  step "check_stubs.py"
  "$python" client/python/tools/check_stubs.py
  rc=$?
  if ((rc == 0)); then record check_stubs ok; else record check_stubs "FAILED (exit $rc)"; fi
else
  record check_stubs "FAILED (client/python/tools/check_stubs.py is missing)"
fi

if [[ -d tests/python ]]; then
  step "pytest tests/python (fake backend)"
  GPURPCD_BIN="$repo_root/$build_dir/server/gpurpcd" \
    "$python" -m pytest tests/python -q -p no:cacheprovider
  rc=$?
  case $rc in
    0) record pytest ok ;;
    5) record pytest "FAILED (no tests collected)" ;;
    *) record pytest "FAILED (exit $rc)" ;;
  esac
else
  record pytest "FAILED (tests/python is missing)"
fi

# The API from a language we wrote no client for: Go, from the generated stubs alone.
step "Go client (tests/go/check-go-client.sh)"
if bash tests/go/check-go-client.sh "$repo_root/$build_dir/server/gpurpcd" "$build_dir/go"; then
  record go-client ok
else
  record go-client FAILED
fi

# deploy/kubernetes and the Dockerfile, offline: yamllint, kubernetes-validate, the daemon's
# view of its manifests, the rendered configuration parsed by this build's daemon, the
# example pod simulated on the fake backend, hadolint.
step "kubernetes (tests/deploy/check-kubernetes.sh)"
if bash tests/deploy/check-kubernetes.sh "$repo_root/$build_dir/server/gpurpcd"; then
  record kubernetes ok
else
  record kubernetes FAILED
fi

# ASan + UBSan: every sanitizer report is fatal (halt_on_error), and the test that caused it
# fails with the report in its output.
if [[ "${GPURPC_SKIP_SANITIZE:-0}" != 1 ]]; then
  asan_dir="${build_dir}-asan"
  step "sanitizers: configure and build ($asan_dir)"
  if cmake -S . -B "$asan_dir" -DCMAKE_BUILD_TYPE=Release -DGPURPC_WERROR=ON \
    -DGPURPC_SANITIZE=ON -DGPURPC_GPU_TESTS=OFF >"$asan_dir.configure.log" 2>&1 &&
    cmake --build "$asan_dir" --parallel "$jobs"; then
    step "sanitizers: ctest -LE gpu"
    ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      ctest --test-dir "$asan_dir" -LE gpu --output-on-failure --timeout 600 --parallel "$jobs" \
      --no-tests=error \
      -E 'MemoryLimitIsResourceExhausted|CompileLimitsServiceTest.Memory'  # no RLIMIT_AS under ASan
    rc=$?
    if ((rc == 0)); then record sanitizers ok; else record sanitizers "FAILED (exit $rc)"; fi
  else
    tail -n 20 "$asan_dir.configure.log"
    record sanitizers "FAILED (build)"
  fi
fi

# The relocatable install (cmake/GpurpcInstall.cmake) must stay self-contained.
step "relocatable install"
install_dir="$build_dir/install-check"
rm -rf -- "$install_dir"
if cmake --install "$build_dir" --prefix "$install_dir" >"$build_dir/install-check.log" 2>&1 &&
  bash deploy/dev/check-install.sh "$install_dir"; then
  record install ok
  # The C++ client from that install, as a user builds against it (CMake package and
  # pkg-config), running the README's C++ example against the install's own daemon.
  step "installed C++ client (tests/install/check-client-install.sh)"
  if bash tests/install/check-client-install.sh "$install_dir"; then
    record client-install ok
  else
    record client-install FAILED
  fi
else
  tail -n 20 "$build_dir/install-check.log"
  record install FAILED
  record client-install "FAILED (no install)"
fi

# libFuzzer targets: saved reproducers, then each target from a copy of its seed corpus.
if [[ "${GPURPC_SKIP_FUZZ:-0}" != 1 ]]; then
  step "fuzz (tests/fuzz/run-fuzzers.sh)"
  bash tests/fuzz/run-fuzzers.sh "${GPURPC_FUZZ_SECONDS:-45}"
  rc=$?
  if ((rc == 0)); then record fuzz ok; else record fuzz "FAILED (exit $rc)"; fi
fi

finish
