"""The CUTLASS SM100 ("128x4") block-scale layout, for the Blackwell path.

Byte offset of scale (l, r, kb) with Rt = ceil(R/128), Kt = ceil(KB/4):
``l*Rt*Kt*512 + (r//128)*Kt*512 + (kb//4)*512 + (r%32)*16 + ((r//32)%4)*4 + kb%4``.
Rows are padded to 128 and K-blocks to 4 with 0x00 (0x7F would be NaN in e4m3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_scales(sf, name):
    sf = jnp.asarray(sf)
    if sf.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{name}: expected float8_e4m3fn block scales, got {sf.dtype}")
    if sf.ndim < 2:
        raise ValueError(f"{name}: expected [..., rows, K/16], got shape {sf.shape}")
    return sf


def swizzle_scales(sf: jax.Array) -> jax.Array:
    """Row-major scales float8_e4m3fn ``[..., R, KB]`` -> swizzled ``[..., Rp * KBp]``.

    ``Rp = ceil(R/128)*128`` and ``KBp = ceil(KB/4)*4``; each leading index is one batch (L) of
    the closed form above, laid out contiguously.
    """
    sf = _check_scales(sf, "sf")
    lead, (r, kb) = sf.shape[:-2], sf.shape[-2:]
    rp, kbp = -(-r // 128) * 128, -(-kb // 4) * 4
    x = sf.reshape((-1, r, kb))
    x = jnp.pad(x, ((0, 0), (0, rp - r), (0, kbp - kb)))  # zero bytes
    x = x.reshape(x.shape[0], rp // 128, 4, 32, kbp // 4, 4)   # (l, rt, r1, r0, kt, k0)
    x = x.transpose(0, 1, 4, 3, 2, 5)                          # (l, rt, kt, r0, r1, k0)
    return x.reshape(lead + (rp * kbp,))


def unswizzle_scales(sf_swizzled: jax.Array, rows: int, k_blocks: int) -> jax.Array:
    """Inverse of :func:`swizzle_scales`: ``[..., Rp * KBp]`` -> ``[..., rows, k_blocks]``."""
    sf = jnp.asarray(sf_swizzled)
    if sf.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"sf_swizzled: expected float8_e4m3fn, got {sf.dtype}")
    rp, kbp = -(-rows // 128) * 128, -(-k_blocks // 4) * 4
    if sf.ndim < 1 or sf.shape[-1] != rp * kbp:
        raise ValueError(f"sf_swizzled: expected last axis {rp * kbp} for rows={rows}, "
                         f"k_blocks={k_blocks}, got shape {sf.shape}")
    lead = sf.shape[:-1]
    x = sf.reshape(-1, rp // 128, kbp // 4, 32, 4, 4)            # (l, rt, kt, r0, r1, k0)
    x = x.transpose(0, 1, 4, 3, 2, 5).reshape(-1, rp, kbp)       # (l, rt, r1, r0, kt, k0)
    return x[:, :rows, :k_blocks].reshape(lead + (rows, k_blocks))
