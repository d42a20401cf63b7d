#!/usr/bin/env bash
# make-credentials.sh — makes what the Secret gpurpc-credentials holds, with openssl alone:
# a CA, a server certificate for the daemons (signed by it) and bearer tokens. Nothing here is
# ever committed; the folder is created mode 0700 and an existing file is never overwritten.
#
#   deploy/kubernetes/make-credentials.sh [options] OUTDIR
#
# Options:
#   --namespace NS    the namespace of the Service (default gpurpc)
#   --service NAME    the headless Service's name (default gpurpc)
#   --tenant NAME     a tenant to make a token for (repeatable; default: one token, "default")
#   --dns NAME        another name the certificate must carry, e.g. the LoadBalancer's
#                     (repeatable)
#   --ip ADDRESS      another IP address the certificate must carry (repeatable)
#   --days N          validity of the certificates (default 365)
#
# OUTDIR then holds:
#   tls.crt, tls.key  the daemons' certificate and key  (into the Secret)
#   tokens            tenant:salt_hex:sha256_hex lines  (into the Secret)
#   ca.crt            what clients trust (GPURPC_TLS_CA); not secret
#   ca.key            signs further certificates: keep it off the cluster
#   token.TENANT      each tenant's bearer token (GPURPC_TOKEN_FILE); give it to that tenant
#
# The certificate names the Service (NAME, NAME.NS, NAME.NS.svc, NAME.NS.svc.cluster.local),
# each pod under it (*.NAME.NS.svc[.cluster.local]) and localhost/127.0.0.1 (kubectl
# port-forward). The token lines are those `gpurpcd --new-token=TENANT` prints: a 16-byte
# random salt and SHA-256(salt || token).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "make-credentials.sh: $*" >&2; exit 2; }

namespace=gpurpc
service=gpurpc
days=365
tenants=()
extra_dns=()
extra_ip=()
outdir=
while (($#)); do
  case $1 in
    --namespace) namespace=${2:?--namespace needs a value}; shift 2 ;;
    --service) service=${2:?--service needs a value}; shift 2 ;;
    --tenant) tenants+=("${2:?--tenant needs a value}"); shift 2 ;;
    --dns) extra_dns+=("${2:?--dns needs a value}"); shift 2 ;;
    --ip) extra_ip+=("${2:?--ip needs a value}"); shift 2 ;;
    --days) days=${2:?--days needs a value}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *)
      [[ -z "$outdir" ]] || die "one OUTDIR only (got '$outdir' and '$1')"
      outdir=$1
      shift
      ;;
  esac
done
[[ -n "$outdir" ]] || die "no OUTDIR given (see --help)"
((${#tenants[@]})) || tenants=(default)
command -v openssl >/dev/null || die "openssl is not installed"

dns_label='^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'
[[ "$namespace" =~ $dns_label ]] || die "--namespace '$namespace' is not a DNS label"
[[ "$service" =~ $dns_label ]] || die "--service '$service' is not a DNS label"
[[ "$days" =~ ^[1-9][0-9]{0,4}$ ]] || die "--days '$days' is not a number of days"
for tenant in "${tenants[@]}"; do
  # The daemon's tenant names (server/options.cc, IsTenantName), less ',' (a file name here).
  [[ "$tenant" =~ ^[A-Za-z0-9._@+=-]{1,128}$ ]] ||
    die "--tenant '$tenant': use 1 to 128 of A-Z a-z 0-9 . _ @ + - ="
done
for name in "${extra_dns[@]}"; do
  [[ "$name" =~ ^(\*\.)?[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$ ]] ||
    die "--dns '$name' is not a DNS name"
done
for address in "${extra_ip[@]}"; do
  [[ "$address" =~ ^[0-9A-Fa-f:.]+$ ]] || die "--ip '$address' is not an IP address"
done

mkdir -p -- "$outdir"
chmod 0700 -- "$outdir"
for file in ca.crt ca.key tls.crt tls.key tokens "${tenants[@]/#/token.}"; do
  [[ ! -e "$outdir/$file" ]] || die "$outdir/$file exists: not overwriting credentials"
done
umask 077
work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT

sans="DNS:$service,DNS:$service.$namespace,DNS:$service.$namespace.svc"
sans+=",DNS:$service.$namespace.svc.cluster.local"
sans+=",DNS:*.$service.$namespace.svc,DNS:*.$service.$namespace.svc.cluster.local"
sans+=",DNS:localhost,IP:127.0.0.1"
for name in "${extra_dns[@]}"; do sans+=",DNS:$name"; done
for address in "${extra_ip[@]}"; do sans+=",IP:$address"; done

ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${ec[@]}" -keyout "$work/ca.key" -out "$work/ca.crt" -days "$days" \
  -subj "/CN=gpurpc CA ($namespace)" \
  -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req -new "${ec[@]}" -keyout "$work/tls.key" -out "$work/tls.csr" \
  -subj "/CN=$service.$namespace.svc" 2>/dev/null
cat >"$work/server.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$sans
EOF
openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" -days "$days" -extfile "$work/server.ext" \
  -out "$work/tls.crt" 2>/dev/null
openssl verify -CAfile "$work/ca.crt" "$work/tls.crt" >/dev/null

: >"$work/tokens"
for tenant in "${tenants[@]}"; do
  token="gpurpc_$(openssl rand -hex 32)"
  salt=$(openssl rand -hex 16)
  # SHA-256 over the salt's bytes followed by the token: printf turns \xHH into bytes.
  salt_escaped=
  for ((i = 0; i < ${#salt}; i += 2)); do salt_escaped+="\\x${salt:i:2}"; done
  digest=$(printf "${salt_escaped}%s" "$token" | openssl dgst -sha256 -r)
  printf '%s:%s:%s\n' "$tenant" "$salt" "${digest%% *}" >>"$work/tokens"
  printf '%s\n' "$token" >"$work/token.$tenant"
done

for file in ca.crt ca.key tls.crt tls.key tokens "${tenants[@]/#/token.}"; do
  mv -- "$work/$file" "$outdir/$file"
done
chmod 0644 -- "$outdir/ca.crt"
echo "make-credentials.sh: wrote $outdir: tls.crt tls.key tokens (the Secret), ca.crt (clients)," \
  "ca.key (keep offline), token.{$(IFS=,; echo "${tenants[*]}")}"
echo "make-credentials.sh: the certificate names ${sans//DNS:/}"
