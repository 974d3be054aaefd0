"""Codecs: byte sizes, round trips, error bounds, edge cases (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from mpihybrid.comm.codecs import CODECS, get_codec


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
