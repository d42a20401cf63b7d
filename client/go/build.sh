#!/usr/bin/env bash
# client/go/build.sh OUT — generates the Go code of the gpurpc.v1 API from proto/ and builds
# client/go/example into OUT/gpurpc-go-example, offline, from Debian's packages:
#   golang-go, golang-google-grpc-dev, golang-google-protobuf-dev (protoc-gen-go is built from
#   its source), protoc-gen-go-grpc, protobuf-compiler.
# GOPATH mode (GO111MODULE=off): the generated package is "gpurpc/v1" under OUT/gopath/src,
# and grpc and protobuf come from /usr/share/gocode. Any Go setup with modules works the same
# with a go_package mapping of its own (the M options below).
set -euo pipefail
here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd -- "$here/../.." && pwd -P)
out=$(mkdir -p -- "${1:?usage: build.sh OUT}" && cd -- "${1}" && pwd -P)
export GO111MODULE=off GOFLAGS= GOPATH="$out/gopath:/usr/share/gocode" GOCACHE="$out/gocache"
for tool in go protoc protoc-gen-go-grpc; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing (see the header)" >&2; exit 1; }
done
[[ -d /usr/share/gocode/src/google.golang.org/grpc ]] ||
  { echo "build.sh: golang-google-grpc-dev is missing" >&2; exit 1; }

go build -o "$out/bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go

gen="$out/gopath/src/gpurpc/v1"
rm -rf -- "$gen" && mkdir -p -- "$gen"
protos=()
mappings=()
for proto in "$repo"/proto/gpurpc/v1/*.proto; do
  rel=gpurpc/v1/$(basename -- "$proto")
  protos+=("$rel")
  mappings+=("M$rel=gpurpc/v1;gpurpcv1")
done
go_opts=$(IFS=,; echo "${mappings[*]}")
PATH="$out/bin:$PATH" protoc --proto_path="$repo/proto" \
  --go_out="$gen" --go_opt=paths=source_relative,"$go_opts" \
  --go-grpc_out="$gen" --go-grpc_opt=paths=source_relative,"$go_opts" \
  "${protos[@]}"
# paths=source_relative writes gpurpc/v1/*.go below $gen: flatten into the package folder.
mv "$gen"/gpurpc/v1/*.go "$gen"/ && rm -rf -- "$gen/gpurpc"

mkdir -p -- "$out/gopath/src/gpurpc-go-example"
cp "$here/example/main.go" "$out/gopath/src/gpurpc-go-example/"
go vet gpurpc-go-example
go build -o "$out/gpurpc-go-example" gpurpc-go-example
echo "build.sh: built $out/gpurpc-go-example"
