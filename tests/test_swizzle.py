"""The SM100 128x4 block-scale layout against its closed form (checked against CuTe upstream)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as jn


def closed_form_offsets(l, r, kb, rows, kblocks):
    rt, kt = -(-rows // 128), -(-kblocks // 4)
    return (l * rt * kt * 512 + (r // 128) * kt * 512 + (kb // 4) * 512 + (r % 32) * 16
            + ((r // 32) % 4) * 4 + kb % 4)


@pytest.mark.parametrize("lead,rows,kb", [((), 1, 1), ((), 200, 6), ((3,), 257, 17),
                                          ((2,), 384, 64), ((), 128, 4)])
def test_matches_closed_form(rng, lead, rows, kb):
    raw = rng.integers(1, 0x7F, lead + (rows, kb), dtype=np.uint8)        # no NaN bytes
    sf = jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn))
    sw = np.asarray(jn.swizzle_scales(sf)).view(np.uint8)
    rp, kbp = -(-rows // 128) * 128, -(-kb // 4) * 4
    assert sw.shape == lead + (rp * kbp,)
    flat = sw.reshape(-1)
    nl = int(np.prod(lead)) if lead else 1
    src = raw.reshape(nl, rows, kb)
    ll, rr, kk = np.meshgrid(np.arange(nl), np.arange(rows), np.arange(kb), indexing="ij")
    off = closed_form_offsets(ll, rr, kk, rows, kb)
    np.testing.assert_array_equal(flat[off], src)
    mask = np.ones(flat.shape, bool)
    mask[off.reshape(-1)] = False
    assert np.all(flat[mask] == 0)                       # padding is 0x00, never 0x7F (NaN)
    back = jn.unswizzle_scales(jn.swizzle_scales(sf), rows, kb)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), raw)


def test_bad_input():
    with pytest.raises(ValueError, match="sf: expected float8_e4m3fn"):
        jn.swizzle_scales(jnp.ones((4, 4), jnp.uint8))
    with pytest.raises(ValueError, match=r"sf_swizzled: expected last axis 512 for rows=128, "
                                         r"k_blocks=4, got shape \(100,\)"):
        jn.unswizzle_scales(jnp.zeros((100,), jnp.float8_e4m3fn), 128, 4)
    with pytest.raises(ValueError, match=r"sf_swizzled: expected last axis 1024 for rows=130, "
                                         r"k_blocks=3"):
        jn.unswizzle_scales(jnp.zeros((2, 512), jnp.float8_e4m3fn), 130, 3)
    with pytest.raises(ValueError, match="sf_swizzled: expected float8_e4m3fn, got uint8"):
        jn.unswizzle_scales(jnp.zeros((512,), jnp.uint8), 128, 4)
    with pytest.raises(ValueError, match=r"sf: expected \[\.\.\., rows, K/16\], got shape \(16,\)"):
        jn.swizzle_scales(jnp.zeros((16,), jnp.float8_e4m3fn))
