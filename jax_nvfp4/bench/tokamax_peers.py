"""tokamax's ragged_dot as peers of :mod:`jax_nvfp4.bench.gemm` (rows ``tokamax_bf16`` and
``tokamax_int4``), on the bench's skewed group sizes.

tokamax (and qwix, which makes its int4 weights) are never dependencies of jax_nvfp4: they are
imported inside :func:`tokamax_or_reason`, and where they do not import the rows are skipped with
the reason printed. Both rows call ``tokamax.ragged_dot(x, w, group_sizes)`` in its default
configuration (tokamax picks the implementation: Pallas Mosaic GPU on Hopper, XLA elsewhere):

- ``tokamax_bf16``: the bench's bf16 weights ``[G, K, N]`` (the NVFP4 weights dequantized);
- ``tokamax_int4``: those weights quantized by qwix to int4 with one scale per output channel per
  :data:`INT4_TILE_K` values of K (``qwix.quantize(w, jnp.int4, channelwise_axes=(0, 2),
  tiled_axes={1: 128})``), once, outside the timed call. Not the same numbers as the NVFP4 weights
  (a requantization: ``--check`` prints the difference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_nvfp4.bench.common import time_ms

TOKAMAX_IMPLS = ("tokamax_bf16", "tokamax_int4")
INT4_TILE_K = 128
"""Values of K per int4 scale (and one scale per output channel)."""


def tokamax_or_reason():
    """``((tokamax, qwix), None)`` where both import, else ``(None, reason)``."""
    try:
        import qwix  # noqa: PLC0415 - optional peer, never a dependency
        import tokamax  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - any import failure means: no tokamax peer
        return None, f"tokamax does not import ({type(e).__name__}: {e})"
    from absl import flags  # noqa: PLC0415 - tokamax's ops read absl flags: take the defaults
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return (tokamax, qwix), None


def tokamax_peers(x, wb, sizes, impls, log=print, **timing):
    """``{impl: (median ms, config, output)}`` for the tokamax rows in ``impls``; a row whose
    call fails, or all of them where tokamax does not import, is skipped with the reason logged.

    ``x`` bf16 ``[R, K]``, ``wb`` bf16 ``[G, K, N]``, ``sizes`` int32 ``[G]``; outputs bf16
    ``[R, N]``."""
    wanted = [i for i in TOKAMAX_IMPLS if i in impls]
    if not wanted:
        return {}
    mods, reason = tokamax_or_reason()
    if mods is None:
        for impl in wanted:
            log(f"  {impl} skipped: {reason}")
        return {}
    tokamax, qwix = mods
    f = jax.jit(lambda a, w, s: tokamax.ragged_dot(a, w, s))
    rows = {}
    for impl in wanted:
        try:
            if impl == "tokamax_bf16":
                w, config = wb, "bf16 weights, default configuration"
            else:
                w = jax.jit(lambda w: qwix.quantize(w, jnp.int4, channelwise_axes=(0, 2),
                                                    tiled_axes={1: INT4_TILE_K}))(wb)
                config = (f"int4 weights (qwix, a scale per output channel per {INT4_TILE_K} k), "
                          "default configuration")
            ms = time_ms(f, x, w, sizes, **timing)
            rows[impl] = (ms, config, f(x, w, sizes))
        except Exception as e:  # noqa: BLE001 - a peer's failure never stops the benchmark
            log(f"  {impl} skipped: {type(e).__name__}: {str(e)[:300]}")
    return rows
