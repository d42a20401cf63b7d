"""gpurpc.curandom: rand/randn (Philox4x32-10 written out), CURAND device-API generators,
Sobol direction vectors and scramble constants.

On the fake backend: every kernel module compiles (real NVRTC, curand_kernel.h included)
and loads, the host-side references (Philox, the Sobol recurrence, scrambling) are checked
against their definitions and published answers, and argument errors are checked. The
``gpu`` tests check the numbers themselves: bit for bit against host references where the
output is defined exactly (rand, Sobol), statistically otherwise."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import gpurpc.driver as cuda
from gpurpc import curandom, gpuarray
from gpurpc.compiler import SourceModule

CLASSES = curandom.GENERATOR_CLASSES
PSEUDO = (curandom.XORWOWRandomNumberGenerator, curandom.MRG32k3aRandomNumberGenerator,
          curandom.PhiloxRandomNumberGenerator)
SOBOL = (curandom.Sobol32RandomNumberGenerator, curandom.ScrambledSobol32RandomNumberGenerator,
         curandom.Sobol64RandomNumberGenerator, curandom.ScrambledSobol64RandomNumberGenerator)

# The first dimensions of Joe and Kuo's new-joe-kuo-6 table (polynomial with its leading and
# constant terms, initial direction numbers): enough for host-side checks without any table.
SMALL_POLY = np.array([1, 3, 7, 11, 13, 19, 25])
SMALL_VINIT = np.array([[0, 0, 0, 0], [1, 0, 0, 0], [1, 3, 0, 0], [1, 3, 1, 0], [1, 1, 1, 0],
                        [1, 1, 3, 3], [1, 3, 5, 13]])


def _sobol_points(vectors: np.ndarray, count: int, scramble=None, offset: int = 0
                  ) -> np.ndarray:
    """Points offset..offset+count-1 of every dimension (rows of ``vectors``) by the
    definition CURAND implements: point i is the XOR of the direction vectors selected by the
    bits of gray(i), XORed with the scramble constant. Returns ``(count, dims)``."""
    dims, bits = vectors.shape
    out = np.zeros((count, dims), dtype=vectors.dtype)
    for k in range(count):
        i = offset + k
        gray = i ^ (i >> 1)
        x = np.zeros(dims, dtype=vectors.dtype)
        for b in range(bits):
            if gray >> b & 1:
                x ^= vectors[:, b]
        out[k] = x
    if scramble is not None:
        out ^= scramble[None, :]
    return out


def _stratified(points: np.ndarray, bits: int, m: int) -> bool:
    """True when each of 2**m equal intervals holds exactly one of the first 2**m points."""
    cells = (points[: 1 << m].astype(np.uint64) >> np.uint64(bits - m)).astype(np.int64)
    return bool(np.array_equal(np.sort(cells), np.arange(1 << m)))


# -- host references -------------------------------------------------------------------------

def test_philox_matches_the_published_known_answers() -> None:
    # Random123's known-answer tests for philox4x32_10.
    cases = [
        ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF),
         [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, expected in cases:
        out = curandom.philox4x32_10(np.array([counter], np.uint32), key)
        assert out.dtype == np.uint32 and out[0].tolist() == expected


def test_sobol_recurrence_matches_the_definition() -> None:
    v = curandom.sobol_direction_vectors(SMALL_POLY, SMALL_VINIT, 32)
    assert v.dtype == np.uint32 and v.shape == (7, 32)
    # Dimension 0 is van der Corput: v_k = 2**(31-k).
    assert v[0].tolist() == [1 << (31 - k) for k in range(32)]
    # x^2+x+1 with m = 1, 3: m3 = 2*m2 ^ 4*m1 ^ m1 = 3, m4 = 2*m3 ^ 4*m2 ^ m2 = 9.
    assert v[2, :4].tolist() == [1 << 31, 3 << 30, 3 << 29, 9 << 28]
    v64 = curandom.sobol_direction_vectors(SMALL_POLY, SMALL_VINIT, 64)
    assert v64.dtype == np.uint64
    assert np.array_equal(v64[:, :32] >> np.uint64(32), v.astype(np.uint64))
    # Every dimension is a (0, 1)-sequence: the first 2**m points stratify [0, 1).
    points = _sobol_points(v, 256)
    for d in range(7):
        for m in range(1, 9):
            assert _stratified(points[:, d], 32, m), (d, m)
    # Dimensions 0 and 1 form a (0, 2)-sequence: every elementary box of area 2**-m holds
    # exactly one of the first 2**m points.
    m = 8
    for a in range(m + 1):
        cx = points[:256, 0].astype(np.int64) >> (32 - a) if a else np.zeros(256, np.int64)
        cy = points[:256, 1].astype(np.int64) >> (32 - (m - a)) if a < m else np.zeros(
            256, np.int64)
        assert len(set(zip(cx.tolist(), cy.tolist()))) == 256, a


def test_linear_scrambling_keeps_the_net_property() -> None:
    v = curandom.sobol_direction_vectors(SMALL_POLY, SMALL_VINIT, 32)
    s = curandom._linear_scramble(v, 32, seed=5)
    assert s.dtype == np.uint32 and not np.array_equal(s, v)
    # Unit lower-triangular: v_1 = 0x80000000 keeps its leading digit, gains lower ones.
    assert (s[:, 0] >> 31 == 1).all()
    points = _sobol_points(s, 128, scramble=np.arange(7, dtype=np.uint32) * 0x9E3779B9)
    for d in range(7):
        for m in range(1, 8):
            assert _stratified(points[:, d], 32, m), (d, m)
    s64 = curandom._linear_scramble(curandom.sobol_direction_vectors(SMALL_POLY, SMALL_VINIT,
                                                                     64), 64, seed=5)
    assert s64.dtype == np.uint64 and (s64[:, 0] >> np.uint64(63) == 1).all()


def test_direction_vectors_from_the_joe_kuo_table_equal_curands(monkeypatch) -> None:
    lib = curandom._libcurand()
    table = curandom._joe_kuo_table()
    if lib is None or table is None:
        pytest.skip("needs both libcurand and SciPy's Joe-Kuo table on this machine "
                    f"(libcurand: {lib is not None}, scipy table: {table is not None})")
    from_lib = {s: curandom.host_direction_vectors(20000, s)
                for s in (curandom.direction_vector_set.VECTOR_32,
                          curandom.direction_vector_set.VECTOR_64)}
    monkeypatch.setattr(curandom, "_libcurand_cache", [None])
    for s, expected in from_lib.items():
        assert np.array_equal(curandom.host_direction_vectors(20000, s), expected)


def test_fallbacks_without_libcurand(monkeypatch) -> None:
    monkeypatch.setattr(curandom, "_libcurand_cache", [None])
    monkeypatch.setattr(curandom, "_joe_kuo_cache", [(SMALL_POLY, SMALL_VINIT)])
    assert curandom.direction_vector_source() == "scipy-joe-kuo"
    v = curandom.host_direction_vectors(5, curandom.direction_vector_set.VECTOR_32)
    assert np.array_equal(v, curandom.sobol_direction_vectors(SMALL_POLY[:5], SMALL_VINIT[:5],
                                                              32))
    s = curandom.host_direction_vectors(5, curandom.direction_vector_set.SCRAMBLED_VECTOR_64)
    assert s.shape == (5, 64) and s.dtype == np.uint64
    assert np.array_equal(s, curandom.host_direction_vectors(5, 104))  # fixed seed
    c32 = curandom.host_scramble_constants(20003, 32)
    assert c32.dtype == np.uint32 and c32.shape == (20003,)
    assert np.array_equal(c32[20000:], c32[:3]) and len(np.unique(c32[:20000])) > 19000
    c64 = curandom.host_scramble_constants(4, 64)
    assert c64.dtype == np.uint64 and (c64 > np.uint64(1 << 32)).any()
    monkeypatch.setattr(curandom, "_joe_kuo_cache", [None])
    assert curandom.direction_vector_source() is None
    with pytest.raises(cuda.LogicError, match="libcurand.*SciPy|SciPy.*libcurand"):
        curandom.host_direction_vectors(3)


def test_direction_vector_arguments() -> None:
    with pytest.raises(ValueError, match="unknown direction vector set"):
        curandom.host_direction_vectors(3, 7)
    with pytest.raises(ValueError, match="non-negative integer"):
        curandom.host_direction_vectors(-1)
    with pytest.raises(ValueError, match="bits must be 32 or 64"):
        curandom.host_scramble_constants(3, 16)
    if curandom.direction_vector_source() is not None:
        v = curandom.host_direction_vectors(20002, curandom.direction_vector_set.VECTOR_32)
        assert v.shape == (20002, 32) and np.array_equal(v[20000:], v[:2])  # CURAND cycles
        assert v[0].tolist() == [1 << (31 - k) for k in range(32)]


# -- kernel dispatch and argument checks (no kernel runs) ------------------------------------

def test_dtype_dispatch() -> None:
    for cls in CLASSES:
        assert cls.uniform_kernel(np.float32) == "uniform_float"
        assert cls.uniform_kernel(np.float64) == "uniform_double"
        assert cls.uniform_kernel(np.uint32) == cls.uniform_kernel(np.int32) == "uniform_int"
        if cls.generator_bits == 64:
            assert cls.uniform_kernel(np.uint64) == "uniform_long"
        else:
            with pytest.raises(NotImplementedError, match="64-bit Sobol"):
                cls.uniform_kernel(np.int64)
        with pytest.raises(NotImplementedError, match="not int16"):
            cls.uniform_kernel(np.int16)
        assert cls.poisson_kernel(np.uint32) == "poisson_int"
        with pytest.raises(NotImplementedError, match="uint32 numbers, not float32"):
            cls.poisson_kernel(np.float32)
        with pytest.raises(NotImplementedError, match="not int32"):
            cls.normal_kernel(np.int32, 4, 0)
        two = cls.has_box_muller
        assert cls.normal_kernel(np.float32, 10, 256) == (
            ("normal_float2", 5) if two else ("normal_float", 10))
        assert cls.normal_kernel(np.float32, 9, 256) == ("normal_float", 9)
        assert cls.normal_kernel(np.float64, 10, 256 + 8) == ("normal_double", 10)  # unaligned
        assert cls.normal_kernel(np.float64, 10, 256, log=True) == (
            ("normal_log_double2", 5) if two else ("normal_log_double", 10))
    assert {c.has_box_muller for c in PSEUDO} == {True}
    assert {c.has_box_muller for c in SOBOL} == {False}


def _kernel_in_image(image: bytes, name: str) -> bool:
    return bool(re.search(rb"\.entry\s+" + name.encode() + rb"\s*\(", image)) or (
        b"\0" + name.encode() + b"\0") in image


def test_every_generator_module_compiles_and_loads(ctx: cuda.Context) -> None:
    # The sizes follow the struct definitions in curand_kernel.h.
    expected_sizes = {
        "curandStateSobol32": 4 * (3 + 32), "curandStateScrambledSobol32": 4 * (3 + 32),
        "curandStateSobol64": 8 * (3 + 64), "curandStateScrambledSobol64": 8 * (3 + 64),
    }
    for cls in CLASSES:
        mod = SourceModule(cls.source(), no_extern_c=True)
        for name in cls.kernel_names():
            assert _kernel_in_image(mod.cubin, name), (cls.__name__, name)
        address, size = mod.get_global("gpurpc_state_size")
        assert address and size == expected_sizes.get(cls.state_type_name, size) and size >= 40
    if cuda.Context.get_device().is_fake:
        return
    for cls in CLASSES:
        if cls in SOBOL and curandom.direction_vector_source() is None:
            continue
        gen = cls()
        assert gen.generator_count == gen.block_count * gen.generators_per_block
        assert gen.state_size == SourceModule(cls.source(), no_extern_c=True).get_global(
            "gpurpc_state_size")[1]


def test_rand_module_compiles_and_rejects_bad_arguments(ctx: cuda.Context) -> None:
    mod = SourceModule(curandom._RAND_SOURCE)
    for name in ("gpurpc_rand_u32", "gpurpc_rand_u64", "gpurpc_rand_f32", "gpurpc_rand_f64",
                 "gpurpc_randn_f32", "gpurpc_randn_f64"):
        assert _kernel_in_image(mod.cubin, name), name
    with pytest.raises(NotImplementedError, match="rand does not make int16"):
        curandom.rand(8, np.int16)
    with pytest.raises(NotImplementedError, match="randn does not make int32"):
        curandom.randn(8, np.int32)
    with pytest.raises(ValueError, match="seed must be an integer"):
        curandom.rand(8, seed=-1)
    with pytest.raises(ValueError, match="seed must be an integer"):
        curandom.rand(8, seed=2**64)
    empty = curandom.rand((0, 3), np.float64, seed=1)
    assert empty.shape == (0, 3) and empty.dtype == np.float64


def test_seed_getters(ctx: cuda.Context) -> None:
    unique = curandom.seed_getter_unique(1000)
    assert unique.dtype == np.int32 and unique.shape == (1000,)
    values = unique.get()
    assert (values >= 0).all() and len(np.unique(values)) > 990
    uniform = curandom.seed_getter_uniform(100)
    assert uniform.dtype == np.int32 and uniform.shape == (100,)
    got = uniform.get()
    assert (got == got[0]).all() and got[0] >= 0


def test_generate_direction_vectors_and_constants_upload(ctx: cuda.Context) -> None:
    if curandom.direction_vector_source() is None:
        with pytest.raises(cuda.LogicError, match="dir_vector="):
            curandom.generate_direction_vectors(4)
        return
    for s, dtype, bits in ((curandom.direction_vector_set.VECTOR_32, np.uint32, 32),
                           (curandom.direction_vector_set.SCRAMBLED_VECTOR_32, np.uint32, 32),
                           (curandom.direction_vector_set.VECTOR_64, np.uint64, 64),
                           (curandom.direction_vector_set.SCRAMBLED_VECTOR_64, np.uint64, 64)):
        dv = curandom.generate_direction_vectors(300, s)
        assert dv.dtype == dtype and dv.shape == (300, bits)
        assert np.array_equal(dv.get(), curandom.host_direction_vectors(300, s))
    c = curandom.generate_scramble_constants64(10)
    assert c.dtype == np.uint64 and np.array_equal(c.get(), curandom.host_scramble_constants(10,
                                                                                            64))
    assert curandom.generate_scramble_constants32(3).dtype == np.uint32


def test_get_curand_version(daemon: str) -> None:
    version = curandom.get_curand_version()
    assert isinstance(version, tuple) and len(version) == 3
    assert version == cuda.get_version()


# -- on a GPU --------------------------------------------------------------------------------

def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])


def _check_normal(sample: np.ndarray, mean: float = 0.0, std: float = 1.0,
                  quasi: bool = False) -> None:
    x = np.sort(sample.astype(np.float64).ravel())
    n = x.size
    assert np.isfinite(x).all()
    assert abs(x.mean() - mean) < 6 * std / math.sqrt(n) + (0.01 if quasi else 0)
    assert abs(x.std() / std - 1) < 6 * math.sqrt(0.5 / n) + (0.02 if quasi else 0)
    grid = np.linspace(-3.5, 3.5, 141)
    empirical = np.searchsorted(x, mean + std * grid, side="right") / n
    ks = np.abs(empirical - _normal_cdf(grid)).max()
    assert ks < 2.5 / math.sqrt(n) + (0.01 if quasi else 0), ks


def _check_uniform(sample: np.ndarray, quasi: bool = False) -> None:
    u = sample.astype(np.float64).ravel()
    n = u.size
    assert (u > 0).all() and (u <= 1).all()
    slack = 0.01 if quasi else 0
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / n) + slack
    assert abs(u.var() - 1 / 12) < 6 * math.sqrt(1 / 180 / n) + slack
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    assert np.abs(counts / n - 1 / 64).max() < 6 * math.sqrt(1 / 64 / n) + slack


@pytest.mark.gpu
def test_rand_is_philox_bit_for_bit(ctx: cuda.Context) -> None:
    seed = 0x0123456789ABCDEF
    key = (seed & 0xFFFFFFFF, seed >> 32)
    n = 100003  # not a multiple of 4

    def words(groups: int) -> np.ndarray:
        counters = np.zeros((groups, 4), np.uint32)
        counters[:, 0] = np.arange(groups, dtype=np.uint32)
        return curandom.philox4x32_10(counters, key)

    flat = words((n + 3) // 4).ravel()[:n]
    got = curandom.rand(n, np.uint32, seed=seed).get()
    assert np.array_equal(got, flat)
    assert np.array_equal(curandom.rand(n, np.int32, seed=seed).get(), flat.view(np.int32))
    f32 = curandom.rand((n,), np.float32, seed=seed).get()
    assert np.array_equal(f32, (flat >> 8).astype(np.float32) * np.float32(2.0**-24))
    pairs = words((n + 1) // 2).reshape(-1, 2)[:n]  # element 2g+j: words 2j, 2j+1 of g
    f64 = curandom.rand(n, np.float64, seed=seed).get()
    hi, lo = pairs[:, 0].astype(np.float64), pairs[:, 1].astype(np.float64)
    expected = (np.floor(hi / 32) * 67108864.0 + np.floor(lo / 64)) * 2.0**-53
    assert np.array_equal(f64, expected)
    u64 = curandom.rand(n, np.uint64, seed=seed).get()
    assert np.array_equal(u64, (pairs[:, 0].astype(np.uint64) << np.uint64(32))
                          | pairs[:, 1].astype(np.uint64))
    assert not np.array_equal(curandom.rand(64, np.uint32, seed=seed + 1).get(), flat[:64])
    big = curandom.rand((1 << 22,), np.float32).get()
    assert big.min() >= 0 and big.max() < 1
    _check_uniform(big + np.float32(2.0**-25))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_randn_is_normal(ctx: cuda.Context, dtype) -> None:
    sample = curandom.randn((1 << 21,), dtype, seed=99).get()
    assert sample.dtype == dtype
    _check_normal(sample)
    # Box-Muller of the same Philox words, computed here.
    words = curandom.philox4x32_10(
        np.stack([np.arange(8, dtype=np.uint32)] + [np.zeros(8, np.uint32)] * 3, axis=1),
        (99, 0)).astype(np.float64)
    if dtype == np.float32:
        u1 = (np.floor(words[:, 0::2] / 256) + 1) * 2.0**-24
        u2 = np.floor(words[:, 1::2] / 256) * 2.0**-24
        r = np.sqrt(-2 * np.log(u1))
        ref = np.stack([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)], axis=2)
        ref = ref.reshape(-1)
        assert np.allclose(sample[:32], ref, rtol=1e-4, atol=1e-5)
    else:
        u1 = 1 - (np.floor(words[:, 0] / 32) * 67108864.0 + np.floor(words[:, 1] / 64)) * 2.0**-53
        u2 = (np.floor(words[:, 2] / 32) * 67108864.0 + np.floor(words[:, 3] / 64)) * 2.0**-53
        r = np.sqrt(-2 * np.log(u1))
        ref = np.stack([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)], axis=1)
        assert np.allclose(sample[:16], ref.reshape(-1), rtol=1e-12, atol=1e-12)


def _needs_direction_vectors() -> None:
    if curandom.direction_vector_source() is None:
        pytest.skip("no Sobol direction vectors on this machine: needs libcurand or SciPy")


def _fixed_seeds(n: int) -> gpuarray.GPUArray:
    return gpuarray.to_gpu((np.arange(n, dtype=np.int64) * 7919 % (2**31 - 1)).astype(np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("cls", PSEUDO, ids=lambda c: c.__name__)
def test_pseudo_random_distributions(ctx: cuda.Context, cls) -> None:
    gen = cls(seed_getter=curandom.seed_getter_unique)
    n = 1 << 21
    for dtype in (np.float32, np.float64):
        _check_uniform(gen.gen_uniform((n,), dtype).get())
        _check_normal(gen.gen_normal((n,), dtype).get())
        odd = gen.gen_normal((n + 1,), dtype).get()  # the one-at-a-time kernel
        _check_normal(odd)
        log = gen.gen_log_normal((n,), dtype, 0.5, 0.25).get()
        assert (log > 0).all()
        _check_normal(np.log(log), mean=0.5, std=0.25)
    bits = gen.gen_uniform((n,), np.uint32).get()
    for b in (0, 7, 16, 31):  # every bit is a fair coin
        assert abs(((bits >> b) & 1).mean() - 0.5) < 6 * math.sqrt(0.25 / n)
    for lam in (0.5, 4.0, 1000.0):
        p = gen.gen_poisson((n,), np.uint32, lam).get().astype(np.float64)
        assert abs(p.mean() - lam) < 6 * math.sqrt(lam / n)
        assert abs(p.var() / lam - 1) < 0.02
    small = gen.gen_poisson((n,), np.uint32, 2.0).get()
    freq = np.bincount(small, minlength=6)[:6] / n
    pmf = np.array([math.exp(-2.0) * 2.0**k / math.factorial(k) for k in range(6)])
    assert np.abs(freq - pmf).max() < 6 * math.sqrt(0.25 / n)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", PSEUDO, ids=lambda c: c.__name__)
def test_pseudo_random_skip_ahead_and_offset(ctx: cuda.Context, cls) -> None:
    a = cls(seed_getter=_fixed_seeds)
    count = a.generator_count
    first = a.gen_uniform((3 * count,), np.uint32).get().reshape(3, count)
    b = cls(seed_getter=_fixed_seeds)
    b.call_skip_ahead(2)
    assert np.array_equal(b.gen_uniform((count,), np.uint32).get(), first[2])
    c = cls(seed_getter=_fixed_seeds, offset=1)
    assert np.array_equal(c.gen_uniform((2 * count,), np.uint32).get(),
                          first[1:].ravel())
    d = cls(seed_getter=_fixed_seeds)
    skips = (np.arange(count) % 3).astype(np.uint64)
    d.call_skip_ahead_array(gpuarray.to_gpu(skips))
    assert np.array_equal(d.gen_uniform((count,), np.uint32).get(),
                          first[skips.astype(np.int64), np.arange(count)])
    with pytest.raises(TypeError, match=f"GPUArray of {count} uint64"):
        d.call_skip_ahead_array(gpuarray.to_gpu(skips[:-1]))
    # One seed for all: generator t starts at subsequence t (MRG32k3a: of 2**76 values), so
    # skipping one subsequence makes generator t produce what generator t+1 did.
    same = lambda n: gpuarray.to_gpu(np.full(n, 12345, np.int32))  # noqa: E731
    mrg = cls is curandom.MRG32k3aRandomNumberGenerator
    step = "subsequence" if mrg else "sequence"
    e = cls(seed_getter=same)
    ref = e.gen_uniform((count,), np.uint32).get()
    assert len(np.unique(ref)) > count * 0.99
    f = cls(seed_getter=same)
    getattr(f, f"call_skip_ahead_{step}")(1)
    assert np.array_equal(f.gen_uniform((count,), np.uint32).get()[:-1], ref[1:])
    g = cls(seed_getter=same)
    getattr(g, f"call_skip_ahead_{step}_array")(gpuarray.to_gpu(np.ones(count, np.uint64)))
    assert np.array_equal(g.gen_uniform((count,), np.uint32).get()[:-1], ref[1:])
    if mrg:  # sequences of 2**127 values: the scalar and the array form agree
        h = cls(seed_getter=same)
        h.call_skip_ahead_sequence(1)
        i = cls(seed_getter=same)
        i.call_skip_ahead_sequence_array(gpuarray.to_gpu(np.ones(count, np.uint64)))
        seq = h.gen_uniform((count,), np.uint32).get()
        assert np.array_equal(seq, i.gen_uniform((count,), np.uint32).get())
        assert not np.array_equal(seq, ref)
    with pytest.raises(ValueError, match="skip must be an integer"):
        a.call_skip_ahead(-1)
    with pytest.raises(TypeError, match="seed_getter"):
        cls(seed_getter=lambda n: gpuarray.to_gpu(np.zeros(n - 1, np.int32)))
    with pytest.raises(TypeError, match="needs a gpurpc.gpuarray.GPUArray"):
        a.fill_uniform(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="stddev must be positive"):
        a.gen_log_normal((4,), np.float32, 0.0, 0.0)
    with pytest.raises(ValueError, match="lambda_value must be positive"):
        a.gen_poisson((4,), np.uint32, -1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", SOBOL, ids=lambda c: c.__name__)
def test_sobol_points_bit_for_bit(ctx: cuda.Context, cls) -> None:
    _needs_direction_vectors()
    gen = cls()
    count = gen.generator_count
    bits = cls.generator_bits
    k = 16
    vectors = gen.dir_vector.get()
    scramble = gen.scramble_vector.get() if cls._scrambled else None
    expected = _sobol_points(vectors, k, scramble)
    raw_dtype = np.uint32 if bits == 32 else np.uint64
    got = gen.gen_uniform((k * count,), raw_dtype).get().reshape(k, count)
    assert np.array_equal(got, expected)
    if not cls._scrambled:
        assert (expected[0] == 0).all()  # every dimension starts at the origin
    # The next 16 points as floats: CURAND's (x + 1/2) / 2**32 of the high 32 bits.
    nxt = _sobol_points(vectors, k, scramble, offset=k)
    high = nxt >> np.uint64(32) if bits == 64 else nxt
    f = gen.gen_uniform((k * count,), np.float32).get().reshape(k, count)
    expected_f = (high.astype(np.uint32).astype(np.float32) * np.float32(2.0**-32)
                  + np.float32(2.0**-33))  # CURAND's float arithmetic (the product is exact)
    assert np.array_equal(f, expected_f)
    if bits == 64:  # 32-bit output of a 64-bit generator: the high half
        third = _sobol_points(vectors, k, scramble, offset=2 * k)
        ints = gen.gen_uniform((k * count,), np.uint32).get().reshape(k, count)
        assert np.array_equal(ints, (third >> np.uint64(32)).astype(np.uint32))
    # offset and skip-ahead land on the same points
    off = cls(dir_vector=gen.dir_vector, offset=5, **(
        {"scramble_vector": gen.scramble_vector} if cls._scrambled else {}))
    assert np.array_equal(off.gen_uniform((count,), raw_dtype).get(),
                          _sobol_points(vectors, 1, scramble, offset=5)[0])
    fresh = cls(dir_vector=gen.dir_vector, **(
        {"scramble_vector": gen.scramble_vector} if cls._scrambled else {}))
    fresh.call_skip_ahead(5)
    assert np.array_equal(fresh.gen_uniform((count,), raw_dtype).get(),
                          _sobol_points(vectors, 1, scramble, offset=5)[0])
    skip_dtype = np.uint32 if bits == 32 else np.uint64
    arr = cls(dir_vector=gen.dir_vector, **(
        {"scramble_vector": gen.scramble_vector} if cls._scrambled else {}))
    arr.call_skip_ahead_array(gpuarray.to_gpu(np.full(count, 5, skip_dtype)))
    assert np.array_equal(arr.gen_uniform((count,), raw_dtype).get(),
                          _sobol_points(vectors, 1, scramble, offset=5)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("cls", SOBOL, ids=lambda c: c.__name__)
def test_sobol_low_discrepancy_and_distributions(ctx: cuda.Context, cls) -> None:
    _needs_direction_vectors()
    gen = cls()
    count = gen.generator_count
    bits = cls.generator_bits
    raw_dtype = np.uint32 if bits == 32 else np.uint64
    m = 6
    points = gen.gen_uniform(((1 << m) * count,), raw_dtype).get().reshape(1 << m, count)
    for t in range(0, count, max(1, count // 97)):
        for mm in range(1, m + 1):
            assert _stratified(points[:, t], bits, mm), (t, mm)
    n = 64 * count
    _check_uniform(gen.gen_uniform((n,), np.float64).get(), quasi=True)
    _check_normal(gen.gen_normal((n,), np.float32).get(), quasi=True)
    log = gen.gen_log_normal((n,), np.float64, -1.0, 0.5).get()
    _check_normal(np.log(log), mean=-1.0, std=0.5, quasi=True)
    p = gen.gen_poisson((n,), np.uint32, 7.5).get().astype(np.float64)
    assert abs(p.mean() - 7.5) < 0.05 and abs(p.var() / 7.5 - 1) < 0.05


@pytest.mark.gpu
def test_sobol_arguments_are_checked(ctx: cuda.Context) -> None:
    _needs_direction_vectors()
    gen = curandom.Sobol32RandomNumberGenerator()
    count = gen.generator_count
    with pytest.raises(TypeError, match=rf"dir_vector must be a GPUArray of shape \({count}, 32\)"):
        curandom.Sobol32RandomNumberGenerator(dir_vector=gpuarray.to_gpu(
            np.zeros((count, 64), np.uint32)))
    with pytest.raises(TypeError, match="scramble_vector must be a GPUArray"):
        curandom.ScrambledSobol32RandomNumberGenerator(scramble_vector=gpuarray.to_gpu(
            np.zeros(count, np.uint64)))
    with pytest.raises(ValueError, match=r"offset must be an integer in \[0, 2\*\*32\)"):
        curandom.Sobol32RandomNumberGenerator(offset=2**32)
    with pytest.raises(ValueError, match=r"skip must be an integer in \[0, 2\*\*32\)"):
        gen.call_skip_ahead(2**32)
    with pytest.raises(NotImplementedError, match="64-bit Sobol"):
        gen.gen_uniform((4,), np.uint64)
