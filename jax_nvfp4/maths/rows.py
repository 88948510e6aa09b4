"""Row gathers of the MoE layer's dispatch: ``a[rows]`` moved as 32-bit words.

XLA's GPU gather moves one element per thread, so a gather of bf16 rows or of 1-byte codes
(NVFP4 packed codes, e4m3 rows and scales) runs at a fraction of the copy bandwidth. Viewing each
row as uint32 words (a bitcast of the same bytes, free in XLA) moves 2-4 elements per thread.
The values are bit for bit those of ``a[rows]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _as_words_ok(a, rows) -> bool:
    """Whether the rows of ``a`` ``[M, C]`` are whole uint32 words of a 1- or 2-byte dtype, and
    every size is static: a bitcast that changes the shape has no shape refinement, so a
    ``jax.export`` artifact with a symbolic size would not run."""
    size = jnp.dtype(a.dtype).itemsize
    static = all(isinstance(d, int) for d in tuple(a.shape) + tuple(rows.shape))
    return static and a.ndim == 2 and size in (1, 2) and (a.shape[1] * size) % 4 == 0


def _take_words(a, rows):
    per = 4 // jnp.dtype(a.dtype).itemsize
    # the word count spelled out: a reshape with -1 cannot infer it when a has no rows
    words = jax.lax.bitcast_convert_type(a.reshape(a.shape[0], a.shape[1] // per, per),
                                         jnp.uint32)
    out = jax.lax.bitcast_convert_type(words[rows], a.dtype)        # [R, C / per, per]
    return out.reshape(rows.shape[0], a.shape[1])


@jax.custom_jvp
def _take_float_rows(a, rows):
    return _take_words(a, rows)


@_take_float_rows.defjvp
def _take_float_rows_jvp(primals, tangents):
    a, rows = primals
    da, _ = tangents
    return _take_words(a, rows), da[rows]        # linear in da: transposes to a scatter-add


def take_rows(a: jax.Array, rows: jax.Array) -> jax.Array:
    """``a[rows]`` for ``a`` ``[M, C]`` and int ``rows`` ``[R]`` (each in ``[0, M)``): ``[R, C]``
    of a's dtype, bit for bit ``a[rows]``.

    1- and 2-byte dtypes whose rows are whole 32-bit words are gathered as uint32 words when
    the shapes are static; anything else (a symbolic size of ``jax.export`` included) is
    ``a[rows]``. Differentiable in ``a`` like ``a[rows]`` (reverse mode: a
    scatter-add of the cotangent rows).
    """
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not _as_words_ok(a, rows):
        return a[rows]
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return _take_float_rows(a, rows)
    return _take_words(a, rows)
