#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/).

The seeds are realistic, valid inputs: kernels as clients send them, PTX and a cubin from
NVRTC (it runs without a GPU), a fatbin from the toolkit's fatbinary, serialized command
batches, token lines and daemon configurations. Run it from anywhere after a change to an
input format; it rewrites the generated seeds (seed-*) and leaves other files alone:

    python3 tests/fuzz/make_corpus.py [--cuda-root /usr/local/cuda]

Needs NVRTC and fatbinary from the CUDA toolkit, and the Python protobuf package (the
generated gpurpc modules come from client/python/src).
"""

import argparse
import ctypes
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "client" / "python" / "src"))

from gpurpc.v1 import common_pb2, execution_service_pb2  # noqa: E402


class Provider:
    """Builds input bytes that libFuzzer's FuzzedDataProvider reads back as the given values.

    Integers and bools are taken from the end of the data, most significant byte first;
    strings (ConsumeRandomLengthString) and the remaining bytes from the front.
    """

    def __init__(self):
        self.front = bytearray()
        self.back = []  # in the order they are consumed

    def integer(self, low, high, value):
        assert low <= value <= high
        span, offset, digits = high - low, 0, []
        while offset < 64 and (span >> offset) > 0:
            digits.append(offset)
            offset += 8
        encoded = value - low
        for shift in reversed(digits):
            self.back.append((encoded >> shift) & 0xFF)
        return self

    def boolean(self, value):
        self.back.append(1 if value else 0)
        return self

    def string(self, text):
        self.front += text.replace(b"\\", b"\\\\") + b"\\ "
        return self

    def rest(self, data):
        self.front += data
        return self

    def data(self):
        return bytes(self.front) + bytes(reversed(self.back))


def write(target, name, data):
    folder = HERE / "corpus" / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"seed-{name}").write_bytes(data)


# ----------------------------------------------------------------------- NVRTC

SAXPY = b"""extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""

GLOBALS = b"""#include "params.h"
__device__ float table[256];
__device__ int counter = 0;
__device__ double4 grid[2][8];
__constant__ float coefficients[16];
extern "C" __global__ void scale(float* data, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] *= table[i % 256] * coefficients[i % 16] + grid[0][i % 8].x;
  atomicAdd(&counter, 1);
}
"""


def nvrtc(cuda_root):
    for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
        path = pathlib.Path(cuda_root) / "lib64" / name
        if path.exists():
            return ctypes.CDLL(str(path))
    sys.exit(f"make_corpus.py: no libnvrtc under {cuda_root}/lib64")


def compile_cuda(lib, source, arch, headers=()):
    prog = ctypes.c_void_p()
    names = (ctypes.c_char_p * len(headers))(*[h[0] for h in headers])
    contents = (ctypes.c_char_p * len(headers))(*[h[1] for h in headers])
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"kernel.cu", len(headers),
                                contents, names)
    assert rc == 0, rc
    options = [f"--gpu-architecture={arch}".encode()]
    opts = (ctypes.c_char_p * len(options))(*options)
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    if arch.startswith("sm_"):
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, out)
    else:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, out)
    return out.raw[: size.value]


# --------------------------------------------------------------- fuzz_module_image

HAND_PTX = [
    # The declarations ptx_globals.h describes.
    b""".version 8.0
.target sm_75
.address_size 64
.global .align 4 .b8 name[16];
.visible .const .align 8 .u64 table[4] = {1, 2, 3, 4};
.extern .global .v4 .f32 grid[2][8];
.global .u32 a = 1, b[4];
.global .align 16 .b8 bytes[] = {1, 2, 3};
.global .texref tex;
.visible .entry k(.param .u64 p)
{
\t.local .align 8 .b8 scratch[64];
\t.global .u32 inside;
\tret;
}
""",
    # What the fake runs: its built-in kernels with their parameter layouts.
    b""".version 9.0
.target sm_75
.address_size 64
.visible .entry fill_u32(.param .u64 out, .param .u32 value, .param .u64 n)
{
\tret;
}
.visible .entry axpy_f32(.param .f32 a, .param .u64 x, .param .u64 y, .param .u64 n)
{
\tret;
}
""",
]


def module_image_seeds(lib, cuda_root):
    ptx = compile_cuda(lib, SAXPY, "compute_75")
    write("fuzz_module_image", "saxpy.ptx", ptx)
    globals_ptx = compile_cuda(lib, GLOBALS, "compute_75",
                               [(b"params.h", b"#define N 256\n")])
    write("fuzz_module_image", "globals.ptx", globals_ptx)
    cubin = compile_cuda(lib, GLOBALS, "sm_90", [(b"params.h", b"#define N 256\n")])
    write("fuzz_module_image", "globals-sm_90.cubin", cubin)
    for i, text in enumerate(HAND_PTX):
        write("fuzz_module_image", f"hand-{i}.ptx", text)
    fatbinary = pathlib.Path(cuda_root) / "bin" / "fatbinary"
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "k.cubin").write_bytes(cubin)
        (pathlib.Path(tmp) / "k.ptx").write_bytes(globals_ptx.rstrip(b"\0"))
        out = pathlib.Path(tmp) / "k.fatbin"
        subprocess.run([str(fatbinary), "--64", f"--create={out}", "--compress=false",
                        "--image3=kind=elf,sm=90,file=" + str(pathlib.Path(tmp) / "k.cubin"),
                        "--image3=kind=ptx,sm=75,file=" + str(pathlib.Path(tmp) / "k.ptx")],
                       check=True)
        write("fuzz_module_image", "globals.fatbin", out.read_bytes())


# -------------------------------------------------------------- fuzz_compile_checks

SOURCES = {
    "saxpy": SAXPY,
    "toolkit": b"""#include <cuda_fp16.h>
#include <curand_kernel.h>
#include "my/params.h"
#if __has_include(<cuda/std/cstdint>)
#include <cuda/std/cstdint>
#endif
extern "C" __global__ void k(__half* out) { out[threadIdx.x] = __float2half(1.0f); }
""",
    "literals": b"""// a comment with #include "/etc/passwd" in it
/* a block comment
#include "../secret.h"
*/
const char* s = "#include </etc/shadow>";
const char* r = R"raw(
#include "../../x"
)raw";
int n = 1'000'000;
char c = '"';
#define STR(x) #x
%:include "digraph.h"
#  include_next <next.h>
extern "C" __global__ void k(int* p) { *p = n; }
""",
    "continued": b"""#inc\\
lude "split\\
.h"
#pragma once
extern "C" __global__ void k() {}
""",
}

OPTIONS = [
    [b"--gpu-architecture=sm_90", b"--std=c++17", b"-lineinfo", b"--use_fast_math"],
    [b"-arch", b"compute_75", b"-default-device", b"-DN=256", b"-UDEBUG"],
    [b"-Xptxas=-v,-O3", b"--ptxas-options=--warn-on-spills", b"--maxrregcount=64"],
    [b"--relocatable-device-code=false", b"-w", b"--fmad=true", b"--extra-device-vectorization"],
]


def compile_checks_seeds():
    for name, text in SOURCES.items():
        write("fuzz_compile_checks", f"source-{name}", b"0" + text)
    for i, options in enumerate(OPTIONS):
        write("fuzz_compile_checks", f"options-{i}", b"2" + b"\0".join(options))
    for name in (b"params.h", b"my/params.h", b"sub/dir/kernel.cuh"):
        write("fuzz_compile_checks", "name-" + name.decode().replace("/", "_"), b"3" + name)
    # A generated source (mode 1): the generator's choices for code, a string literal and
    # an #include directive.
    p = Provider()
    p.integer(1, 24, 3)
    p.integer(0, 10, 0).integer(0, 20, 0)
    p.integer(0, 10, 3).integer(0, 8, 1).boolean(True).integer(0, 12, 2)
    p.integer(0, 18, 0).integer(0, 18, 6).integer(0, 4, 0)
    p.integer(0, 10, 9).integer(0, 6, 0).integer(0, 3, 0).integer(0, 6, 0).integer(0, 4, 1)
    write("fuzz_compile_checks", "generated-0", b"1" + p.data())


# --------------------------------------------------------------- fuzz_command_batch

def pointer(buffer=None, offset=0, address=None):
    p = common_pb2.DevicePointer()
    if address is not None:
        p.device_address = address
    else:
        p.buffer.buffer_id = buffer
        p.buffer.offset_bytes = offset
    return p


def command_batch_seeds():
    E = execution_service_pb2
    # Symbolic handles (fuzz_command_batch.cc): buffers 1 (4096 bytes), 2 (256), 3 (1),
    # stream 4, event 5, module 6, kernels 7..13, freed buffer 14, untimed event 15,
    # arrays 16 (2D float 24 x 10) and 17 (3D uchar2 7 x 5 x 3); addresses below 2^20 are near
    # a buffer's start.
    batch = E.CommandBatch()
    c = batch.commands.add(sequence=1)
    c.upload.destination.CopyFrom(pointer(1, 0))
    c.upload.data = bytes(range(64))
    c = batch.commands.add(sequence=2)
    c.memset.destination.CopyFrom(pointer(2, 0))
    c.memset.value, c.memset.element_size_bytes, c.memset.count = 7, 4, 64
    c = batch.commands.add(sequence=3)
    c.copy.destination.CopyFrom(pointer(2, 0))
    c.copy.source.CopyFrom(pointer(1, 0))
    c.copy.size_bytes, c.copy.stream_id = 64, 4
    c = batch.commands.add(sequence=4)
    c.launch.function_id = 9  # fill_u32
    c.launch.grid.x, c.launch.grid.y, c.launch.grid.z = 1, 1, 1
    c.launch.block.x, c.launch.block.y, c.launch.block.z = 64, 1, 1
    c.launch.args.add().buffer.buffer_id = 1
    c.launch.args.add().u32 = 42
    c.launch.args.add().u64 = 64
    c = batch.commands.add(sequence=5)
    c.record_event.event_id, c.record_event.stream_id = 5, 4
    c = batch.commands.add(sequence=6)
    c.wait_event.event_id, c.wait_event.stream_id = 5, 0
    c = batch.commands.add(sequence=7)
    c.download.source.CopyFrom(pointer(address=0x10000 + 128))  # buffer 2 at offset 0
    c.download.size_bytes = 256
    c = batch.commands.add(sequence=8)
    c.sync.whole_session = True
    write("fuzz_command_batch", "batch-mixed", b"\0" + batch.SerializeToString())

    batch = E.CommandBatch()
    c = batch.commands.add(sequence=10)
    c.launch.function_id = 7  # multiply_them, packed
    c.launch.grid.x = c.launch.grid.y = c.launch.grid.z = 1
    c.launch.block.x, c.launch.block.y, c.launch.block.z = 16, 1, 1
    c.launch.packed_args = b"".join(
        (128 + off).to_bytes(8, "little") for off in (0, 1024, 2048))
    c = batch.commands.add(sequence=11)
    c.sync.stream_id = 0
    c = batch.commands.add(sequence=12)
    c.launch.function_id = 13  # spin_us (the harness makes it 0 us)
    c.launch.grid.x = c.launch.grid.y = c.launch.grid.z = 1
    c.launch.block.x = c.launch.block.y = c.launch.block.z = 1
    c.launch.args.add().u64 = 1000000
    write("fuzz_command_batch", "batch-launches", b"\0" + batch.SerializeToString())

    request = E.LaunchRequest()
    request.launch.function_id = 8  # axpy_f32
    request.launch.grid.x = request.launch.grid.y = request.launch.grid.z = 1
    request.launch.block.x, request.launch.block.y, request.launch.block.z = 32, 1, 1
    request.launch.args.add().f32 = 2.0
    request.launch.args.add().buffer.buffer_id = 1
    a = request.launch.args.add()
    a.buffer.buffer_id, a.buffer.offset_bytes = 1, 2048
    request.launch.args.add().u64 = 32
    request.launch.stream_id = 4
    write("fuzz_command_batch", "launch-axpy", b"\1" + request.SerializeToString())

    # 3D copies: buffer 1 into array 16 at (8 bytes, row 2), array to array, array 17 out to
    # pitched memory in buffer 1, and one that leaves the array (refused).
    batch = E.CommandBatch()
    c = batch.commands.add(sequence=20)
    c.copy_3d.destination.array_id, c.copy_3d.destination.x_bytes = 16, 8
    c.copy_3d.destination.y = 2
    c.copy_3d.source.device.CopyFrom(pointer(1, 0))
    c.copy_3d.source.pitch_bytes = 100
    c.copy_3d.width_bytes, c.copy_3d.height, c.copy_3d.depth = 40, 4, 1
    c = batch.commands.add(sequence=21)
    c.copy_3d.destination.array_id = 17
    c.copy_3d.source.array_id = 16
    c.copy_3d.width_bytes, c.copy_3d.height, c.copy_3d.depth = 14, 5, 1
    c.copy_3d.stream_id = 4
    c = batch.commands.add(sequence=22)
    c.copy_3d.destination.device.CopyFrom(pointer(1, 64))
    c.copy_3d.destination.pitch_bytes, c.copy_3d.destination.height = 16, 6
    c.copy_3d.source.array_id = 17
    c.copy_3d.width_bytes, c.copy_3d.height, c.copy_3d.depth = 14, 5, 3
    c = batch.commands.add(sequence=23)
    c.copy_3d.destination.array_id, c.copy_3d.destination.z = 17, 2
    c.copy_3d.source.device.CopyFrom(pointer(2, 0))
    c.copy_3d.width_bytes, c.copy_3d.height, c.copy_3d.depth = 14, 5, 2
    c = batch.commands.add(sequence=24)
    c.sync.whole_session = True
    write("fuzz_command_batch", "batch-copy-3d", b"\0" + batch.SerializeToString())

    # Packed arguments (mode 2): fill_u32 of buffer 1, copy_bytes from buffer 1 to 2.
    p = Provider().integer(0, 6, 2)
    for value, high in ((1, 8), (1, 2), (1, 2), (64, 1100), (1, 2), (1, 2)):
        p.integer(0, high, value)
    p.boolean(True).integer(0, 5, 0)
    p.rest((128).to_bytes(8, "little") + (5).to_bytes(4, "little") + bytes(4) +
           (64).to_bytes(8, "little"))
    write("fuzz_command_batch", "packed-fill", b"\2" + p.data())
    p = Provider().integer(0, 6, 4)
    for value, high in ((1, 8), (1, 2), (1, 2), (256, 1100), (1, 2), (1, 2)):
        p.integer(0, high, value)
    p.boolean(True).integer(0, 5, 4)
    p.rest((0x10000 + 128).to_bytes(8, "little") + (128).to_bytes(8, "little") +
           (256).to_bytes(8, "little"))
    write("fuzz_command_batch", "packed-copy", b"\2" + p.data())

    # Pointers to resolve (mode 3): buffer 1 + 4000 for 96 bytes, the address of buffer 3
    # for 1 byte, and the global's last byte.
    p = Provider()
    p.integer(0, 2, 0).integer(0, 17, 1).boolean(True).integer(0, 5000, 4000)
    p.boolean(True).integer(0, 5000, 96)
    p.integer(0, 2, 1).integer(0, 2**64 - 1, 0x20000 + 128).integer(0, 63, 0)
    p.boolean(True).integer(0, 5000, 1)
    p.integer(0, 2, 1).integer(0, 2**64 - 1, 0x30000 + 128 + 63).integer(0, 63, 0)
    p.boolean(True).integer(0, 5000, 1)
    write("fuzz_command_batch", "resolve", b"\3" + p.data())


# -------------------------------------------------------------------- fuzz_metadata

TOKENS = [b"gpurpc_fuzz_token_alice", b"gpurpc_fuzz_token_bob"]  # fuzz_metadata.cc


def metadata_seeds():
    # Session ids (mode 0).
    for i, value in enumerate((b"12345678901234567890", b"1", b" 42 ")):
        p = Provider().integer(0, 3, 1).boolean(True).string(value).string(b"alice")
        write("fuzz_metadata", f"session-id-{i}", b"\0" + p.data())
    # Bearer tokens (mode 1): a known token, and a token with a stray suffix.
    p = Provider().integer(0, 3, 1).integer(0, 3, 0).integer(0, 6, 0).integer(0, 4, 0)
    p.integer(0, 1, 1)
    write("fuzz_metadata", "bearer-valid", b"\1" + p.data())
    p = Provider().integer(0, 3, 1).integer(0, 3, 0).integer(0, 6, 0).integer(0, 4, 1)
    p.integer(0, 1, 0).string(b"x")
    write("fuzz_metadata", "bearer-suffix", b"\1" + p.data())
    # A tokens file (mode 2), as gpurpcd --new-token prints its lines.
    salt = bytes(range(16))
    line = b"alice:" + salt.hex().encode() + b":" + hashlib.sha256(salt + TOKENS[0]).hexdigest().encode()
    write("fuzz_metadata", "tokens-file",
          b"\2# tenants\n" + line + b"\n\n  bob@lab:0A0b:" + b"F" * 64 + b"  \n")
    # Daemon configurations (mode 3): the shipped example and a small one.
    write("fuzz_metadata", "config-example",
          b"\3" + (REPO / "deploy" / "config" / "gpurpcd.conf").read_bytes())
    write("fuzz_metadata", "config-small", b"\3" + b"""listen: "127.0.0.1:50051"
tokens_file: "/etc/gpurpc/tokens"
backend: "fake"
fake_memory_bytes: 1073741824
compile_timeout: "1m30s"
tenant_quotas { key: "bob" value { max_sessions: 2 } }
""")
    # Flags (mode 4).
    flags = [b"--listen=localhost:50051", b"--tokens-file", b"/etc/gpurpc/tokens",
             b"--backend=fake", b"--session-idle-timeout=5m", b"--unix-socket-mode=0600",
             b"--admin-tenants=root,ops", b"--insecure=false", b"--log-level=debug"]
    write("fuzz_metadata", "flags", b"\4" + b"\0".join(flags))
    write("fuzz_metadata", "flags-worker", b"\4" + b"\0".join(
        [b"--internal-worker", b"--worker-fd=3", b"--device=0", b"--compile-timeout=60s"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-root", default=os.environ.get("GPURPC_CUDA_ROOT", "/usr/local/cuda"))
    args = parser.parse_args()
    lib = nvrtc(args.cuda_root)
    for target in ("fuzz_compile_checks", "fuzz_module_image", "fuzz_command_batch",
                   "fuzz_metadata"):
        for old in (HERE / "corpus" / target).glob("seed-*"):
            old.unlink()
    module_image_seeds(lib, args.cuda_root)
    compile_checks_seeds()
    command_batch_seeds()
    metadata_seeds()


if __name__ == "__main__":
    main()
