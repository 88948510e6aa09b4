"""The grouped GEMM's argument checks at their edges (docs/usage.md, "Ranges and out-of-range
input"): group sizes at the ends of int32 (the largest valid, the smallest invalid), the K
multiples each mode needs, and the sm90 layout's N and K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.maths.formats import check_k
from jax_nvfp4.ops.gemm_args import check_group_sizes, group_bounds
from jax_nvfp4.config.options import check_precision
from conftest import QUANTIZE_STACK
from oracles import dequant64
from test_quantization import x64

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)


@pytest.mark.parametrize("kind", ["list", "tuple", "int64 numpy", "int64 list of numpy"])
def test_group_sizes_at_the_ends_of_int32(kind):
    def make(values):
        if kind == "list":
            return list(values)
        if kind == "tuple":
            return tuple(values)
        if kind == "int64 numpy":
            return np.asarray(values, np.int64)
        return [np.int64(v) for v in values]

    got = check_group_sizes(make([I32_MAX, I32_MIN]), 2)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), [I32_MAX, I32_MIN])
    for bad in ([I32_MAX + 1, 0], [0, I32_MIN - 1]):
        with pytest.raises(ValueError, match=r"group_sizes: every size must fit int32"):
            check_group_sizes(make(bad), 2)


def test_group_sizes_other_errors():
    with pytest.raises(ValueError, match=r"group_sizes: expected shape \[3\]"):
        check_group_sizes([1, 2], 3)
    with pytest.raises(ValueError, match="group_sizes: expected integers"):
        check_group_sizes([1, True], 2)
    with pytest.raises(ValueError, match="group_sizes: expected int32 or another integer"):
        check_group_sizes(np.array([1.0, 2.0]), 2)
    a = jnp.array([3, 4], jnp.int32)
    assert check_group_sizes(a, 2) is a or np.array_equal(check_group_sizes(a, 2), a)
    np.testing.assert_array_equal(check_group_sizes(jnp.array([3, 4], jnp.int16), 2), [3, 4])


def test_group_bounds_saturate_at_m():
    """Running sums clamp to M (they saturate, never wrap) and negative sizes count as 0."""
    starts, ends = group_bounds(jnp.array([I32_MAX, I32_MAX, -5, 2], jnp.int32), 10)
    np.testing.assert_array_equal(np.asarray(starts), [0, 10, 10, 10])
    np.testing.assert_array_equal(np.asarray(ends), [10, 10, 10, 10])
    assert starts.dtype == ends.dtype == jnp.int32
    starts, ends = group_bounds(jnp.array([3, -5, 4, 0], jnp.int32), 10)
    np.testing.assert_array_equal(np.asarray(starts), [0, 3, 3, 7])
    np.testing.assert_array_equal(np.asarray(ends), [3, 3, 7, 7])


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_largest_group_size_takes_every_row(rng, backend):
    """A group of 2^31 - 1 rows takes all M rows (the running sum saturates at M)."""
    w = rng.standard_normal((2, 16, 32)).astype(np.float32)
    rhs = QUANTIZE_STACK(jnp.asarray(w))
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.bfloat16)
    out = np.asarray(jn.grouped_gemm(x, rhs, [I32_MAX, I32_MAX], out_dtype=jnp.float32,
                                     backend=backend))
    want = np.asarray(x, np.float64) @ dequant64(rhs.data[0], rhs.scales[0],
                                                 rhs.global_scale[0]).T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="group_sizes: every size must fit int32"):
        jn.grouped_gemm(x, rhs, [I32_MAX + 1, 0], backend=backend)


def test_k_multiples_per_mode():
    for k in (32, 64, 2**20):
        check_k(k)
    for k in (0, -32, 16, 48, 33):
        with pytest.raises(ValueError, match=f"x: the last \\(K\\) axis has size {k}"):
            check_k(k)
    check_precision("fp8", 128)
    check_precision("exact", 96)
    for k in (96, 160, 64):
        with pytest.raises(ValueError, match=f"K={k}: precision='fp8' needs K to be a multiple "
                                             "of 128"):
            check_precision("fp8", k)


def test_k_multiples_through_the_entry_points(rng):
    jn.quantize(jnp.ones((2, 32)))
    with pytest.raises(ValueError, match="K to be a positive multiple of 32"):
        jn.quantize(jnp.ones((2, 48)))
    w = QUANTIZE_STACK(jnp.asarray(rng.standard_normal((1, 128, 96)), jnp.float32))
    x = jnp.ones((4, 96), jnp.bfloat16)
    jn.grouped_gemm(x, w, [4], backend="reference")
    with pytest.raises(ValueError, match="K=96: precision='fp8' needs K to be a multiple of 128"):
        jn.grouped_gemm(x, w, [4], backend="reference", precision="fp8")
    with pytest.raises(ValueError, match=r"x: layout 'fp8' needs K % 128 == 0 .* K = 96"):
        jn.prepare_weights(w, "fp8")


@pytest.mark.parametrize("n,k,ok", [(128, 64, True), (256, 128, True), (64, 64, False),
                                    (192, 64, False), (128, 32, False), (128, 96, False)])
def test_sm90_layout_needs_n_128_and_k_64(rng, n, k, ok):
    w = QUANTIZE_STACK(jnp.asarray(rng.standard_normal((1, n, k)), jnp.float32))
    if ok:
        p = jn.prepare_weights(w)
        assert p.layout == "sm90" and p.data.shape == w.data.shape
        back = jn.prepare_weights(p, "checkpoint")
        np.testing.assert_array_equal(np.asarray(back.data), np.asarray(w.data))
        np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint8),
                                      np.asarray(w.scales).view(np.uint8))
    else:
        with pytest.raises(ValueError, match=rf"x: layout 'sm90' needs .* N % 128 == 0 and K % 64 == 0, got N = {n}, K = {k}"):
            jn.prepare_weights(w)


def test_traced_wide_group_sizes_are_clipped(rng):
    """x64 on: a traced int64 size past int32 is clipped, not wrapped (a wrap of 2^32 + 3 would
    read 3)."""
    with x64():
        f = jax.jit(lambda s: check_group_sizes(s, 2))
        got = np.asarray(f(jnp.array([2**32 + 3, -(2**32) - 3], jnp.int64)))
    np.testing.assert_array_equal(got, [I32_MAX, I32_MIN])
