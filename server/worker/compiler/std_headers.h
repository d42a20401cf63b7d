// The C and C++ standard headers kernels commonly include, for NVRTC, which ships none of
// them. PyCUDA compiled with nvcc, where `#include <stdio.h>` (for printf), <stdint.h>,
// <math.h>, <limits> or <type_traits> just worked; under NVRTC each is "cannot open source
// file". The compiler offers these shims as in-memory headers with every compile:
//
//   C:   assert.h float.h limits.h math.h stddef.h stdint.h stdio.h stdlib.h string.h
//   C++: cassert cfloat climits cmath cstddef cstdint cstdio cstdlib cstring, and
//        algorithm array atomic bit chrono complex functional initializer_list iterator limits
//        memory numbers numeric optional ratio span tuple type_traits utility variant
//
// What they give is what device code can have: the C headers declare what NVRTC has built in
// (printf, malloc/free, memcpy/memset, the CUDA math functions) plus macros and typedefs
// (INT_MAX, FLT_MAX, INFINITY, M_PI, uint32_t, size_t ...) and a few str* functions; the C++
// headers are libcu++'s <cuda/std/X> with its names visible as std:: as well (std::
// numeric_limits, std::is_same_v, std::complex, std::pair ...), and std::sqrt & co. name
// NVRTC's own math functions. No file I/O, no iostream, no std::string, no containers that
// allocate. One known limit: after <complex> (which brings libcu++'s own float overloads),
// `using namespace std;` with an unqualified sqrt(float) is ambiguous; std::sqrt or sqrtf
// are not.
//
// Each shim's declarations are extern "C++", so they work inside the extern "C" { ... } that
// PyCUDA's SourceModule wraps a source in by default. A header of the same name sent with the
// request wins over the shim. The shims are part of
// the compile cache key (StdHeaderShimsDigest), so changing them never serves a stale image.
// Thread-safe (immutable after first use).
#ifndef GPURPC_SERVER_WORKER_COMPILER_STD_HEADERS_H_
#define GPURPC_SERVER_WORKER_COMPILER_STD_HEADERS_H_

#include <string>
#include <vector>

#include "server/worker/compiler/compiler.h"

namespace gpurpc::compiler {

// Every shim, with its include name; "__gpurpc_std.h" is their shared helper.
const std::vector<Header>& StdHeaderShims();

// SHA-256 (hex) over all shims' names and contents.
const std::string& StdHeaderShimsDigest();

}  // namespace gpurpc::compiler

#endif  // GPURPC_SERVER_WORKER_COMPILER_STD_HEADERS_H_
