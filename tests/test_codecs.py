"""Codecs: byte sizes, round trips, error bounds, edge cases; the numba kernels against the numpy
references (identical bytes); `mpihybrid bench codecs`."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from click.testing import CliRunner

from mpihybrid import _numba
from mpihybrid.cli import main
from mpihybrid.cli.bench import CODEC_OPERATIONS
from mpihybrid.comm.codecs import CODECS, Codec, get_codec
from tests.helpers import run_mpi


def roundtrip(name: str, x: np.ndarray, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(decoded values, encoded bytes) of x."""
    codec = get_codec(name, **kw)
    buf = np.full(codec.nbytes(len(x)), 0xAB, np.uint8)  # garbage: encode must overwrite all
    codec.encode(x, buf)
    out = np.full(len(x), np.nan, np.float32)
    codec.decode(buf, len(x), out)
    return out, buf


def normal(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def test_nbytes() -> None:
    for n in (0, 1, 255, 256, 257, 1000):
        assert get_codec("fp32").nbytes(n) == 4 * n
        assert get_codec("fp16").nbytes(n) == 2 * n
        assert get_codec("bf16").nbytes(n) == 2 * n
        assert get_codec("int8").nbytes(n) == 4 * -(-n // 256) + n
    assert get_codec("int8", block=64).nbytes(1000) == 4 * 16 + 1000


def test_unknown_codec_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="fp32, fp16, bf16, int8"):
        get_codec("fp8")
    with pytest.raises(ValueError, match="block"):
        get_codec("int8", block=0)


def test_lossy_flags() -> None:
    assert [get_codec(n).lossy for n in CODECS] == [False, True, True, True]
    assert [get_codec(n).name for n in CODECS] == list(CODECS)


def test_fp32_is_exact() -> None:
    x = normal(1001)
    out, buf = roundtrip("fp32", x)
    assert np.array_equal(out, x)
    assert np.array_equal(buf.view(np.float32), x)


@pytest.mark.parametrize("name, rel", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_precision_relative_error(name: str, rel: float) -> None:
    # magnitudes spread over many binades, all inside the fp16 normal range
    x = normal(10_000) * np.float32(2.0) ** np.random.default_rng(1).integers(-10, 10, 10_000)
    x = x[np.abs(x) > 2.0**-13].astype(np.float32)
    out, _ = roundtrip(name, x)
    err = np.abs(out.astype(np.float64) - x) / np.abs(x)
    print(name, "max relative error", err.max())
    assert err.max() <= rel
    assert err.max() > rel / 4  # it does round (not a no-op)


def test_fp16_matches_numpy_cast() -> None:
    x = normal(1001, scale=100.0)
    out, buf = roundtrip("fp16", x)
    assert np.array_equal(buf.view(np.float16), x.astype(np.float16))
    assert np.array_equal(out, x.astype(np.float16).astype(np.float32))


def test_bf16_round_to_nearest_even() -> None:
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    x = np.array(
        [
            1.0 + ulp / 2,  # tie, 1.0 is even -> down
            1.0 + 3 * ulp / 2,  # tie, 1 + 2ulp is even -> up
            1.0 + ulp / 2 + 2.0**-20,  # just above a tie -> up
            1.0 + ulp / 2 - 2.0**-20,  # just below a tie -> down
            -(1.0 + 3 * ulp / 2),  # ties are symmetric
        ],
        np.float32,
    )
    out, _ = roundtrip("bf16", x)
    want = np.array([1.0, 1.0 + 2 * ulp, 1.0 + ulp, 1.0, -(1.0 + 2 * ulp)], np.float32)
    assert np.array_equal(out, want)


def test_bf16_special_values() -> None:
    big = np.float32(3.3895314e38)  # largest bf16 value
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, big, np.float32(3.4e38), 1e-40], np.float32)
    nan_low_payload = np.array([0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    out, buf = roundtrip("bf16", np.concatenate([x, nan_low_payload]))
    assert out[0] == np.inf and out[1] == -np.inf
    assert np.isnan(out[2]) and np.isnan(out[-2]) and np.isnan(out[-1])  # NaN stays NaN
    assert out[3] == 0 and not np.signbit(out[3]) and out[4] == 0 and np.signbit(out[4])
    assert out[5] == big
    assert out[6] == np.inf  # past the largest bf16 value rounds to inf, as IEEE does
    assert 0 < out[7] < 2e-40  # float32 subnormals survive
    assert np.array_equal(buf.view(np.uint16)[:2], [0x7F80, 0xFF80])


@pytest.mark.parametrize(
    "count, block", [(1000, 256), (1001, 256), (777, 64), (5, 256), (256, 256)]
)
def test_int8_error_within_half_step(count: int, block: int) -> None:
    # blocks of very different magnitudes: each gets its own scale
    x = normal(count, seed=count) * np.float32(10.0) ** (np.arange(count) // block % 4 - 2)
    x = x.astype(np.float32)
    out, buf = roundtrip("int8", x, block=block)
    nblocks = -(-count // block)
    scales = buf[: 4 * nblocks].view(np.float32)
    want_scales = [np.abs(x[i : i + block]).max() for i in range(0, count, block)]
    assert np.array_equal(scales, want_scales)  # layout: scales first, then the int8 values
    q = buf[4 * nblocks :].view(np.int8)
    assert np.abs(q).max() == 127
    per_element_scale = np.repeat(scales, block)[:count].astype(np.float64)
    err = np.abs(out.astype(np.float64) - x)
    print("int8 max error / (scale / 254)", (err / (per_element_scale / 254)).max())
    assert np.all(err <= per_element_scale / 254 * (1 + 1e-5))


def test_int8_zero_block_and_non_finite() -> None:
    x = np.zeros(600, np.float32)
    x[300:] = normal(300)
    x[520] = np.nan  # third block (512..599) is poisoned, the others are not
    out, buf = roundtrip("int8", x)
    assert np.array_equal(out[:256], np.zeros(256))  # a zero block decodes to zeros
    assert np.all(np.isfinite(out[256:512])) and np.all(np.abs(out[300:512] - x[300:512]) < 0.05)
    assert np.all(np.isnan(out[512:]))  # a NaN poisons its block rather than vanishing
    assert buf.view(np.uint8)[:4].view(np.float32)[0] == 0


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("count", [0, 1, 2, 255, 257])
def test_tiny_counts_and_zeros(name: str, count: int) -> None:
    out, _ = roundtrip(name, np.zeros(count, np.float32))
    assert np.array_equal(out, np.zeros(count))
    x = normal(count, seed=count)
    out, _ = roundtrip(name, x)
    assert np.allclose(out, x, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", CODECS)
def test_decode_add_equals_decode_plus(name: str) -> None:
    codec = get_codec(name, block=100)
    for count in (1001, 17):  # a smaller call after a larger one reuses the scratch buffers
        x, acc = normal(count, seed=1), normal(count, seed=2)
        buf = np.empty(codec.nbytes(count), np.uint8)
        codec.encode(x, buf)
        decoded = np.empty(count, np.float32)
        codec.decode(buf, count, decoded)
        want = acc + decoded
        codec.decode_add(buf, count, acc)
        assert np.array_equal(acc, want)


@pytest.mark.parametrize("name", CODECS)
def test_encode_is_deterministic_and_leaves_input(name: str) -> None:
    x = normal(3000, seed=5)
    x_copy = x.copy()
    _, a = roundtrip(name, x)
    _, b = roundtrip(name, x)
    assert np.array_equal(a, b)
    assert np.array_equal(x, x_copy)


# --- the numba kernels against the numpy references: identical bytes -----------------------

needs_numba = pytest.mark.skipif(
    not _numba.ENABLED, reason=f"no fast path to compare: kernels are {_numba.describe()}"
)
BLOCKS = (1, 7, 256, 4096)
COUNTS = (0, 1, 6, 7, 255, 256, 257, 4096, 4096 * 2 + 13)
SPECIALS = np.array(
    [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-45, 1e-37, -3.4e38, 3.4028235e38,
     65504.0, 65519.99, 65520.0, -1e5, 2.0**-24, 2.0**-25, 3e-8, 6.1e-5, 3.3895314e38, 1.00390625]
    + [v for v in np.array([0x7F800001, 0xFFC12345, 0x7FBFFFFF, 0x7F802000], np.uint32)
       .view(np.float32)],
    np.float32,
)  # fmt: skip


def awkward(count: int, block: int, seed: int) -> np.ndarray:
    """Normal values over 80 binades, with some blocks left alone, some all zero, all tiny
    (denormal or below 127 / FLT_MAX) or sprinkled with inf, NaN, denormals, out-of-range
    values and negative zero."""
    rng = np.random.default_rng(seed)
    x = normal(count, seed) * np.float32(2.0) ** rng.integers(-40, 40, count).astype(np.float32)
    x = x.astype(np.float32)
    for lo in range(0, count, block):
        hi = min(lo + block, count)
        kind = rng.integers(6)
        if kind == 1:
            x[lo:hi] = 0.0
        elif kind == 2:
            x[lo:hi] = normal(hi - lo, seed + lo) * np.float32(1e-40 if lo % 2 else 1e-38)
        elif kind >= 3:
            where = rng.integers(lo, hi, 1 + (hi - lo) // 8)
            x[where] = rng.choice(SPECIALS, len(where))
    return x


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) if a.dtype == np.float32 else a


def assert_same_bits(fast: np.ndarray, ref: np.ndarray, what: str) -> None:
    differ = np.nonzero(bits(fast) != bits(ref))[0]
    print(what, "differing elements", len(differ))
    assert len(differ) == 0, f"{what}: first at {differ[0]}: {fast[differ[0]]} vs {ref[differ[0]]}"


def both(name: str, block: int) -> tuple:
    fast = get_codec(name, block, kernels="auto")
    ref = get_codec(name, block, kernels="numpy")
    assert fast.fast and not ref.fast
    return fast, ref


@needs_numba
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("block", BLOCKS)
def test_kernels_give_the_reference_bytes(name: str, block: int) -> None:
    fast, ref = both(name, block)
    for count in COUNTS:
        x = awkward(count, block, seed=count + block)
        out = {}
        for key, codec in (("fast", fast), ("ref", ref)):
            wire = np.full(codec.nbytes(count), 0xAB, np.uint8)  # garbage: all must be written
            residual = np.full(count, np.nan, np.float32)
            codec.encode(x, wire, residual)
            plain = np.full_like(wire, 0xCD)
            codec.encode(x, plain)  # without the residual: the same bytes
            assert np.array_equal(plain, wire)
            decoded = np.full(count, np.nan, np.float32)
            codec.decode(wire, count, decoded)
            acc = normal(count, seed=3)
            codec.decode_add(wire, count, acc)
            out[key] = wire, residual, decoded, acc
        tag = f"{name} block {block} count {count}"
        assert_same_bits(out["fast"][0], out["ref"][0], f"{tag} encode")
        for i, what in ((1, "residual"), (2, "decode"), (3, "decode-add")):
            assert_same_bits(out["fast"][i], out["ref"][i], f"{tag} {what}")


@needs_numba
@pytest.mark.parametrize("name", CODECS)
def test_kernels_on_misaligned_slices(name: str) -> None:
    # the ring encodes segments of a chunk: any slice of a vector, into any slice of a buffer
    fast, ref = both(name, 100)
    x = awkward(5000, 100, seed=9)[3:4003]
    results = []
    for codec in (fast, ref):
        big = np.zeros(codec.nbytes(len(x)) + 10, np.uint8)
        wire = big[5 : 5 + codec.nbytes(len(x))]
        residual = np.zeros(len(x) + 2, np.float32)[1:-1]
        codec.encode(x, wire, residual)
        acc = normal(len(x) + 1, seed=4)[1:]
        codec.decode_add(wire, len(x), acc)
        results.append((wire.copy(), residual, acc))
    for got, want in zip(results[0], results[1], strict=True):
        assert_same_bits(got, want, name)


@needs_numba
def test_half_precision_decode_of_every_bit_pattern() -> None:
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.uint8)
    for name in ("fp16", "bf16"):
        fast, ref = both(name, 256)
        got, want = np.empty(2**16, np.float32), np.empty(2**16, np.float32)
        fast.decode(every, 2**16, got)
        ref.decode(every, 2**16, want)
        if name == "fp16":
            # a signalling half NaN (never encoded) comes out of numpy's cast quieted or not,
            # depending on its build: only NaN-ness is compared there
            h = every.view(np.uint16)
            signalling = (h & 0x7C00 == 0x7C00) & (h & 0x3FF != 0) & (h & 0x200 == 0)
            assert np.all(np.isnan(got[signalling])) and np.all(np.isnan(want[signalling]))
            got[signalling] = want[signalling] = 0
        assert_same_bits(got, want, f"{name} decode")
        acc_fast, acc_ref = normal(2**16, seed=2), normal(2**16, seed=2)
        fast.decode_add(every, 2**16, acc_fast)
        ref.decode_add(every, 2**16, acc_ref)
        assert_same_bits(acc_fast[~np.isnan(got)], acc_ref[~np.isnan(got)], f"{name} decode-add")


@needs_numba
def test_int8_decode_of_arbitrary_bytes() -> None:
    # scales of every kind (NaN payloads, inf, zero, denormal), any q, -128 included
    fast, ref = both("int8", 7)
    count = 7 * 40 + 3
    wire = np.random.default_rng(5).integers(0, 256, fast.nbytes(count), dtype=np.uint8)
    scales = wire[: 4 * 41].view(np.float32)
    scales[:] = np.random.default_rng(6).choice(SPECIALS, len(scales))
    for op in ("decode", "decode_add"):
        outs = [normal(count, seed=8) for _ in range(2)]
        getattr(fast, op)(wire, count, outs[0])
        getattr(ref, op)(wire, count, outs[1])
        assert_same_bits(outs[0], outs[1], f"int8 {op}")


@pytest.mark.parametrize("kernels", ["auto", "numpy"])
def test_int8_edge_blocks_follow_the_documented_layout(kernels: str) -> None:
    codec = get_codec("int8", block=4, kernels=kernels)
    x = np.array(
        [0, -0.0, 0, 0,  1e-40, -2e-40, 0, 0,  1, np.inf, 2, 0,  np.nan, 1, np.inf, 0,
         -np.nan, 3, 0, 0,  1, -127, 0.5, 63.5],
        np.float32,
    )  # fmt: skip
    wire = np.full(codec.nbytes(len(x)), 0xAB, np.uint8)
    residual = np.empty_like(x)
    codec.encode(x, wire, residual)
    scales, q = wire[:24].view(np.float32), wire[24:].view(np.int8)
    assert list(scales.view(np.uint32)[:5]) == [0, np.float32(2e-40).view(np.uint32),
                                                0x7F800000, 0x7FC00000, 0x7FC00000]  # fmt: skip
    assert scales[5] == 127
    assert np.all(q[:20] == 0)  # zero, too small to invert, holding inf, holding NaN
    assert list(q[20:]) == [1, -127, 0, 64]  # rint: 0.5 and 63.5 go to the even neighbour
    out = np.empty_like(x)
    codec.decode(wire, len(x), out)
    assert np.array_equal(out[:8], np.zeros(8)) and np.all(np.isnan(out[8:20]))
    assert np.array_equal(residual[4:8], x[4:8])  # a tiny block's values stay in the residual
    assert np.array_equal(residual[20:], x[20:] - out[20:])


@pytest.mark.parametrize("kernels", ["auto", "numpy"])
def test_fp16_nan_is_quiet_with_its_top_payload(kernels: str) -> None:
    nans = np.array([0x7F800001, 0xFFA00000, 0x7FC00000, 0xFFFFFFFF], np.uint32)
    codec = get_codec("fp16", kernels=kernels)
    wire = np.empty(8, np.uint8)
    codec.encode(nans.view(np.float32), wire)
    assert [hex(h) for h in wire.view(np.uint16)] == ["0x7e00", "0xff00", "0x7e00", "0xffff"]


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kernels", ["auto", "numpy"])
def test_residual_is_the_encoding_error(name: str, kernels: str) -> None:
    codec = get_codec(name, block=64, kernels=kernels)
    x = normal(1000, seed=11)
    wire = np.empty(codec.nbytes(1000), np.uint8)
    residual = np.full(1000, np.nan, np.float32)
    codec.encode(x, wire, residual)
    decoded = np.empty_like(x)
    codec.decode(wire, 1000, decoded)
    assert np.array_equal(residual, x - decoded)
    assert (np.abs(residual).max() == 0) == (name == "fp32")


@needs_numba
@pytest.mark.parametrize("name", CODECS)
def test_fast_path_does_not_allocate(name: str) -> None:
    codec = get_codec(name, kernels="auto")
    x = normal(100_000, seed=12)
    wire = np.empty(codec.nbytes(len(x)), np.uint8)
    residual, acc = np.empty_like(x), np.zeros_like(x)
    incoming = np.zeros_like(wire)
    calls = [
        lambda: codec.encode(x, wire, residual),
        lambda: codec.decode_add(wire, len(x), acc),
        lambda: codec.reduce_encode(incoming, acc, wire, residual),
    ]
    for call in calls:
        call()  # compile (or load the cache) first
    tracemalloc.start()
    try:
        for call in calls:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(name, "peak traced bytes", peak)
    assert peak < 4096  # a scratch array of this size would be 400 KB


def test_wrong_lengths_are_refused_before_any_kernel_runs() -> None:
    for kernels in ("auto", "numpy"):
        codec = get_codec("int8", kernels=kernels)
        x = normal(300)
        with pytest.raises(ValueError, match="out: expected .* length 308"):
            codec.encode(x, np.empty(307, np.uint8))
        with pytest.raises(ValueError, match="residual"):
            codec.encode(x, np.empty(308, np.uint8), np.empty(299, np.float32))
        with pytest.raises(ValueError, match="out: expected .*float32"):
            codec.decode_add(np.empty(308, np.uint8), 300, np.empty(300, np.float64))
    with pytest.raises(ValueError, match="kernels"):
        get_codec("bf16", kernels="cuda")


# --- mpihybrid bench codecs -------------------------------------------------------------------


def test_bench_codecs_prints_every_operation_for_both_paths() -> None:
    args = ["bench", "codecs", "--size", "64K", "--repeats", "2", "--codecs", "int8,fp16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = [
        line.split() for line in result.output.splitlines() if line.startswith(("int8", "fp16"))
    ]
    assert [r[:2] for r in rows] == [
        [c, op]
        for c in ("int8", "fp16")
        for op in (
            "encode",
            "encode+residual",
            "encode+feedback",
            "decode",
            "decode-add",
            "reduce-encode",
        )  # fmt: skip
    ]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert "64.0 KiB" in result.output and _numba.describe() in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--codecs", "int4"], "unknown codec 'int4'; choose from fp32, fp16, bf16, int8"),
        (["--size", "0"], "--size 0: needs at least 4 bytes (one float32)"),
        (["--size", "-4K"], "--size -4K: needs at least 4 bytes (one float32)"),
        (["--repeats", "0"], "--repeats 0: needs at least 1"),
    ],
)
def test_bench_codecs_rejects_bad_input(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["bench", "codecs", *args])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"mpihybrid: error: {message}"]
    assert "Traceback" not in result.output


@pytest.mark.mpi
def test_bench_codecs_under_mpiexec_prints_once() -> None:
    proc = run_mpi(2, "-m", "mpihybrid", "bench", "codecs", "--size", "16K", "--repeats", "1",
                   "--codecs", "bf16", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("bf16")]
    assert len(rows) == len(CODEC_OPERATIONS)  # one row per operation: printed once, by rank 0


# --- device arrays: the references run on the array module of their arguments ---------------


@pytest.mark.parametrize("name", CODECS)
def test_codecs_run_on_device_arrays_without_host_copies(name: str) -> None:
    from tests import fakegpu  # numpy underneath, but refuses to mix host and device arrays

    codec = get_codec(name, block=7)
    host = get_codec(name, block=7, kernels="numpy")
    for count in (0, 1, 300, 1001):
        x = awkward(count, 7, seed=count)
        acc = normal(count, seed=1)
        want_wire, want_res = np.empty(host.nbytes(count), np.uint8), np.empty_like(x)
        host.encode(x, want_wire, want_res)
        host.decode_add(want_wire, count, acc)
        dx, dacc = fakegpu.asarray(x), fakegpu.asarray(normal(count, seed=1))
        wire, res = fakegpu.empty(codec.nbytes(count), np.uint8), fakegpu.empty(count, np.float32)
        decoded = fakegpu.empty(count, np.float32)
        before = dict(fakegpu.counts)
        codec.encode(dx, wire, res)
        codec.decode(wire, count, decoded)
        codec.decode_add(wire, count, dacc)
        assert dict(fakegpu.counts) == before  # nothing crossed between host and device
        assert_same_bits(wire.get(), want_wire, f"{name} device encode")
        assert_same_bits(res.get(), want_res, f"{name} device residual")
        assert_same_bits(dacc.get(), acc, f"{name} device decode-add")


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kernels", ["auto", "numpy"])
def test_feedback_forms_are_the_two_steps_they_fuse(name: str, kernels: str) -> None:
    """encode(x, add_residual=True) is encode(x + residual) and decode_add(..., residual) is
    out + residual, then + decode: the same bits, in one pass; x is left as it is."""
    codec = get_codec(name, 7, kernels=kernels)
    for count in (0, 1, 7, 300, 4096 * 2 + 13):
        x = awkward(count, 7, seed=count)
        old = normal(count, seed=5, scale=1e-3)
        fused_res, fused_wire = old.copy(), np.full(codec.nbytes(count), 0xAB, np.uint8)
        x_before = x.copy()
        with np.errstate(over="ignore", invalid="ignore"):
            codec.encode(x, fused_wire, fused_res, add_residual=True)
        assert_same_bits(x, x_before, f"{name} {count} input untouched")
        steps_res, steps_wire = np.empty(count, np.float32), np.empty_like(fused_wire)
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN on purpose
            total = x + old
        codec.encode(total, steps_wire, steps_res)
        assert_same_bits(fused_wire, steps_wire, f"{name} {count} encode x + residual")
        assert_same_bits(fused_res, steps_res, f"{name} {count} new residual")
        acc = normal(count, seed=9)
        fused = acc.copy()
        with np.errstate(over="ignore", invalid="ignore"):
            codec.decode_add(fused_wire, count, fused, old)
        steps = acc + old
        with np.errstate(over="ignore", invalid="ignore"):
            codec.decode_add(fused_wire, count, steps)
        assert_same_bits(fused, steps, f"{name} {count} decode-add with residual")
    with pytest.raises(ValueError, match="add_residual needs a residual"):
        codec.encode(np.zeros(3, np.float32), np.zeros(codec.nbytes(3), np.uint8), None, True)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kernels", ["auto", "numpy"])
@pytest.mark.parametrize("feedback", [True, False])
def test_reduce_encode_is_the_three_steps_it_fuses(name: str, kernels: str, feedback: bool) -> None:
    """The ring owner's last hop: decode_add (with the residual), encode (error to the residual)
    and decode of its own bytes, against the numpy reference's three calls, bit for bit, on
    awkward values and on slices that start anywhere. The incoming values are finite (an int8
    block with inf decodes to NaN): where both addends are NaN, IEEE 754 leaves open whose
    payload the sum keeps."""
    codec, ref = get_codec(name, 7, kernels=kernels), get_codec(name, 7, kernels="numpy")
    for count in (0, 1, 7, 300, 4096 * 2 + 13):
        x = awkward(count + 3, 7, seed=count)[3:]
        incoming = np.empty(codec.nbytes(count), np.uint8)
        sent = np.nan_to_num(awkward(count, 7, seed=count + 1), nan=1, posinf=2, neginf=-2)
        ref.encode(sent, incoming)
        old = normal(count, seed=5, scale=1e-3) if feedback else None
        fused_x, fused_wire = x.copy(), np.full(codec.nbytes(count) + 1, 0xAB, np.uint8)[1:]
        fused_res = None if old is None else old.copy()
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN on purpose
            codec.reduce_encode(incoming, fused_x, fused_wire, fused_res)
            steps_x, steps_wire = x.copy(), np.empty_like(fused_wire)
            steps_res = None if old is None else old.copy()
            ref.decode_add(incoming, count, steps_x, steps_res)
            ref.encode(steps_x, steps_wire, steps_res)
            ref.decode(steps_wire, count, steps_x)
        tag = f"{name} {count} feedback={feedback}"
        assert_same_bits(fused_wire, steps_wire, f"{tag} bytes")
        assert_same_bits(fused_x, steps_x, f"{tag} owner's values")
        if feedback:
            assert_same_bits(fused_res, steps_res, f"{tag} new residual")
    with pytest.raises(ValueError, match="out"):
        codec.reduce_encode(incoming, x, np.zeros(3, np.uint8))


def test_bench_codecs_json_and_a_size_no_node_holds() -> None:
    import json

    args = ["bench", "codecs", "--size", "4K", "--repeats", "1", "--codecs", "fp32", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["size_bytes"] == 4096 and doc["repeats"] == 1
    assert [r["operation"] for r in doc["rows"]] == list(CODEC_OPERATIONS)
    assert all(r["fast"] > 0 and r["numpy"] > 0 for r in doc["rows"])
    result = CliRunner().invoke(main, ["bench", "codecs", "--size", "64P"])
    assert result.exit_code == 2 and "bad size" in result.output  # P: no such unit
    result = CliRunner().invoke(main, ["bench", "codecs", "--size", "64G"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output  # was a MemoryError traceback
    assert "needs about 512.0 GiB" in lines[0] and "choose a smaller size" in lines[0]


class _NumpyOnlyCodec(Codec):  # numpy code, no kernel
    name, lossy = "half-numpy", True

    def nbytes(self, count: int) -> int:
        return 2 * count

    def _encode_numpy(self, x: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float16)[:] = x

    def _decode_numpy(self, buf: np.ndarray, count: int, out: np.ndarray) -> None:
        out[:] = buf.view(np.float16)


def test_a_codec_without_kernels_runs_its_numpy_code_wherever_numba_is() -> None:
    # the kernels are optional: a codec written in numpy alone works with numba on, every call
    codec, ref = _NumpyOnlyCodec(), get_codec("fp16", kernels="numpy")
    assert not codec.fast and codec.kernels == frozenset()
    x, residual = normal(1000), np.zeros(1000, np.float32)
    buf, want = np.zeros(2000, np.uint8), np.zeros(2000, np.uint8)
    codec.encode(x, buf, residual, add_residual=True)
    ref.encode(x, want, np.zeros(1000, np.float32), add_residual=True)
    assert np.array_equal(buf, want)
    out = np.ones(1000, np.float32)
    codec.decode_add(buf, 1000, out, residual)
    total = np.zeros(1000, np.float32)
    codec.reduce_encode(buf, total, np.zeros(2000, np.uint8), residual)
    assert np.isfinite(out).all() and np.isfinite(total).all()


def test_an_operation_without_a_kernel_takes_the_reference() -> None:
    # fp32 has no encode-with-feedback kernel: the call runs the reference, not AttributeError
    codec = get_codec("fp32")
    assert "encode_feedback" not in codec.kernels
    x, residual, buf = normal(64), np.full(64, 0.5, np.float32), np.zeros(256, np.uint8)
    codec.encode(x, buf, residual, add_residual=True)
    assert np.array_equal(buf.view(np.float32), x + np.float32(0.5)) and not residual.any()
