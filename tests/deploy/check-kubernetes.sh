#!/usr/bin/env bash
# check-kubernetes.sh — validates deploy/kubernetes and the Dockerfile offline; exits non-zero
# when anything fails (every part runs, so one run shows every problem).
#
#   bash tests/deploy/check-kubernetes.sh [GPURPCD]
#
# 1. yamllint (deploy/kubernetes/.yamllint) over every YAML file of deploy/kubernetes.
# 2. tests/deploy's own tests (the renderer, check_manifests.py, pod_sim.py's scrape), then
#    renders the base and each overlay with tests/deploy/kustomize_render.py (no kustomize in
#    Debian 12 or on PyPI), in a scratch copy where make-credentials.sh has made the
#    credentials the overlays' secretGenerators read. Where kubectl is installed, renders
#    with `kubectl kustomize` too and requires the very same objects.
# 3. kubernetes-validate --strict against the oldest Kubernetes the manifests need (1.27: gRPC
#    probes) and the newest the pinned kubernetes-validate ships, on every rendered object and
#    on base/secret.example.yaml; its schemas ship in the package, nothing is fetched.
# 4. tests/deploy/check_manifests.py: the daemon's view (probes on its health port, drain vs
#    grace period, non-root read-only pod, paths the daemon accepts, Secret keys, selectors,
#    the metrics port and annotations against metrics_listen, the NetworkPolicy).
# 5. With GPURPCD (a built gpurpcd; default $GPURPCD_BIN): the daemon parses each rendered
#    configuration file, and tests/deploy/pod_sim.py runs the example overlay's pod on this
#    machine (the fake backend), uses it over TLS with a generated token and scrapes its
#    /metrics over HTTP.
# 6. hadolint on the Dockerfile.
#
# Needs python3 with PyYAML, grpcio and pytest (and the gpurpc package for pod_sim.py),
# yamllint, kubernetes-validate, hadolint, openssl (deploy/dev/setup.sh installs them,
# pinned). KUBERNETES_VERSIONS overrides the Kubernetes versions.
set -uo pipefail

repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd -P)
cd "$repo_root" || exit 1
python=${PYTHON:-python3}
daemon=${1:-${GPURPCD_BIN:-}}
versions=${KUBERNETES_VERSIONS:-"1.27.0 1.37.0"}
here=tests/deploy
k8s=deploy/kubernetes

failures=()
part() { echo "--- check-kubernetes: $*"; }
failed() { failures+=("$1"); echo "check-kubernetes: FAILED: $1" >&2; }

# Where pip put the tools' commands (a --user install's bin is often not on PATH).
PATH="$("$python" -c 'import site, sysconfig
print(sysconfig.get_path("scripts") + ":" + site.getuserbase() + "/bin")' 2>/dev/null):$PATH"
missing=()
for tool in yamllint kubernetes-validate hadolint openssl; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
"$python" -c 'import yaml, grpc, pytest' 2>/dev/null || missing+=("python modules yaml/grpc/pytest")
if ((${#missing[@]})); then
  echo "check-kubernetes: missing ${missing[*]} (bash deploy/dev/setup.sh installs them)" >&2
  exit 1
fi

scratch=$(mktemp -d /tmp/gpurpc-k8s.XXXXXX)
trap 'rm -rf -- "$scratch"' EXIT

part "yamllint $(yamllint --version | cut -d' ' -f2)"
mapfile -t yaml_files < <(find "$k8s" -name '*.yaml' -o -name '*.yml' | sort)
if ((${#yaml_files[@]} == 0)); then
  failed "no YAML files under $k8s"
elif yamllint --strict -c "$k8s/.yamllint" "${yaml_files[@]}" "$k8s/.yamllint"; then
  echo "${#yaml_files[@]} files clean"
else
  failed yamllint
fi

part "tests/deploy's own tests (the renderer, check_manifests.py, pod_sim.py's scrape)"
"$python" -m pytest "$here" -q -p no:cacheprovider || failed "pytest $here"

part "render (tests/deploy/kustomize_render.py)"
cp -r "$k8s" "$scratch/kubernetes"
rm -rf -- "$scratch"/kubernetes/overlays/*/credentials   # a developer's own: never used here
# The example overlay's credentials, made as its kustomization.yaml says.
if ! bash "$k8s/make-credentials.sh" --namespace gpu-services --dns gpurpc.example.com \
  --tenant alice --tenant ci-runner "$scratch/kubernetes/overlays/example/credentials" \
  >"$scratch/credentials.log" 2>&1; then
  cat "$scratch/credentials.log"
  failed "make-credentials.sh"
fi
mapfile -t kustomizations < <(cd "$scratch/kubernetes" && find . -name kustomization.yaml \
  -printf '%h\n' | sed 's|^\./||' | sort)
rendered=()
for dir in "${kustomizations[@]}"; do
  out="$scratch/rendered-${dir//\//-}.yaml"
  if "$python" "$here/kustomize_render.py" "$scratch/kubernetes/$dir" >"$out"; then
    echo "$dir: $(grep -c '^kind:' "$out") objects"
    rendered+=("$dir")
  else
    failed "render $dir"
  fi
done
((${#rendered[@]} >= 2)) || failed "expected the base and an overlay, rendered: ${rendered[*]}"

if command -v kubectl >/dev/null; then
  part "cross-check against kubectl kustomize ($(kubectl version --client 2>/dev/null |
    sed -n 's/^Kustomize Version: //p'))"
  for dir in "${rendered[@]}"; do
    theirs="$scratch/kubectl-${dir//\//-}.yaml"
    if ! kubectl kustomize "$scratch/kubernetes/$dir" >"$theirs"; then
      failed "kubectl kustomize $dir"
      continue
    fi
    if "$python" - "$scratch/rendered-${dir//\//-}.yaml" "$theirs" <<'EOF'; then
import sys, yaml
def load(path):
    objs = [o for o in yaml.safe_load_all(open(path)) if o]
    return {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objs}
mine, theirs = load(sys.argv[1]), load(sys.argv[2])
bad = sorted(set(mine) ^ set(theirs)) + sorted(k for k in mine.keys() & theirs.keys()
                                              if mine[k] != theirs[k])
for key in bad:
    print(f"differs from kubectl kustomize: {key}")
sys.exit(1 if bad else 0)
EOF
      echo "$dir: the same objects"
    else
      failed "renderer vs kubectl kustomize: $dir"
    fi
  done
else
  part "kubectl not installed: the renderer's output is not cross-checked here"
fi

for version in $versions; do
  part "kubernetes-validate --strict -k $version"
  files=("$k8s/base/secret.example.yaml")
  for dir in "${rendered[@]}"; do files+=("$scratch/rendered-${dir//\//-}.yaml"); done
  if ! kubernetes-validate --strict --quiet -k "$version" "${files[@]}"; then
    failed "kubernetes-validate $version"
  else
    echo "${#files[@]} files valid"
  fi
done

part "check_manifests.py"
for dir in "${rendered[@]}"; do
  extra=()
  [[ "$dir" == base ]] && extra=(--secret "$k8s/base/secret.example.yaml")
  if "$python" "$here/check_manifests.py" "$scratch/rendered-${dir//\//-}.yaml" "${extra[@]}" \
    --write-config "$scratch/configs"; then
    echo "$dir: ok"
  else
    failed "check_manifests.py $dir"
  fi
done

if [[ -n "$daemon" ]]; then
  part "the daemon parses each configuration ($daemon)"
  for conf in "$scratch"/configs/*.conf; do
    if [[ ! -f "$conf" ]]; then
      failed "no configuration was extracted"
      break
    fi
    if "$daemon" --config="$conf" --new-token=config-check >/dev/null; then
      echo "$(basename "$conf"): parsed"
    else
      failed "gpurpcd --config $(basename "$conf")"
    fi
  done
  part "the example overlay's pod, simulated (tests/deploy/pod_sim.py)"
  mkdir "$scratch/pod"
  chmod 0755 "$scratch"   # the pod's user (10001) must reach it; credentials stay 0700
  if [[ " ${rendered[*]} " != *" overlays/example "* ]]; then
    failed "pod_sim.py: the example overlay did not render"
  elif ! timeout 300 "$python" "$here/pod_sim.py" --daemon "$daemon" \
    --rendered "$scratch/rendered-overlays-example.yaml" \
    --credentials "$scratch/kubernetes/overlays/example/credentials" --tenant alice \
    --work "$scratch/pod"; then
    failed "pod_sim.py"
  fi
else
  failed "no gpurpcd given (argument or GPURPCD_BIN): configurations and the pod not checked"
fi

part "hadolint $(hadolint --version | sed 's/.* //')"
if hadolint --no-color --failure-threshold info Dockerfile; then
  echo "Dockerfile clean"
else
  failed hadolint
fi

echo
if ((${#failures[@]})); then
  echo "check-kubernetes: FAILED: ${failures[*]}"
  exit 1
fi
echo "check-kubernetes: all checks passed"
