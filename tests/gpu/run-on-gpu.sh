#!/usr/bin/env bash
# The GPU run, on a machine with the driver, a GPU and Python 3 with grpcio, protobuf, numpy
# and pytest, from a relocatable install in dist/gpurpc (README.md) made on the build machine:
#
#   OUT=/some/dir bash tests/gpu/run-on-gpu.sh
#
# 1. every installed C++ test (unit, service on the fake backend, gpu on the GPU);
# 2. the compile-escape test against workers that hold a real CUDA context;
# 3. a daemon on the GPU (Unix socket, bearer tokens on loopback, health listener) and the
#    Python suite against it (auth, quota and escape tests start their own daemons);
# 4. the Python escape test against CUDA workers; a token-authenticated kernel over TCP;
#    the daemon's log checked for the token;
# 5. the soak and leak check (gpurpc-soak: 64 clients, 1000 open/close cycles, 8 clients
#    killed mid-upload) on the GPU, and the compute and memory benchmarks with the kernel
#    watchdog on (the default) and off (its cost per launch), and the Python benchmark
#    (regions, graphs, gpuarray) against a same-host daemon beside the C++ client's figures.
# GPURPC_GPU_STEPS (default "tests python soak bench") picks steps: tests = 1-2,
# python = 3-4, soak = 5's soak, bench = 5's benchmarks.
# Logs and gtest XML go to $OUT. Prints a summary line per step.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
R=$PWD/dist/gpurpc
STEPS=" ${GPURPC_GPU_STEPS:-tests python soak bench} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
echo "== machine"; uname -r; cat /sys/kernel/security/lsm; echo
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if want tests; then
echo "== all installed C++ tests (unit, service on the fake backend, gpu on the H200)"
L=$(mktemp -d)
$R/bin/gpurpc-run-tests -o "$L/ctest" > "$OUT/run-tests.log" 2>&1; echo "rc=$?"
tar czf "$OUT/ctest.tgz" -C "$L" ctest
grep -E "passed|failed|FAILED" "$OUT/run-tests.log" | tail -25
echo "== C++ escape test against CUDA workers"
GPURPC_ESCAPE_TEST_BACKEND=cuda $R/bin/gpurpc-run-tests '*compile_escape*' > "$OUT/escape-cuda.log" 2>&1; echo "rc=$?"
grep -E "^\[  |passed|failed" "$OUT/escape-cuda.log" | tail -14
grep -E "^\[ info \]" "$OUT/run-tests.log" | tail -8
fi
if want python; then
echo "== daemon on the GPU: unix socket + tokens on loopback + health"
T=$(mktemp -d); chmod 755 "$T"
$R/bin/gpurpcd --new-token=alice > "$T/alice"; sed -n 2p "$T/alice" > "$T/tokens"; chmod 600 "$T/tokens"
$R/bin/gpurpcd --backend=cuda --unix-socket="$T/run/gpurpcd.sock" --listen=127.0.0.1:50551 --drain-timeout=0s \
  --tokens-file="$T/tokens" --health-listen=127.0.0.1:50552 --cache-dir="$T/cache" \
  --admin-tenants=root --tenant-max-sessions=64 > "$T/daemon.log" 2>&1 &
D=$!
for i in $(seq 100); do [ -S "$T/run/gpurpcd.sock" ] && break; sleep 0.2; done
sleep 1; grep -E "sandbox|serving|device 0" "$T/daemon.log"
echo "== Python suite against the GPU daemon (own fake daemons for auth/quota/escape)"
export PYTHONPATH=$PWD/client/python/src
GPURPC_ADDRESS=unix:$T/run/gpurpcd.sock GPURPCD_BIN=$R/bin/gpurpcd timeout 500 \
  python3 -m pytest tests/python -q -p no:cacheprovider > "$OUT/pytest.log" 2>&1; echo "rc=$?"
tail -4 "$OUT/pytest.log"
echo "== Python escape test against CUDA workers"
GPURPC_ESCAPE_TEST_BACKEND=cuda GPURPCD_BIN=$R/bin/gpurpcd timeout 300 \
  python3 -m pytest tests/python/test_compile_escape.py -q -p no:cacheprovider 2>&1 | tail -2
echo "== token over TCP on the GPU daemon, server info, quota"
GPURPC_ADDRESS=127.0.0.1:50551 GPURPC_TOKEN=$(head -1 "$T/alice") timeout 120 python3 - <<'PY'
import numpy as np, gpurpc.autoinit, gpurpc.admin as admin, gpurpc.driver as drv
from gpurpc.compiler import SourceModule
print(admin.server_info())
mod = SourceModule("__global__ void twice(float* x){ x[threadIdx.x] *= 2; }")
a = np.arange(32, dtype=np.float32); mod.get_function("twice")(drv.InOut(a), block=(32,1,1))
print("kernel ok:", bool((a == 2*np.arange(32)).all()))
PY
GPURPC_ADDRESS=unix:$T/run/gpurpcd.sock timeout 60 python3 -c "import gpurpc.admin as a; print(a.server_info().compile_sandbox)"
kill $D; wait $D; cp "$T/daemon.log" "$OUT/daemon.log"
grep -c "alice\|gpurpc_" "$T/daemon.log" | sed 's/^/daemon log lines naming alice or a token prefix: /'
grep -F "$(head -1 "$T/alice")" "$T/daemon.log" && echo "TOKEN LEAKED INTO LOG" || echo "token not in the daemon log"
fi
if want soak; then
echo "== soak and leak check on the GPU: 64 clients x 30 s, 1000 cycles, 8 clients killed mid-upload"
timeout 400 $R/bin/gpurpc-soak --daemon-arg=--backend=cuda --clients=64 --seconds=30 \
  --cycles=1000 --killed=8 > "$OUT/soak.log" 2>&1; echo "rc=$?"
grep -vE "^\[" "$OUT/soak.log" | tail -22
fi
if want bench; then
echo "== benchmarks (kernel watchdog on, the default)"
timeout 150 $R/bin/gpurpc_bench_compute > "$OUT/bench-compute.log" 2>&1; echo "rc=$?"
grep -A24 "^Compute path" "$OUT/bench-compute.log"
echo "== benchmarks (kernel watchdog off: --kernel-timeout=0)"
timeout 150 $R/bin/gpurpc_bench_compute --daemon-arg=--kernel-timeout=0 > "$OUT/bench-compute-nowd.log" 2>&1; echo "rc=$?"
grep -A6 "^Compute path" "$OUT/bench-compute-nowd.log"
timeout 150 $R/bin/gpurpc_bench_memory > "$OUT/bench-memory.log" 2>&1; echo "rc=$?"
grep -vE "^\[" "$OUT/bench-memory.log" | tail -16
echo "== Python benchmark on a same-host daemon (regions on), with the C++ client beside it"
B=$(mktemp -d); chmod 755 "$B"
$R/bin/gpurpcd --backend=cuda --unix-socket="$B/gpurpcd.sock" --cache-dir="$B/cache" --drain-timeout=0s > "$B/daemon.log" 2>&1 &
D=$!
for i in $(seq 100); do [ -S "$B/gpurpcd.sock" ] && break; sleep 0.2; done
PYTHONPATH=$PWD/client/python/src timeout 400 python3 client/python/benchmarks/bench_python.py \
  --address="unix:$B/gpurpcd.sock" --cpp-bench=$R/bin/gpurpc_bench_compute > "$OUT/bench-python.log" 2>&1; echo "rc=$?"
grep -vE "^\[" "$OUT/bench-python.log" | tail -40
kill $D; wait $D; cp "$B/daemon.log" "$OUT/bench-daemon.log"
fi
