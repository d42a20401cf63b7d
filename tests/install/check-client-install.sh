#!/usr/bin/env bash
# check-client-install.sh DIR — proves the C++ client installed in DIR (cmake --install) is
# usable the way a user would use it, against a daemon of the same install (fake backend):
#   1. an out-of-tree CMake project (tests/install/consumer: the README's C++ example) finds
#      it with find_package(gpurpc CONFIG), builds and runs;
#   2. the same program built with plain g++ and `pkg-config --cflags --libs gpurpc` runs.
# Exit status 0 when both ran and checked their result.
set -euo pipefail
here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd -- "$here/../.." && pwd -P)
dir=$(cd -- "${1:?usage: check-client-install.sh INSTALL_DIR}" && pwd -P)
work=$(mktemp -d)
daemon_pid=""
cleanup() {
  [[ -n "$daemon_pid" ]] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  rm -rf -- "$work"
}
trap cleanup EXIT

echo "check-client-install: configure and build the consumer against $dir"
cmake -S "$here/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$dir" \
  -DGPURPC_README="$repo/README.md" -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }

echo "check-client-install: build the same with pkg-config"
# shellcheck disable=SC2046  # pkg-config's words are meant to split
g++ -std=c++17 -O1 -I"$work/build" "$here/consumer/main.cc" -o "$work/consumer-pc" \
  $(PKG_CONFIG_PATH="$dir/lib/pkgconfig" pkg-config --cflags --libs gpurpc)

mkdir -m 700 "$work/run"
"$dir/bin/gpurpcd" --backend=fake --unix-socket="$work/run/gpurpcd.sock" --drain-timeout=0s \
  --cache-dir="$work/cache" > "$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do [[ -S "$work/run/gpurpcd.sock" ]] && break; sleep 0.1; done
[[ -S "$work/run/gpurpcd.sock" ]] || { cat "$work/daemon.log"; exit 1; }
export GPURPC_ADDRESS="unix:$work/run/gpurpcd.sock"
"$work/build/consumer"
"$work/consumer-pc"
echo "check-client-install: ok"
