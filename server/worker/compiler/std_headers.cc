// The shim headers, as raw strings. Each is short and names only NVRTC's built-ins, the other
// shims or libcu++ (<cuda/std/...>, from the toolkit's cccl folder): no file of the server.
// The C headers stand alone (any -std=); the C++ ones are libcu++'s, which needs C++17.
#include "server/worker/compiler/std_headers.h"

#include <string>
#include <vector>

#include "server/worker/compiler/sha256.h"

namespace gpurpc::compiler {
namespace {

const std::vector<Header>& Shims() {
  static const auto* const kShims = new std::vector<Header>{
      {"__gpurpc_std.h",
       R"gpurpc(// gpurpc: the C++ standard library names of libcu++ (cuda::std), visible as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
namespace cuda { namespace std {} }
namespace std { using namespace ::cuda::std; }
}  // extern "C++"
)gpurpc"},
      {"algorithm",
       R"gpurpc(// gpurpc: <algorithm> for NVRTC: libcu++'s algorithms (its aggregate <cuda/std/__algorithm_>:
// libcu++ has no public <cuda/std/algorithm> yet), their names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/__algorithm_>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"array",
       R"gpurpc(// gpurpc: <array> for NVRTC: libcu++'s <cuda/std/array>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/array>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"assert.h",
       R"gpurpc(// gpurpc: <assert.h> for NVRTC: device assert() is built into NVRTC (a failed assert stops
// the kernel with an error that ends the session's context, as on a local GPU).
#pragma once
)gpurpc"},
      {"atomic",
       R"gpurpc(// gpurpc: <atomic> for NVRTC: libcu++'s <cuda/std/atomic>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/atomic>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"bit", R"gpurpc(// gpurpc: <bit> for NVRTC: libcu++'s <cuda/std/bit>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/bit>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"cassert", R"gpurpc(// gpurpc: <cassert> for NVRTC (see <assert.h>).
#include <assert.h>
)gpurpc"},
      {"cfloat", R"gpurpc(// gpurpc: <cfloat> for NVRTC (see <float.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <float.h>
}  // extern "C++"
)gpurpc"},
      {"chrono",
       R"gpurpc(// gpurpc: <chrono> for NVRTC: libcu++'s <cuda/std/chrono>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/chrono>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"climits", R"gpurpc(// gpurpc: <climits> for NVRTC (see <limits.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <limits.h>
}  // extern "C++"
)gpurpc"},
      {"cmath",
       R"gpurpc(// gpurpc: <cmath> for NVRTC: std:: names for the CUDA math functions (see <math.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <math.h>
namespace std {
using ::abs;
using ::fabs;
using ::fmod;
using ::remainder;
using ::remquo;
using ::fma;
using ::fmax;
using ::fmin;
using ::fdim;
using ::exp;
using ::exp2;
using ::expm1;
using ::log;
using ::log10;
using ::log2;
using ::log1p;
using ::pow;
using ::sqrt;
using ::cbrt;
using ::hypot;
using ::sin;
using ::cos;
using ::tan;
using ::asin;
using ::acos;
using ::atan;
using ::atan2;
using ::sinh;
using ::cosh;
using ::tanh;
using ::asinh;
using ::acosh;
using ::atanh;
using ::erf;
using ::erfc;
using ::tgamma;
using ::lgamma;
using ::ceil;
using ::floor;
using ::trunc;
using ::round;
using ::lround;
using ::llround;
using ::nearbyint;
using ::rint;
using ::lrint;
using ::llrint;
using ::frexp;
using ::ldexp;
using ::modf;
using ::scalbn;
using ::scalbln;
using ::ilogb;
using ::logb;
using ::nextafter;
using ::copysign;
using ::isfinite;
using ::isinf;
using ::isnan;
using ::signbit;
}
}  // extern "C++"
)gpurpc"},
      {"complex",
       R"gpurpc(// gpurpc: <complex> for NVRTC: libcu++'s <cuda/std/complex>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/complex>
#include <__gpurpc_std.h>
// std::abs(z) and friends, qualified: std's own abs (from <cmath>/<cstdlib>) would hide the
// complex overloads that the using-directive brings.
namespace std {
template <class T> __device__ T abs(const ::cuda::std::complex<T>& z) { return ::cuda::std::abs(z); }
template <class T> __device__ T arg(const ::cuda::std::complex<T>& z) { return ::cuda::std::arg(z); }
template <class T> __device__ ::cuda::std::complex<T> exp(const ::cuda::std::complex<T>& z) { return ::cuda::std::exp(z); }
template <class T> __device__ ::cuda::std::complex<T> log(const ::cuda::std::complex<T>& z) { return ::cuda::std::log(z); }
template <class T> __device__ ::cuda::std::complex<T> sqrt(const ::cuda::std::complex<T>& z) { return ::cuda::std::sqrt(z); }
}
}  // extern "C++"
)gpurpc"},
      {"cstddef", R"gpurpc(// gpurpc: <cstddef> for NVRTC (see <stddef.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stddef.h>
namespace std {
using ::size_t;
using ::ptrdiff_t;
typedef decltype(nullptr) nullptr_t;
}
}  // extern "C++"
)gpurpc"},
      {"cstdint", R"gpurpc(// gpurpc: <cstdint> for NVRTC (see <stdint.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stdint.h>
namespace std {
using ::int8_t; using ::int16_t; using ::int32_t; using ::int64_t;
using ::uint8_t; using ::uint16_t; using ::uint32_t; using ::uint64_t;
using ::int_least8_t; using ::int_least16_t; using ::int_least32_t; using ::int_least64_t;
using ::uint_least8_t; using ::uint_least16_t; using ::uint_least32_t; using ::uint_least64_t;
using ::int_fast8_t; using ::int_fast16_t; using ::int_fast32_t; using ::int_fast64_t;
using ::uint_fast8_t; using ::uint_fast16_t; using ::uint_fast32_t; using ::uint_fast64_t;
using ::intptr_t; using ::uintptr_t; using ::intmax_t; using ::uintmax_t;
}
}  // extern "C++"
)gpurpc"},
      {"cstdio", R"gpurpc(// gpurpc: <cstdio> for NVRTC: printf (see <stdio.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stdio.h>
namespace std { using ::printf; }
}  // extern "C++"
)gpurpc"},
      {"cstdlib", R"gpurpc(// gpurpc: <cstdlib> for NVRTC (see <stdlib.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stdlib.h>
namespace std {
using ::malloc; using ::free; using ::abs; using ::labs; using ::llabs;
using ::div_t; using ::ldiv_t; using ::lldiv_t; using ::div; using ::ldiv; using ::lldiv;
}
}  // extern "C++"
)gpurpc"},
      {"cstring", R"gpurpc(// gpurpc: <cstring> for NVRTC (see <string.h>).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <string.h>
namespace std {
using ::memcpy;
using ::memset;
using ::memcmp;
using ::memchr;
using ::memmove;
using ::strlen;
using ::strcmp;
using ::strncmp;
using ::strcpy;
using ::strncpy;
using ::strchr;
}
}  // extern "C++"
)gpurpc"},
      {"float.h",
       R"gpurpc(// gpurpc: <float.h> for NVRTC: the IEEE 754 binary32/binary64 limits of device code.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#define FLT_RADIX 2
#define FLT_MANT_DIG 24
#define DBL_MANT_DIG 53
#define FLT_DIG 6
#define DBL_DIG 15
#define FLT_DECIMAL_DIG 9
#define DBL_DECIMAL_DIG 17
#define DECIMAL_DIG 17
#define FLT_MIN_EXP (-125)
#define DBL_MIN_EXP (-1021)
#define FLT_MIN_10_EXP (-37)
#define DBL_MIN_10_EXP (-307)
#define FLT_MAX_EXP 128
#define DBL_MAX_EXP 1024
#define FLT_MAX_10_EXP 38
#define DBL_MAX_10_EXP 308
#define FLT_MAX 3.40282346638528859812e+38F
#define DBL_MAX 1.79769313486231570815e+308
#define FLT_MIN 1.17549435082228750797e-38F
#define DBL_MIN 2.22507385850720138309e-308
#define FLT_EPSILON 1.1920928955078125e-07F
#define DBL_EPSILON 2.22044604925031308085e-16
#define FLT_TRUE_MIN 1.40129846432481707092e-45F
#define DBL_TRUE_MIN 4.94065645841246544177e-324
#define FLT_EVAL_METHOD 0
}  // extern "C++"
)gpurpc"},
      {"functional",
       R"gpurpc(// gpurpc: <functional> for NVRTC: libcu++'s <cuda/std/functional>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/functional>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"initializer_list",
       R"gpurpc(// gpurpc: <initializer_list> for NVRTC: libcu++'s <cuda/std/initializer_list>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/initializer_list>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"iterator",
       R"gpurpc(// gpurpc: <iterator> for NVRTC: libcu++'s <cuda/std/iterator>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/iterator>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"limits",
       R"gpurpc(// gpurpc: <limits> for NVRTC: libcu++'s <cuda/std/limits>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/limits>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"limits.h",
       R"gpurpc(// gpurpc: <limits.h> for NVRTC: libcu++'s <cuda/std/climits>; the same macros (LP64, signed
// char) here below C++17, which libcu++ needs.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#if __cplusplus >= 201703L
#include <cuda/std/climits>
#else
#define CHAR_BIT 8
#define SCHAR_MIN (-128)
#define SCHAR_MAX 127
#define UCHAR_MAX 255
#define CHAR_MIN SCHAR_MIN
#define CHAR_MAX SCHAR_MAX
#define MB_LEN_MAX 16
#define SHRT_MIN (-32767 - 1)
#define SHRT_MAX 32767
#define USHRT_MAX 65535
#define INT_MIN (-2147483647 - 1)
#define INT_MAX 2147483647
#define UINT_MAX 4294967295U
#define LONG_MIN (-9223372036854775807L - 1)
#define LONG_MAX 9223372036854775807L
#define ULONG_MAX 18446744073709551615UL
#define LLONG_MIN (-9223372036854775807LL - 1)
#define LLONG_MAX 9223372036854775807LL
#define ULLONG_MAX 18446744073709551615ULL
#endif  // __cplusplus >= 201703L
}  // extern "C++"
)gpurpc"},
      {"math.h",
       R"gpurpc(// gpurpc: <math.h> for NVRTC. The CUDA math functions (sinf, sqrt, fabs ...) are built into
// NVRTC; this adds the macros of C's <math.h> and the common M_ constants. (Not libcu++'s
// <cuda/std/cmath>: its float overloads would be ambiguous with NVRTC's own.)
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#if __cplusplus >= 201703L
#include <cuda/std/limits>
// Spelled as libcu++'s <cuda/std/cmath> spells them under NVRTC, so that both may be included.
#define INFINITY _CUDA_VSTD::numeric_limits<float>::infinity()
#define NAN _CUDA_VSTD::numeric_limits<float>::quiet_NaN()
#define HUGE_VALF _CUDA_VSTD::numeric_limits<float>::infinity()
#define HUGE_VAL _CUDA_VSTD::numeric_limits<double>::infinity()
#else  // libcu++ needs C++17: the device intrinsics instead (not constexpr)
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#define HUGE_VALF __int_as_float(0x7f800000)
#define HUGE_VAL __longlong_as_double(0x7ff0000000000000LL)
#endif
#ifndef M_PI
#define M_E 2.7182818284590452354
#define M_LOG2E 1.4426950408889634074
#define M_LOG10E 0.43429448190325182765
#define M_LN2 0.69314718055994530942
#define M_LN10 2.30258509299404568402
#define M_PI 3.14159265358979323846
#define M_PI_2 1.57079632679489661923
#define M_PI_4 0.78539816339744830962
#define M_1_PI 0.31830988618379067154
#define M_2_PI 0.63661977236758134308
#define M_2_SQRTPI 1.12837916709551257390
#define M_SQRT2 1.41421356237309504880
#define M_SQRT1_2 0.70710678118654752440
#endif
}  // extern "C++"
)gpurpc"},
      {"memory",
       R"gpurpc(// gpurpc: <memory> for NVRTC: libcu++'s <cuda/std/memory>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/memory>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"numbers",
       R"gpurpc(// gpurpc: <numbers> for NVRTC: libcu++'s <cuda/std/numbers>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/numbers>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"numeric",
       R"gpurpc(// gpurpc: <numeric> for NVRTC: libcu++'s <cuda/std/numeric>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/numeric>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"optional",
       R"gpurpc(// gpurpc: <optional> for NVRTC: libcu++'s <cuda/std/optional>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/optional>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"ratio",
       R"gpurpc(// gpurpc: <ratio> for NVRTC: libcu++'s <cuda/std/ratio>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/ratio>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"span",
       R"gpurpc(// gpurpc: <span> for NVRTC: libcu++'s <cuda/std/span>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/span>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"stddef.h", R"gpurpc(// gpurpc: <stddef.h> for NVRTC (size_t is built in).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
typedef decltype(static_cast<int*>(0) - static_cast<int*>(0)) ptrdiff_t;
#ifndef NULL
#define NULL 0
#endif
#ifndef offsetof
#define offsetof(type, member) __builtin_offsetof(type, member)
#endif
}  // extern "C++"
)gpurpc"},
      {"stdint.h",
       R"gpurpc(// gpurpc: <stdint.h> for NVRTC: libcu++'s <cuda/std/cstdint>, which under NVRTC declares these
// names in the global namespace; the same declarations here below C++17 (libcu++ needs it).
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#if __cplusplus >= 201703L
#include <cuda/std/cstdint>
#else
#include <limits.h>
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int8_t int_least8_t;
typedef int16_t int_least16_t;
typedef int32_t int_least32_t;
typedef int64_t int_least64_t;
typedef uint8_t uint_least8_t;
typedef uint16_t uint_least16_t;
typedef uint32_t uint_least32_t;
typedef uint64_t uint_least64_t;
typedef int8_t int_fast8_t;
typedef int16_t int_fast16_t;
typedef int32_t int_fast32_t;
typedef int64_t int_fast64_t;
typedef uint8_t uint_fast8_t;
typedef uint16_t uint_fast16_t;
typedef uint32_t uint_fast32_t;
typedef uint64_t uint_fast64_t;
typedef int64_t intptr_t;
typedef uint64_t uintptr_t;
typedef int64_t intmax_t;
typedef uint64_t uintmax_t;
#define INT8_MIN (-128)
#define INT16_MIN (-32767 - 1)
#define INT32_MIN (-2147483647 - 1)
#define INT64_MIN (-9223372036854775807LL - 1)
#define INT8_MAX 127
#define INT16_MAX 32767
#define INT32_MAX 2147483647
#define INT64_MAX 9223372036854775807LL
#define UINT8_MAX 255
#define UINT16_MAX 65535
#define UINT32_MAX 4294967295U
#define UINT64_MAX 18446744073709551615ULL
#define INTPTR_MIN (-9223372036854775807LL - 1)
#define INTPTR_MAX 9223372036854775807LL
#define UINTPTR_MAX 18446744073709551615ULL
#define INTMAX_MIN (-9223372036854775807LL - 1)
#define INTMAX_MAX 9223372036854775807LL
#define UINTMAX_MAX 18446744073709551615ULL
#define PTRDIFF_MIN (-9223372036854775807L - 1)
#define PTRDIFF_MAX 9223372036854775807L
#define SIZE_MAX 18446744073709551615UL
#define INT8_C(c) c
#define INT16_C(c) c
#define INT32_C(c) c
#define INT64_C(c) c##LL
#define UINT8_C(c) c
#define UINT16_C(c) c
#define UINT32_C(c) c##U
#define UINT64_C(c) c##ULL
#define INTMAX_C(c) c##LL
#define UINTMAX_C(c) c##ULL
#endif  // __cplusplus >= 201703L
}  // extern "C++"
)gpurpc"},
      {"stdio.h",
       R"gpurpc(// gpurpc: <stdio.h> for NVRTC. Device code has printf (built into NVRTC), nothing else of
// stdio: no files, no streams. Its output reaches the session's client at the next
// synchronisation.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stddef.h>
#ifndef EOF
#define EOF (-1)
#endif
}  // extern "C++"
)gpurpc"},
      {"stdlib.h",
       R"gpurpc(// gpurpc: <stdlib.h> for NVRTC. Device code has malloc, free and abs (built into NVRTC);
// this adds labs/llabs' companions div, ldiv and lldiv and the EXIT_ macros.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stddef.h>
typedef struct { int quot, rem; } div_t;
typedef struct { long quot, rem; } ldiv_t;
typedef struct { long long quot, rem; } lldiv_t;
__device__ inline div_t div(int n, int d) { div_t r; r.quot = n / d; r.rem = n % d; return r; }
__device__ inline ldiv_t ldiv(long n, long d) { ldiv_t r; r.quot = n / d; r.rem = n % d; return r; }
__device__ inline lldiv_t lldiv(long long n, long long d) {
  lldiv_t r; r.quot = n / d; r.rem = n % d; return r;
}
#ifndef EXIT_SUCCESS
#define EXIT_SUCCESS 0
#define EXIT_FAILURE 1
#endif
}  // extern "C++"
)gpurpc"},
      {"string.h",
       R"gpurpc(// gpurpc: <string.h> for NVRTC. Device code has memcpy and memset (built into NVRTC); here
// are memcmp, memchr, memmove and the common str* functions.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <stddef.h>
__device__ inline int memcmp(const void* a, const void* b, size_t n) {
  const unsigned char* x = static_cast<const unsigned char*>(a);
  const unsigned char* y = static_cast<const unsigned char*>(b);
  for (size_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
  }
  return 0;
}
__device__ inline const void* memchr(const void* s, int c, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(s);
  for (size_t i = 0; i < n; ++i) {
    if (p[i] == static_cast<unsigned char>(c)) return p + i;
  }
  return nullptr;
}
__device__ inline void* memchr(void* s, int c, size_t n) {
  return const_cast<void*>(memchr(static_cast<const void*>(s), c, n));
}
__device__ inline void* memmove(void* dst, const void* src, size_t n) {
  unsigned char* d = static_cast<unsigned char*>(dst);
  const unsigned char* s = static_cast<const unsigned char*>(src);
  if (d < s) {
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  } else {
    for (size_t i = n; i != 0; --i) d[i - 1] = s[i - 1];
  }
  return dst;
}
__device__ inline size_t strlen(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  return n;
}
__device__ inline int strncmp(const char* a, const char* b, size_t n) {
  for (; n != 0; ++a, ++b, --n) {
    const unsigned char x = static_cast<unsigned char>(*a), y = static_cast<unsigned char>(*b);
    if (x != y) return x < y ? -1 : 1;
    if (x == '\0') return 0;
  }
  return 0;
}
__device__ inline int strcmp(const char* a, const char* b) {
  return strncmp(a, b, static_cast<size_t>(-1));
}
__device__ inline char* strcpy(char* dst, const char* src) {
  char* d = dst;
  while ((*d++ = *src++) != '\0') {}
  return dst;
}
__device__ inline char* strncpy(char* dst, const char* src, size_t n) {
  size_t i = 0;
  for (; i < n && src[i] != '\0'; ++i) dst[i] = src[i];
  for (; i < n; ++i) dst[i] = '\0';
  return dst;
}
__device__ inline const char* strchr(const char* s, int c) {
  for (;; ++s) {
    if (*s == static_cast<char>(c)) return s;
    if (*s == '\0') return nullptr;
  }
}
__device__ inline char* strchr(char* s, int c) {
  return const_cast<char*>(strchr(static_cast<const char*>(s), c));
}
}  // extern "C++"
)gpurpc"},
      {"tuple",
       R"gpurpc(// gpurpc: <tuple> for NVRTC: libcu++'s <cuda/std/tuple>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/tuple>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"type_traits",
       R"gpurpc(// gpurpc: <type_traits> for NVRTC: libcu++'s <cuda/std/type_traits>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/type_traits>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"utility",
       R"gpurpc(// gpurpc: <utility> for NVRTC: libcu++'s <cuda/std/utility>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/utility>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
      {"variant",
       R"gpurpc(// gpurpc: <variant> for NVRTC: libcu++'s <cuda/std/variant>, its names as std:: too.
#pragma once
extern "C++" {  // also inside SourceModule's default extern "C" { ... }
#include <cuda/std/variant>
#include <__gpurpc_std.h>
}  // extern "C++"
)gpurpc"},
  };
  return *kShims;
}

}  // namespace

const std::vector<Header>& StdHeaderShims() { return Shims(); }

const std::string& StdHeaderShimsDigest() {
  static const auto* const kDigest = [] {
    Sha256 hasher;
    for (const Header& shim : Shims()) {
      hasher.Update(shim.name);
      hasher.Update("", 1);  // NUL-separated: no two lists hash alike
      hasher.Update(shim.content);
      hasher.Update("", 1);  // NUL-separated: no two lists hash alike
    }
    return new std::string(DigestToHex(hasher.Finish()));
  }();
  return *kDigest;
}

}  // namespace gpurpc::compiler
