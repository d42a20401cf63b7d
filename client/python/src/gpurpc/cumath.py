"""``pycuda.cumath``: elementwise math functions of GPUArrays.

::

    import gpurpc.autoinit
    from gpurpc import cumath, gpuarray
    x = gpuarray.to_gpu(np.linspace(0, 1, 1000, dtype=np.float32))
    y = cumath.sin(x)                      # a new array
    cumath.exp(x, out=y, stream=stream)    # into an existing one, queued on a stream

Unary functions (each ``f(array, *, out=None, stream=None)``): ``fabs ceil floor exp log log10
sqrt sin cos tan asin acos atan sinh cosh tanh``. They take float32 and float64 arrays (the
float32 ones call CUDA's ``sinf``... like PyCUDA); ``exp log log10 sqrt sin cos tan sinh cosh
tanh`` also take complex64 and complex128 arrays (principal branches, as numpy). The result has
the input's dtype, shape and memory order.

Decomposition and assembly (float32 and float64, like PyCUDA with ``stream=``; ``out=`` is a
gpurpc addition where there is one result):

* ``fmod(arg, mod, stream=None, *, out=None)``: the remainder of ``arg/mod`` with the sign of
  ``arg`` (C's ``fmod``, numpy's ``np.fmod``);
* ``frexp(arg, stream=None)`` -> ``(significands, exponents)`` with ``arg == sig * 2**exp``;
  as in PyCUDA the exponents are an array of ``arg``'s dtype holding integer values;
* ``ldexp(significand, exponent, stream=None, *, out=None)``: ``significand * 2**exponent``;
  ``exponent`` is an array of ``significand``'s dtype (as PyCUDA) or of an integer dtype;
* ``modf(arg, stream=None)`` -> ``(fracpart, intpart)``.

Each kernel is compiled once per context (session) and dtype. Everything is asynchronous: a
call queues one launch and returns; ``out.get()`` (or a synchronize) waits for it. As in
PyCUDA, ``out`` may be the input itself (in place).
"""
from __future__ import annotations

import string
import warnings
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from . import driver as _drv
from .elementwise import ElementwiseKernel
from .gpuarray import GPUArray, _kernel
from .tools import VectorArg, dtype_to_ctype

__all__ = [
    "fabs", "ceil", "floor", "exp", "log", "log10", "sqrt", "sin", "cos", "tan", "asin", "acos",
    "atan", "sinh", "cosh", "tanh", "fmod", "frexp", "ldexp", "modf",
]

_UNARY = ("fabs", "ceil", "floor", "exp", "log", "log10", "sqrt", "sin", "cos", "tan", "asin",
          "acos", "atan", "sinh", "cosh", "tanh")
_REAL = (np.dtype(np.float32), np.dtype(np.float64))
_COMPLEX = (np.dtype(np.complex64), np.dtype(np.complex128))

_LDEXP_INT_EXPONENTS = tuple(np.dtype(t) for t in (
    np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64))

# The functions defined for complex arguments (the ones PyCUDA's complex header has).
_COMPLEX_FUNCS = frozenset(
    ("exp", "log", "log10", "sqrt", "sin", "cos", "tan", "sinh", "cosh", "tanh"))

# =============================================================================================
# Complex numbers in device code: a struct of two reals and the functions above, per precision.

_COMPLEX_CTYPES = {np.dtype(np.complex64): "gpurpc_complex64",
                   np.dtype(np.complex128): "gpurpc_complex128"}

_COMPLEX_PREAMBLE = string.Template(r"""
struct __align__($align) $C { $T re; $T im; };

__device__ __forceinline__ $C ${C}_make($T re, $T im) { $C z; z.re = re; z.im = im; return z; }

__device__ __forceinline__ $C gpurpc_exp($C z)
{
  $T s, c;
  sincos$f(z.im, &s, &c);
  const $T e = exp$f(z.re);
  return ${C}_make(e * c, e * s);
}

__device__ __forceinline__ $C gpurpc_log($C z)
{
  return ${C}_make(log$f(hypot$f(z.re, z.im)), atan2$f(z.im, z.re));
}

__device__ __forceinline__ $C gpurpc_log10($C z)
{
  const $T inv_ln10 = ($T)0.43429448190325182765;
  $C l = gpurpc_log(z);
  return ${C}_make(l.re * inv_ln10, l.im * inv_ln10);
}

__device__ __forceinline__ $C gpurpc_sqrt($C z)
{
  // Principal root, without cancellation: t = sqrt((|z| + |re|) / 2).
  if (z.re == ($T)0 && z.im == ($T)0)
    return ${C}_make(($T)0, z.im);
  const $T t = sqrt$f((hypot$f(z.re, z.im) + fabs$f(z.re)) * ($T)0.5);
  if (z.re >= ($T)0)
    return ${C}_make(t, z.im / (($T)2 * t));
  return ${C}_make(fabs$f(z.im) / (($T)2 * t), copysign$f(t, z.im));
}

__device__ __forceinline__ $C gpurpc_sin($C z)
{
  $T s, c;
  sincos$f(z.re, &s, &c);
  return ${C}_make(s * cosh$f(z.im), c * sinh$f(z.im));
}

__device__ __forceinline__ $C gpurpc_cos($C z)
{
  $T s, c;
  sincos$f(z.re, &s, &c);
  return ${C}_make(c * cosh$f(z.im), -s * sinh$f(z.im));
}

__device__ __forceinline__ $C gpurpc_sinh($C z)
{
  $T s, c;
  sincos$f(z.im, &s, &c);
  return ${C}_make(sinh$f(z.re) * c, cosh$f(z.re) * s);
}

__device__ __forceinline__ $C gpurpc_cosh($C z)
{
  $T s, c;
  sincos$f(z.im, &s, &c);
  return ${C}_make(cosh$f(z.re) * c, sinh$f(z.re) * s);
}

__device__ __forceinline__ $C gpurpc_tan($C z)
{
  // tan(x+iy) = (sin 2x + i sinh 2y) / (cos 2x + cosh 2y); for large |y| the quotient tends
  // to (4 sin x cos x e^-2|y|, sign y) and cosh would overflow.
  if (fabs$f(z.im) > ($T)20)
  {
    $T s, c;
    sincos$f(z.re, &s, &c);
    return ${C}_make(($T)4 * s * c * exp$f(($T)-2 * fabs$f(z.im)), copysign$f(($T)1, z.im));
  }
  $T s2, c2;
  sincos$f(($T)2 * z.re, &s2, &c2);
  const $T d = c2 + cosh$f(($T)2 * z.im);
  return ${C}_make(s2 / d, sinh$f(($T)2 * z.im) / d);
}

__device__ __forceinline__ $C gpurpc_tanh($C z)
{
  // tanh(z) = -i tan(iz)
  $C t = gpurpc_tan(${C}_make(-z.im, z.re));
  return ${C}_make(t.im, -t.re);
}
""")


def _complex_preamble(dtype: np.dtype) -> str:
    real = "float" if dtype == np.complex64 else "double"
    return _COMPLEX_PREAMBLE.substitute(
        C=_COMPLEX_CTYPES[dtype], T=real, f="f" if real == "float" else "",
        align=dtype.itemsize)


class _ComplexVectorArg(VectorArg):
    """A pointer to complex elements, declared with the struct type of the preamble (the
    generic dtype table has no complex C type)."""

    def declarator(self) -> str:
        return f"{_COMPLEX_CTYPES[self.dtype]} *{self.name}"


# =============================================================================================
# Argument checks


def _check_array(func: str, what: str, array: Any) -> None:
    if not isinstance(array, GPUArray):
        raise TypeError(f"cumath.{func}: {what} must be a GPUArray, got {type(array).__name__}")
    if not array.flags.forc:
        raise RuntimeError(f"cumath.{func}: only contiguous arrays may be used as arguments to "
                           f"this operation ({what} is not contiguous)")


def _dtype_error(func: str, what: str, dtype: np.dtype, complex_ok: bool) -> TypeError:
    allowed = "float32, float64, complex64 or complex128" if complex_ok else "float32 or float64"
    hint = ""
    if dtype.kind in "iub":
        hint = " (convert it first, e.g. with .astype(np.float64))"
    elif dtype in _COMPLEX and not complex_ok:
        hint = " (complex arguments are not defined for this function)"
    return TypeError(f"cumath.{func}: {what} must be a {allowed} array, got {dtype}{hint}")


def _check_same(func: str, what: str, ref: GPUArray, other: GPUArray) -> None:
    if other.shape != ref.shape:
        raise ValueError(f"cumath.{func}: {what} has shape {other.shape}, expected {ref.shape}")
    a, b = ref.flags, other.flags
    if other.size > 1 and (a.c_contiguous, a.f_contiguous) != (b.c_contiguous, b.f_contiguous):
        order = "Fortran" if b.f_contiguous and not b.c_contiguous else "C"
        raise ValueError(f"cumath.{func}: {what} is in {order} order, the input is not (both "
                         "must have one memory order)")


def _check_out(func: str, out: Any, ref: GPUArray, dtype: np.dtype) -> GPUArray:
    if out is None:
        return ref._new_like_me(dtype)
    _check_array(func, "out", out)
    if out.dtype != dtype:
        raise TypeError(f"cumath.{func}: out has dtype {out.dtype}, expected {dtype}")
    _check_same(func, "out", ref, out)
    return out


# =============================================================================================
# Kernels: each is described by a spec (arguments, operation, name, preamble) and built as an
# ElementwiseKernel once per session (gpuarray's cache). ``_kernel_specs`` lists them all.

_Spec = Tuple[Any, str, str, str]


def _unary_spec(name: str, dtype: np.dtype) -> _Spec:
    if dtype in _COMPLEX:
        args = [_ComplexVectorArg(dtype, "x"), _ComplexVectorArg(dtype, "z")]
        return (args, f"z[i] = gpurpc_{name}(x[i])", f"gpurpc_cumath_{name}",
                _complex_preamble(dtype))
    t = dtype_to_ctype(dtype)
    fname = name + ("f" if dtype == np.float32 else "")
    return f"const {t} *x, {t} *z", f"z[i] = {fname}(x[i])", f"gpurpc_cumath_{name}", ""


def _fmod_spec(dtype: np.dtype) -> _Spec:
    t = dtype_to_ctype(dtype)
    f = "f" if dtype == np.float32 else ""
    return (f"const {t} *arg, const {t} *mod, {t} *z", f"z[i] = fmod{f}(arg[i], mod[i])",
            "gpurpc_cumath_fmod", "")


def _frexp_spec(dtype: np.dtype) -> _Spec:
    t = dtype_to_ctype(dtype)
    f = "f" if dtype == np.float32 else ""
    return (f"const {t} *x, {t} *significand, {t} *exponent",
            f"int e; significand[i] = frexp{f}(x[i], &e); exponent[i] = ({t})e",
            "gpurpc_cumath_frexp", "")


def _ldexp_spec(dtype: np.dtype, exp_dtype: np.dtype) -> _Spec:
    t = dtype_to_ctype(dtype)
    te = dtype_to_ctype(exp_dtype)
    f = "f" if dtype == np.float32 else ""
    # Exponents are clamped before the conversion to int (an out-of-range conversion is
    # undefined); past +-1e6 every finite significand over- or underflows anyway.
    if exp_dtype.kind == "f":
        e = "(int)fmax(-1.0e6, fmin(1.0e6, (double)exponent[i]))"
    elif exp_dtype == np.uint64:
        e = "(int)min(1000000ULL, (unsigned long long)exponent[i])"
    elif exp_dtype.itemsize >= 4:
        e = "(int)max(-1000000LL, min(1000000LL, (long long)exponent[i]))"
    else:
        e = "(int)exponent[i]"
    return (f"const {t} *significand, const {te} *exponent, {t} *z",
            f"z[i] = ldexp{f}(significand[i], {e})", "gpurpc_cumath_ldexp", "")


def _modf_spec(dtype: np.dtype) -> _Spec:
    t = dtype_to_ctype(dtype)
    f = "f" if dtype == np.float32 else ""
    return (f"const {t} *x, {t} *intpart, {t} *fracpart",
            f"{t} ip; fracpart[i] = modf{f}(x[i], &ip); intpart[i] = ip",
            "gpurpc_cumath_modf", "")


def _build(key: Tuple, spec: _Spec) -> ElementwiseKernel:
    arguments, operation, name, preamble = spec
    return _kernel(("cumath",) + key, lambda: ElementwiseKernel(
        arguments, operation, name, preamble=preamble))


def _kernel_specs() -> Iterator[Tuple[Tuple, _Spec]]:
    """Every kernel this module generates, as ``(cache key, spec)``."""
    for name in _UNARY:
        for dtype in _REAL + (_COMPLEX if name in _COMPLEX_FUNCS else ()):
            yield (name, dtype), _unary_spec(name, dtype)
    for dtype in _REAL:
        yield ("fmod", dtype), _fmod_spec(dtype)
        yield ("frexp", dtype), _frexp_spec(dtype)
        yield ("modf", dtype), _modf_spec(dtype)
        for exp_dtype in _REAL + _LDEXP_INT_EXPONENTS:
            if exp_dtype.kind == "f" and exp_dtype != dtype:
                continue
            yield ("ldexp", dtype, exp_dtype), _ldexp_spec(dtype, exp_dtype)


# =============================================================================================
# Unary functions


def _split_stream_or_out(func: str, stream_or_out: Any, out: Any, stream: Any,
                         ) -> Tuple[Any, Any]:
    """PyCUDA's deprecated second positional argument: a Stream or the out array."""
    if stream_or_out is None:
        return out, stream
    warnings.warn(f"cumath.{func}: pass the stream or the output array as stream= or out=",
                  DeprecationWarning, stacklevel=3)
    if isinstance(stream_or_out, _drv.Stream):
        if stream is not None:
            raise TypeError(f"cumath.{func}: stream given twice")
        return out, stream_or_out
    if out is not None:
        raise TypeError(f"cumath.{func}: out given twice")
    return stream_or_out, stream


def _make_unary(name: str) -> Callable[..., GPUArray]:
    complex_ok = name in _COMPLEX_FUNCS

    def f(array: GPUArray, stream_or_out: Any = None, *, out: Optional[GPUArray] = None,
          stream: Optional[_drv.Stream] = None) -> GPUArray:
        out, stream = _split_stream_or_out(name, stream_or_out, out, stream)
        _check_array(name, "the argument", array)
        dtype = array.dtype
        if not (dtype in _REAL or (complex_ok and dtype in _COMPLEX)):
            raise _dtype_error(name, "the argument", dtype, complex_ok)
        out = _check_out(name, out, array, dtype)
        if array.size:
            _build((name, dtype), _unary_spec(name, dtype))(array, out, stream=stream)
        return out

    kinds = "float32/float64" + (" and complex64/complex128" if complex_ok else "")
    f.__name__ = f.__qualname__ = name
    f.__doc__ = (f"Elementwise ``{name}`` of a {kinds} GPUArray, into ``out`` (same dtype, "
                 f"shape and memory order) or a new array; queued on ``stream``.")
    return f


fabs = _make_unary("fabs")
ceil = _make_unary("ceil")
floor = _make_unary("floor")
exp = _make_unary("exp")
log = _make_unary("log")
log10 = _make_unary("log10")
sqrt = _make_unary("sqrt")

sin = _make_unary("sin")
cos = _make_unary("cos")
tan = _make_unary("tan")
asin = _make_unary("asin")
acos = _make_unary("acos")
atan = _make_unary("atan")

sinh = _make_unary("sinh")
cosh = _make_unary("cosh")
tanh = _make_unary("tanh")


# =============================================================================================
# Floating point decomposition and assembly


def _real_arg(func: str, what: str, array: Any) -> np.dtype:
    _check_array(func, what, array)
    if array.dtype not in _REAL:
        raise _dtype_error(func, what, array.dtype, False)
    return array.dtype


def fmod(arg: GPUArray, mod: GPUArray, stream: Optional[_drv.Stream] = None, *,
         out: Optional[GPUArray] = None) -> GPUArray:
    """Return the floating point remainder of the division `arg/mod`,
    for each element in `arg` and `mod` (arrays of one float dtype and shape)."""
    dtype = _real_arg("fmod", "arg", arg)
    _real_arg("fmod", "mod", mod)
    if mod.dtype != dtype:
        raise TypeError(f"cumath.fmod: arg and mod must have one dtype, got {dtype} and "
                        f"{mod.dtype}")
    _check_same("fmod", "mod", arg, mod)
    out = _check_out("fmod", out, arg, dtype)
    if arg.size:
        _build(("fmod", dtype), _fmod_spec(dtype))(arg, mod, out, stream=stream)
    return out


def frexp(arg: GPUArray, stream: Optional[_drv.Stream] = None) -> Tuple[GPUArray, GPUArray]:
    """Return a tuple `(significands, exponents)` such that
    `arg == significand * 2**exponent` (both of `arg`'s dtype)."""
    _real_arg("frexp", "arg", arg)
    sig = arg._new_like_me()
    expt = arg._new_like_me()
    if arg.size:
        _build(("frexp", arg.dtype), _frexp_spec(arg.dtype))(arg, sig, expt, stream=stream)
    return sig, expt


def ldexp(significand: GPUArray, exponent: GPUArray, stream: Optional[_drv.Stream] = None, *,
          out: Optional[GPUArray] = None) -> GPUArray:
    """Return a new array of floating point values composed from the
    entries of `significand` and `exponent`, paired together as
    `result = significand * 2**exponent`.

    ``exponent`` has ``significand``'s dtype (as in PyCUDA; its values are truncated to
    integers) or an integer dtype."""
    dtype = _real_arg("ldexp", "significand", significand)
    _check_array("ldexp", "exponent", exponent)
    exp_dtype = exponent.dtype
    if exp_dtype not in _LDEXP_INT_EXPONENTS and exp_dtype != dtype:
        raise TypeError(f"cumath.ldexp: exponent must have the significand's dtype ({dtype}) "
                        f"or an integer dtype, got {exp_dtype}")
    _check_same("ldexp", "exponent", significand, exponent)
    out = _check_out("ldexp", out, significand, dtype)
    if significand.size:
        _build(("ldexp", dtype, exp_dtype), _ldexp_spec(dtype, exp_dtype))(
            significand, exponent, out, stream=stream)
    return out


def modf(arg: GPUArray, stream: Optional[_drv.Stream] = None) -> Tuple[GPUArray, GPUArray]:
    """Return a tuple `(fracpart, intpart)` of arrays containing the
    integer and fractional parts of `arg` (both of `arg`'s dtype, with `arg`'s sign)."""
    _real_arg("modf", "arg", arg)
    intpart = arg._new_like_me()
    fracpart = arg._new_like_me()
    if arg.size:
        _build(("modf", arg.dtype), _modf_spec(arg.dtype))(
            arg, intpart, fracpart, stream=stream)
    return fracpart, intpart

