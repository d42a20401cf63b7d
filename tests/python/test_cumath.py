"""gpurpc.cumath (pycuda.cumath): every generated kernel compiles (fake backend), arguments are
checked, shapes/dtypes/orders of results; the numbers against numpy need a GPU (marked gpu)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import cumath, gpuarray
from gpurpc.elementwise import get_elwise_module
from gpurpc.tools import ScalarArg, parse_c_args

rng = np.random.default_rng(20261201)

UNARY = ["fabs", "ceil", "floor", "exp", "log", "log10", "sqrt", "sin", "cos", "tan", "asin",
         "acos", "atan", "sinh", "cosh", "tanh"]
COMPLEX_OK = {"exp", "log", "log10", "sqrt", "sin", "cos", "tan", "sinh", "cosh", "tanh"}
REAL = [np.float32, np.float64]
COMPLEX = [np.complex64, np.complex128]


class _NonContiguous(gpuarray.GPUArray):
    """A GPUArray that reports itself as not contiguous (gpurpc cannot make such views)."""

    @property
    def flags(self):  # type: ignore[override]
        return gpuarray._Flags(False, False)


# -- every kernel compiles (fake backend: NVRTC really runs) ---------------------------------

def test_every_generated_kernel_compiles(ctx: cuda.Context) -> None:
    keys = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an NVRTC warning fails the test too
        for key, (arguments, operation, name, preamble) in cumath._kernel_specs():
            args = (parse_c_args(arguments) if isinstance(arguments, str) else list(arguments))
            args.append(ScalarArg(np.uint64, "n"))
            # The module ElementwiseKernel builds for this spec, without get_function (the fake
            # backend loads only its built-in kernels).
            mod = get_elwise_module(args, operation, name, preamble=preamble)
            assert mod.cubin
            keys.append(key)
    assert len(keys) == len(set(keys))
    names = {k[0] for k in keys}
    assert names == set(cumath.__all__)
    for name in UNARY:
        dtypes = {k[1] for k in keys if k[0] == name}
        expected = set(map(np.dtype, REAL + (COMPLEX if name in COMPLEX_OK else [])))
        assert dtypes == expected, name
    assert ("ldexp", np.dtype(np.float32), np.dtype(np.int32)) in keys
    assert ("ldexp", np.dtype(np.float64), np.dtype(np.float64)) in keys


def test_every_function_is_exported() -> None:
    for name in cumath.__all__:
        assert callable(getattr(cumath, name))
    assert cumath.sin.__name__ == "sin" and "complex64" in (cumath.sin.__doc__ or "")


# -- results of empty arrays: shape, dtype, order, out= (no kernel runs) ----------------------

@pytest.mark.parametrize("name", UNARY)
def test_unary_results_have_the_input_layout(ctx: cuda.Context, name: str) -> None:
    func = getattr(cumath, name)
    dtypes = REAL + (COMPLEX if name in COMPLEX_OK else [])
    for dtype in dtypes:
        x = gpuarray.empty((0, 3), dtype)
        y = func(x)
        assert y is not x and y.shape == (0, 3) and y.dtype == np.dtype(dtype)
        out = gpuarray.empty((0, 3), dtype)
        assert func(x, out=out) is out
        assert func(x, out=x) is x  # in place is allowed
        assert func(x, stream=cuda.Stream()).shape == (0, 3)
        f = gpuarray.empty((3, 0), dtype, order="F")
        assert func(f).shape == (3, 0)


def test_decomposition_results(ctx: cuda.Context) -> None:
    for dtype in REAL:
        x = gpuarray.empty((0, 2), dtype)
        assert cumath.fmod(x, x).shape == (0, 2)
        sig, expt = cumath.frexp(x)
        assert sig.dtype == expt.dtype == np.dtype(dtype) and sig.shape == (0, 2)
        frac, whole = cumath.modf(x)
        assert frac.dtype == whole.dtype == np.dtype(dtype) and frac is not whole
        assert cumath.ldexp(x, gpuarray.empty((0, 2), np.int32)).dtype == np.dtype(dtype)
        assert cumath.ldexp(x, x).shape == (0, 2)
        out = gpuarray.empty((0, 2), dtype)
        assert cumath.fmod(x, x, out=out) is out
        assert cumath.ldexp(x, x, out=out) is out


def test_positional_stream_or_out_is_deprecated(ctx: cuda.Context) -> None:
    x = gpuarray.empty(0, np.float32)
    out = gpuarray.empty(0, np.float32)
    with pytest.warns(DeprecationWarning, match="out="):
        assert cumath.sin(x, out) is out
    with pytest.warns(DeprecationWarning):
        assert cumath.cos(x, cuda.Stream()).shape == (0,)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="out given twice"):
        cumath.exp(x, out, out=out)


# -- argument checks ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64, np.bool_])
def test_integer_arrays_are_refused(ctx: cuda.Context, dtype) -> None:
    x = gpuarray.zeros(4, dtype)
    with pytest.raises(TypeError, match=r"cumath\.sqrt: .*float32, float64, complex64 or "
                                        r"complex128 .*astype"):
        cumath.sqrt(x)
    with pytest.raises(TypeError, match=r"cumath\.floor: .*float32 or float64"):
        cumath.floor(x)
    with pytest.raises(TypeError, match="frexp"):
        cumath.frexp(x)


@pytest.mark.parametrize("name", sorted(set(UNARY) - COMPLEX_OK))
def test_complex_is_refused_where_undefined(ctx: cuda.Context, name: str) -> None:
    x = gpuarray.to_gpu(np.ones(3, np.complex64))
    with pytest.raises(TypeError, match="complex arguments are not defined"):
        getattr(cumath, name)(x)


def test_complex_is_refused_by_decomposition_functions(ctx: cuda.Context) -> None:
    x = gpuarray.to_gpu(np.ones(3, np.complex128))
    for call in (lambda: cumath.fmod(x, x), lambda: cumath.frexp(x), lambda: cumath.modf(x),
                 lambda: cumath.ldexp(x, x)):
        with pytest.raises(TypeError, match="float32 or float64"):
            call()


def test_host_arrays_are_refused(ctx: cuda.Context) -> None:
    with pytest.raises(TypeError, match=r"cumath\.sin: the argument must be a GPUArray, got "
                                        r"ndarray"):
        cumath.sin(np.ones(3, np.float32))
    x = gpuarray.zeros(3, np.float32)
    with pytest.raises(TypeError, match="out must be a GPUArray"):
        cumath.sin(x, out=np.ones(3, np.float32))


def test_out_must_match(ctx: cuda.Context) -> None:
    x = gpuarray.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match=r"out has shape \(20,\), expected \(4, 5\)"):
        cumath.exp(x, out=gpuarray.zeros(20, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        cumath.exp(x, out=gpuarray.zeros((4, 5), np.float64))
    with pytest.raises(ValueError, match="out is in Fortran order, the input is not"):
        cumath.exp(x, out=gpuarray.zeros((4, 5), np.float32, order="F"))
    with pytest.raises(ValueError, match="out is in C order, the input is not"):
        cumath.exp(gpuarray.zeros((4, 5), np.float32, order="F"), out=x)
    # Orders, not strides, must agree: operands of other itemsizes are fine.
    cumath._check_same("ldexp", "exponent", gpuarray.zeros((4, 5), np.float64),
                       gpuarray.zeros((4, 5), np.int8))
    with pytest.raises(ValueError, match="out has shape"):
        cumath.fmod(x, x, out=gpuarray.zeros((5, 4), np.float32))


def test_non_contiguous_arrays_are_refused(ctx: cuda.Context) -> None:
    x = gpuarray.zeros(8, np.float32)
    strided = _NonContiguous((8,), np.float32, gpudata=x.gpudata, base=x)
    with pytest.raises(RuntimeError, match="only contiguous arrays"):
        cumath.sin(strided)
    with pytest.raises(RuntimeError, match="out is not contiguous"):
        cumath.sin(x, out=strided)
    with pytest.raises(RuntimeError, match="mod is not contiguous"):
        cumath.fmod(x, strided)


def test_two_argument_functions_check_their_operands(ctx: cuda.Context) -> None:
    x = gpuarray.zeros(6, np.float32)
    with pytest.raises(TypeError, match="arg and mod must have one dtype"):
        cumath.fmod(x, gpuarray.zeros(6, np.float64))
    with pytest.raises(ValueError, match=r"mod has shape \(7,\), expected \(6,\)"):
        cumath.fmod(x, gpuarray.zeros(7, np.float32))
    with pytest.raises(TypeError, match="exponent must have the significand's dtype"):
        cumath.ldexp(x, gpuarray.zeros(6, np.float64))
    with pytest.raises(TypeError, match="exponent must have"):
        cumath.ldexp(x, gpuarray.zeros(6, np.bool_))
    with pytest.raises(ValueError, match="exponent has shape"):
        cumath.ldexp(x, gpuarray.zeros(5, np.int32))


# -- numbers (a real GPU) ---------------------------------------------------------------------

# Inputs inside each function's domain, away from poles.
DOMAINS = {
    "fabs": (-100, 100), "ceil": (-100, 100), "floor": (-100, 100), "exp": (-20, 20),
    "log": (1e-3, 1e3), "log10": (1e-3, 1e3), "sqrt": (0, 1e4), "sin": (-10, 10),
    "cos": (-10, 10), "tan": (-1.4, 1.4), "asin": (-1, 1), "acos": (-1, 1), "atan": (-50, 50),
    "sinh": (-10, 10), "cosh": (-10, 10), "tanh": (-10, 10),
}
EXACT = {"fabs", "ceil", "floor"}


def _tolerances(dtype) -> dict:
    if np.dtype(dtype) in (np.float32, np.complex64):
        return {"rtol": 2e-6, "atol": 1e-6}
    return {"rtol": 1e-13, "atol": 1e-14}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("name", UNARY)
def test_unary_against_numpy(ctx: cuda.Context, name: str, dtype) -> None:
    lo, hi = DOMAINS[name]
    host = rng.uniform(lo, hi, 100_003).astype(dtype)  # several blocks, a ragged end
    host[:4] = np.array([lo, hi, (lo + hi) / 2, lo / 3], dtype)
    x = gpuarray.to_gpu(host)
    result = getattr(cumath, name)(x).get()
    assert result.dtype == np.dtype(dtype)
    expected = getattr(np, {"asin": "arcsin", "acos": "arccos", "atan": "arctan"}.get(name, name))(
        host.astype(np.float64))
    if name in EXACT:
        np.testing.assert_array_equal(result, expected.astype(dtype))
    else:
        np.testing.assert_allclose(result, expected, **_tolerances(dtype))
    assert np.array_equal(x.get(), host)  # the input is left alone


def _complex_input(name: str, dtype, n: int) -> np.ndarray:
    re = rng.uniform(-2, 2, n)
    im = rng.uniform(-2, 2, n)
    if name == "tan":
        re = rng.uniform(-1.2, 1.2, n)  # away from the poles at pi/2 + k*pi
    if name == "tanh":
        im = rng.uniform(-1.2, 1.2, n)
    z = (re + 1j * im).astype(dtype)
    z[:3] = np.array([1 + 0j, -1 + 1e-3j, 0.5j], dtype)
    return z


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("name", sorted(COMPLEX_OK))
def test_complex_against_numpy(ctx: cuda.Context, name: str, dtype) -> None:
    host = _complex_input(name, dtype, 20_001)
    result = getattr(cumath, name)(gpuarray.to_gpu(host)).get()
    assert result.dtype == np.dtype(dtype)
    expected = getattr(np, name)(host.astype(np.complex128))
    tol = {"rtol": 2e-5, "atol": 2e-6} if dtype == np.complex64 else {"rtol": 1e-12,
                                                                     "atol": 1e-13}
    np.testing.assert_allclose(result, expected, **tol)


@pytest.mark.gpu
def test_complex_large_imaginary_parts(ctx: cuda.Context) -> None:
    host = np.array([0.3 + 30j, -1 - 45j, 2 + 400j, 0.1 - 1000j], np.complex128)
    np.testing.assert_allclose(cumath.tan(gpuarray.to_gpu(host)).get(), np.tan(host),
                               rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(cumath.tanh(gpuarray.to_gpu(host * 1j)).get(),
                               np.tanh(host * 1j), rtol=1e-12, atol=1e-15)
    zero = np.array([0j, -0.0 + 0j], np.complex128)
    np.testing.assert_array_equal(cumath.sqrt(gpuarray.to_gpu(zero)).get(), np.sqrt(zero))


@pytest.mark.gpu
def test_out_in_place_stream_and_fortran_order(ctx: cuda.Context) -> None:
    host = np.asfortranarray(rng.uniform(0, 3, (64, 33)))
    x = gpuarray.to_gpu(host)
    y = cumath.sqrt(x)
    assert y.flags.f_contiguous and not y.flags.c_contiguous
    np.testing.assert_allclose(y.get(), np.sqrt(host), rtol=1e-15)
    stream = cuda.Stream()
    out = gpuarray.empty_like(x)
    assert cumath.exp(x, out=out, stream=stream) is out
    stream.synchronize()
    np.testing.assert_allclose(out.get(), np.exp(host), rtol=1e-14)
    assert cumath.sin(x, out=x) is x
    np.testing.assert_allclose(x.get(), np.sin(host), rtol=1e-14, atol=1e-15)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", REAL)
def test_fmod_frexp_ldexp_modf(ctx: cuda.Context, dtype) -> None:
    n = 50_001
    arg = rng.uniform(-1000, 1000, n).astype(dtype)
    arg[:4] = np.array([0.0, -0.0, 1.5, -2.5], dtype)
    mod = rng.uniform(0.5, 30, n).astype(dtype) * rng.choice([-1, 1], n).astype(dtype)
    a_gpu = gpuarray.to_gpu(arg)

    np.testing.assert_array_equal(cumath.fmod(a_gpu, gpuarray.to_gpu(mod)).get(),
                                  np.fmod(arg, mod))

    sig, expt = cumath.frexp(a_gpu)
    want_sig, want_exp = np.frexp(arg)
    np.testing.assert_array_equal(sig.get(), want_sig)
    np.testing.assert_array_equal(expt.get(), want_exp.astype(dtype))

    exps = rng.integers(-20, 20, n).astype(np.int32)
    np.testing.assert_array_equal(cumath.ldexp(a_gpu, gpuarray.to_gpu(exps)).get(),
                                  np.ldexp(arg, exps))
    # PyCUDA's form: exponents as floats of the significand's dtype; round trip of frexp.
    np.testing.assert_array_equal(cumath.ldexp(sig, expt).get(), arg)

    frac, whole = cumath.modf(a_gpu)
    want_frac, want_whole = np.modf(arg)
    np.testing.assert_array_equal(frac.get(), want_frac)
    np.testing.assert_array_equal(whole.get(), want_whole)


@pytest.mark.gpu
def test_ldexp_exponent_dtypes_and_clamping(ctx: cuda.Context) -> None:
    sig = np.array([1.0, 1.0, 0.75, -3.0, 0.0], np.float64)
    exps = {np.int8: [3, -3, 1, 2, 100], np.uint16: [3, 0, 1, 2, 7],
            np.int64: [3, -3, 1, 2, 1 << 40], np.uint64: [3, 0, 1, 2, 1 << 63]}
    for etype, values in exps.items():
        e = np.array(values, etype)
        got = cumath.ldexp(gpuarray.to_gpu(sig), gpuarray.to_gpu(e)).get()
        want = np.ldexp(sig, np.clip(e.astype(np.float64), -1e6, 1e6).astype(np.int64))
        np.testing.assert_array_equal(got, want)
    huge = np.array([1e300, -1e300, np.nan], np.float64)
    got = cumath.ldexp(gpuarray.to_gpu(np.full(3, 2.0)), gpuarray.to_gpu(huge)).get()
    assert got[0] == np.inf and got[1] == 0.0
