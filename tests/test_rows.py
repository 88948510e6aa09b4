"""jax_nvfp4.maths.rows: the dispatch's row gathers as 32-bit words, bit for bit ``a[rows]``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nvfp4.maths.rows import take_rows


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16 if a.dtype.itemsize == 2
                                                                  else np.uint32)


@pytest.mark.parametrize("dtype,cols", [
    (jnp.bfloat16, 64), (jnp.bfloat16, 6), (jnp.bfloat16, 5), (jnp.uint8, 36), (jnp.uint8, 7),
    (jnp.float8_e4m3fn, 128), (jnp.float32, 8), (jnp.int32, 3)])
def test_take_rows_equals_numpy_indexing(rng, dtype, cols):
    raw = rng.integers(0, 256, (13, cols * jnp.dtype(dtype).itemsize), dtype=np.uint8)
    a_np = raw.view(jnp.dtype(dtype))                    # every bit pattern, NaNs included
    rows = rng.integers(0, 13, 40).astype(np.int32)
    want = a_np[rows]
    got = jax.jit(take_rows)(jnp.asarray(a_np), jnp.asarray(rows))
    assert got.dtype == a_np.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # a closed-over constant takes XLA's constant folding, not the argument path
    const = jax.jit(lambda r: take_rows(jnp.asarray(a_np), r))(jnp.asarray(rows))
    np.testing.assert_array_equal(_bits(const), _bits(want))


@pytest.mark.parametrize("dtype,cols,gathered", [
    (jnp.bfloat16, 64, "4x32xui32"), (jnp.bfloat16, 6, "4x3xui32"), (jnp.bfloat16, 2, "4x1xui32"),
    (jnp.uint8, 36, "4x9xui32"), (jnp.float8_e4m3fn, 4, "4x1xui32"),
    (jnp.bfloat16, 5, "4x5xbf16"), (jnp.uint8, 6, "4x6xui8"), (jnp.float32, 8, "4x8xf32")])
def test_take_rows_gathers_words(rng, dtype, cols, gathered):
    """1- and 2-byte rows that are whole 32-bit words are gathered as uint32 words (the module's
    contract); any other row is gathered as it is."""
    a = jnp.asarray(rng.standard_normal((8, cols)), dtype)
    rows = jnp.asarray([3, 1, 1, 7], jnp.int32)
    hlo = jax.jit(take_rows).lower(a, rows).as_text()
    gathers = [ln.split("->")[-1] for ln in hlo.splitlines() if "stablehlo.gather" in ln]
    assert gathers == [f" tensor<{gathered}>"], gathers
    assert np.asarray(take_rows(a, rows)).dtype == jnp.dtype(dtype)


def test_take_rows_gradient_is_the_gathers(rng):
    a = jnp.asarray(rng.standard_normal((6, 8)), jnp.bfloat16)
    rows = jnp.asarray([0, 5, 5, 2, 0, 0], jnp.int32)
    ct = jnp.asarray(rng.standard_normal((6, 8)), jnp.bfloat16)
    f = lambda a: jnp.sum((take_rows(a, rows) * ct).astype(jnp.float32))   # noqa: E731
    g = lambda a: jnp.sum((a[rows] * ct).astype(jnp.float32))             # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(a), np.float32),
                                  np.asarray(jax.grad(g)(a), np.float32))
    t = jnp.ones_like(a)
    _, jvp = jax.jvp(lambda a: take_rows(a, rows), (a,), (t,))
    np.testing.assert_array_equal(np.asarray(jvp, np.float32), np.asarray(t[rows], np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.uint8, jnp.float8_e4m3fn])
def test_take_rows_of_no_rows(dtype):
    # the fp8 layer on zero tokens gathers from [0, K] e4m3 rows (issue 46 item 2)
    a = jnp.zeros((0, 128), dtype)
    got = jax.jit(take_rows)(a, jnp.zeros((0,), jnp.int32))
    assert got.shape == (0, 128) and got.dtype == dtype
    assert take_rows(jnp.ones((3, 128), dtype), jnp.zeros((0,), jnp.int32)).shape == (0, 128)
