#!/usr/bin/env bash
# run-daemon.sh [gpurpcd flags...] — sets up this machine (deploy/dev/setup.sh), builds the
# daemon (Release, in build/) and runs it in the foreground with the given flags, e.g.
#
#   bash deploy/dev/run-daemon.sh --backend=fake      # no GPU needed
#   bash deploy/dev/run-daemon.sh                     # --backend=auto: the GPU when there is one
#
# Environment: GPURPC_BUILD_DIR (default build), GPURPC_JOBS (default: all cores),
# GPURPC_SKIP_SETUP=1 to skip the setup step.
set -euo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
cd "$repo_root"
build_dir=${GPURPC_BUILD_DIR:-build}
jobs=${GPURPC_JOBS:-$(nproc)}

if [[ "${GPURPC_SKIP_SETUP:-0}" != 1 ]]; then
  bash deploy/dev/setup.sh
fi
# Same configuration as tests/run.sh (which adds -DGPURPC_WERROR=ON) and the Dockerfile.
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" --parallel "$jobs" --target gpurpcd
echo "run-daemon: exec $build_dir/server/gpurpcd $*" >&2
exec "$build_dir/server/gpurpcd" "$@"
