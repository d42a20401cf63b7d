# syntax=docker/dockerfile:1
# gpurpcd in a container: the daemon on the CUDA backend, listening on 0.0.0.0:50051 with
# TLS and bearer tokens (mounted under /etc/gpurpc), health on 50052.
#
#   docker build -t gpurpc .
#   docker run --rm --gpus all -p 50051:50051 -v /srv/gpurpc/etc:/etc/gpurpc:ro \
#     -v gpurpc-cache:/var/cache/gpurpc -v gpurpc-state:/var/lib/gpurpc gpurpc
#   (/srv/gpurpc/etc holds tls/tls.crt, tls/tls.key and tokens; see README.md, "Security")
#   docker run ... gpurpc --log-level=debug --max-sessions=16 --config=/etc/gpurpc/gpurpcd.conf
#
# Flags after the image name are appended to the ENTRYPOINT's (the last one of a flag wins).
# The GPU needs the NVIDIA Container Toolkit on the host (`--gpus`, or the nvidia runtime in
# Kubernetes: deploy/kubernetes); the driver's libcuda comes from there, NVRTC from the
# runtime image.
#
# Build stage: the same packages as deploy/dev/setup.sh (Ubuntu 24.04 names) and the same
# configuration as deploy/dev/run-daemon.sh and tests/run.sh (Release), without the tests, then
# the relocatable install of cmake/GpurpcInstall.cmake, checked like tests/run.sh checks it.
# GPURPC_CMAKE_ARGS adds configure arguments, e.g. -DCMAKE_PREFIX_PATH=/opt/grpc to build
# against a newer gRPC than Ubuntu's 1.51 (which predates several HTTP/2 DoS fixes) from an
# extra stage.
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04 AS build

ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3008 (pin apt versions): Ubuntu 24.04's archive keeps only the current version of each
# package, so a pin would break the build at its next update; the base image tag pins the rest.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      g++ make cmake pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libseccomp-dev \
      libssl-dev libmicrohttpd-dev \
      libabsl-dev libspdlog-dev \
 && rm -rf /var/lib/apt/lists/*

COPY . /src
ARG GPURPC_CMAKE_ARGS=""
# SC2086: GPURPC_CMAKE_ARGS is split into several arguments on purpose.
# hadolint ignore=SC2086
RUN cmake -S /src -B /build -DCMAKE_BUILD_TYPE=Release -DGPURPC_BUILD_TESTS=OFF \
      ${GPURPC_CMAKE_ARGS} \
 && cmake --build /build --parallel "$(nproc)" \
 && cmake --install /build --prefix /opt/gpurpc --strip \
 && bash /src/deploy/dev/check-install.sh /opt/gpurpc \
 && mkdir -p /opt/gpurpc/cuda \
 && cp -rL /usr/local/cuda/include /opt/gpurpc/cuda/include

# Runtime stage: glibc, libstdc++ and NVRTC from the CUDA runtime image; everything else is in
# /opt/gpurpc. The CUDA headers are copied along so that kernels compiled with NVRTC can
# #include <cuda_fp16.h>, <cuda/std/...> and the like (the runtime image has no headers).
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

LABEL org.opencontainers.image.title="gpurpc" \
      org.opencontainers.image.description="gpurpcd: NVIDIA GPUs over gRPC"

ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# tini: PID 1 that forwards SIGTERM (the daemon drains on it) and reaps orphans. DL3008: as
# in the build stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 gpurpc \
 && useradd --system --uid 10001 --gid gpurpc --no-create-home --home-dir /var/cache/gpurpc \
      --shell /usr/sbin/nologin gpurpc \
 && install -d -o gpurpc -g gpurpc -m 0700 /var/cache/gpurpc /var/lib/gpurpc \
 && install -d -o gpurpc -g gpurpc -m 0750 /run/gpurpc

COPY --from=build /opt/gpurpc /opt/gpurpc

# The daemon dlopen()s libnvrtc.so.13 by name: make sure the loader's cache knows the toolkit's
# library folder (NVIDIA's packages normally register it already).
# (grep without -q: it reads all of ldconfig's output, so pipefail never sees a SIGPIPE.)
RUN ldconfig -p | grep 'libnvrtc\.so\.13' > /dev/null \
 || { echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/zz-gpurpc-cuda.conf && ldconfig; } \
 && ldconfig -p | grep 'libnvrtc\.so\.13' \
 && /opt/gpurpc/bin/gpurpcd --help > /dev/null

# The user gpurpc, by number so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
WORKDIR /var/cache/gpurpc
# The compile cache and its MAC key (kept apart, so that the cache alone cannot forge it).
VOLUME ["/var/cache/gpurpc", "/var/lib/gpurpc"]
EXPOSE 50051 50052
# Secure by default: TLS and bearer tokens from files the operator mounts under /etc/gpurpc
# (the daemon refuses to start without them, saying which is missing); health and reflection
# on 50052 without credentials, for probes.
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/gpurpc/bin/gpurpcd", \
            "--listen=0.0.0.0:50051", "--backend=cuda", "--cache-dir=/var/cache/gpurpc", \
            "--cache-key-file=/var/lib/gpurpc/cache.key", \
            "--unix-socket=/run/gpurpc/gpurpcd.sock", "--health-listen=0.0.0.0:50052", \
            "--tls-cert=/etc/gpurpc/tls/tls.crt", "--tls-key=/etc/gpurpc/tls/tls.key", \
            "--tokens-file=/etc/gpurpc/tokens", \
            "--cuda-include-dir=/opt/gpurpc/cuda/include"]
CMD []
