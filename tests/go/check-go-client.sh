#!/usr/bin/env bash
# check-go-client.sh GPURPCD OUT — builds the Go client example (client/go/build.sh, into OUT)
# and runs it against GPURPCD on the fake backend, on a private Unix socket. Exit status 0
# when it listed the devices, ran axpy_f32 and checked the result.
set -euo pipefail
repo=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
gpurpcd=${1:?usage: check-go-client.sh GPURPCD OUT}
out=${2:?usage: check-go-client.sh GPURPCD OUT}
bash "$repo/client/go/build.sh" "$out"
work=$(mktemp -d)
daemon_pid=""
cleanup() {
  [[ -n "$daemon_pid" ]] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
  rm -rf -- "$work"
}
trap cleanup EXIT
mkdir -m 700 "$work/run"
"$gpurpcd" --backend=fake --unix-socket="$work/run/gpurpcd.sock" --cache-dir="$work/cache" \
  --drain-timeout=0s \
  > "$work/daemon.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 100); do [[ -S "$work/run/gpurpcd.sock" ]] && break; sleep 0.1; done
[[ -S "$work/run/gpurpcd.sock" ]] || { cat "$work/daemon.log"; exit 1; }
GPURPC_ADDRESS="unix:$work/run/gpurpcd.sock" "$out/gpurpc-go-example"
