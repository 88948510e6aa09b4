"""The NVFP4 MoE layer: route, dispatch, gate/up GEMM, SwiGLU, requantize, down GEMM, combine.

Activation scales (W4A4). Neither kind depends on which other tokens share the batch or the
device, so the answer is the same on 1 or 8 devices:

* ``activation_scale="dynamic"``: each GEMM input row (one token for one expert) is quantized
  with its own global scale ``amax(row) / 2688`` (finite values; 1.0 for a zero row), applied
  to that output row in float32 after the GEMM.
* ``activation_scale="static"``: the checkpoint's calibrated input scale of each expert
  (ModelOpt ``input_scale``, Quark ``input_scale_2``; max over gate and up), folded into the
  GEMM epilogue factor ``alpha_e = input_scale_e * weight_scale_2_e``. It is a calibration
  constant: real activations can exceed it and then saturate at ``6 * 448 * input_scale`` (the
  system this library descends from learned that the hard way; dynamic is the default).

When gate and up carry different ``weight_scale_2`` (w13 global_scale ``[E, 2]``) each half is scaled by
its own factor on the float32 GEMM output, never by re-rounding block scales.

Rows in bf16 (``config.row_dtype``, :func:`row_dtype`; "float32" keeps them float32). Each routed
row's SwiGLU activation is rounded to bf16 before the down GEMM (W4A4 then quantizes the bf16 row),
and the down GEMM writes each expert's output row in bf16 (W4A4 dynamic: before the row's
activation scale, applied in float32); the combine sums ``route_weight * row`` over the top-k slots
in float32. No float32 ``[rows, features]`` array is written between the GEMMs or before the
combine.

The fused SwiGLU epilogue. When ``weights.w13_paired`` (gate/up rows paired, as
:func:`jax_nvfp4.prepare_weights` leaves them with the sm90 layout) and ``config.precision`` is
"exact", the gate/up GEMM and the SwiGLU of the routed and the shared expert are one call,
:func:`jax_nvfp4.grouped_gemm_swiglu`, on the same GEMM input (bf16 rows, or NVFP4 rows quantized
once per token and gathered): per row, ``h = acc * alpha_half`` (``alpha_half`` = that half's
weight global scale, times the static input scale for W4A4 static), then ``h * row_scale`` (W4A4
dynamic: the row's activation scale), then ``silu(min(gate, L)) * clip(up, -L, L)`` with
``silu(x) = x / (1 + exp(-x))`` in float32; out in the row dtype. Against the
unfused path only float32 ulps differ (the silu formula, the order of the epilogue factors), which
can move a bf16 rounding or a requantized code by one step. The reverse-mode derivative is the
unfused path's (recomputed in the backward). Paired weights with ``precision="fp8"`` run the
unfused path with the SwiGLU and the per-half scales on the paired column order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import autodiff
from ..maths import qwix_interop
from ..ops.dispatch import dispatch_rows, dispatch_rows_dynamic
from ..maths.formats import Fp8Weights, NVFP4Tensor, keep_rounded
from ..ops.gemm import checked_grouped_gemm, checked_grouped_gemm_swiglu, check_rows_hint
from ..ops.gemm_args import GLU_ROW_BLOCK, check_rhs_precision, round_to
from ..config.moe_params import MoEConfig, MoEWeights, known_range
from ..config import kernel_config
from ..config.options import FP8_LAYOUT, REFERENCE, resolve_backend
from ..maths.quantization import MAX_GLOBAL_SCALE, MIN_GLOBAL_SCALE, dynamic_global_scale, quantize
from ..ops.reference import split_paired
from .routing import check_hash_table, route
from ..maths.rows import take_rows


def row_dtype(config: MoEConfig):
    """The dtype the layer rounds its ``[rows, features]`` intermediates to (``config.row_dtype``):
    each routed row's SwiGLU activation (the down GEMM's input) and its down-GEMM output, before
    the weighted combine (which sums in float32). bf16 halves the bytes between the GEMMs and in
    the combine."""
    return jnp.dtype(config.row_dtype)


@jax.custom_jvp
def _round_bf16(a: jax.Array) -> jax.Array:
    """float ``a`` rounded to bf16 values, as float32 (:func:`jax_nvfp4.ops.reference.round_to`);
    straight-through (identity) in the derivative, like the GEMM inputs' roundings."""
    return round_to(a.astype(jnp.float32), jnp.bfloat16)


_round_bf16.defjvp(lambda primals, tangents: (_round_bf16(*primals),
                                              tangents[0].astype(jnp.float32)))


def _round_rows(a: jax.Array, config: MoEConfig) -> jax.Array:
    """float32 ``a`` rounded to :func:`row_dtype`, as float32 (a GEMM's output in the row dtype
    is already rounded by every backend: it only needs widening)."""
    return a.astype(jnp.float32) if row_dtype(config) == jnp.float32 else _round_bf16(a)


def swiglu(h: jax.Array, limit=None) -> jax.Array:
    """``[R, 2I]`` (gate | up) -> ``[R, I]``: ``silu(min(gate, L)) * clip(up, -L, L)``."""
    gate, up = jnp.split(h, 2, axis=-1)
    if limit is not None:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def gate_up_dtype(config: MoEConfig):
    """The gate/up GEMM's own output dtype where the SwiGLU runs after it: float32, or in the fp8
    mode :func:`row_dtype`. The fp8 mode's GEMM inputs carry e4m3's 2^-4 relative steps; a bf16
    rounding of the product (2^-9) is far below them and halves the bytes of the layer's widest
    intermediate (``[R, 2I]``, written by the GEMM and read by the SwiGLU). The exact mode keeps
    float32: its fused GEMM + SwiGLU computes the SwiGLU from the float32 product."""
    return row_dtype(config) if config.precision == "fp8" else jnp.dtype(jnp.float32)


def _swiglu_paired(h: jax.Array, limit=None) -> jax.Array:
    """:func:`swiglu` of ``[R, 2I]`` columns in the paired order (:func:`jax_nvfp4.maths.layout.pair_gate_up`)."""
    return swiglu(jnp.concatenate(split_paired(h), axis=-1), limit)


def _row_global_scale(x: jax.Array) -> jax.Array:
    """float32 ``[R]``: amax/2688 of each row of x over finite values (1.0 for a zero row)."""
    return jax.vmap(dynamic_global_scale)(x)


def _expert_gemm(x_rows, row_expert, w: NVFP4Tensor, in_scale, group_sizes, config, backend,
                 rows_hint=None, gather=None, paired=False, out_dtype=jnp.float32, scatter=None,
                 bf16_rows=False):
    """One grouped GEMM over rows sorted by (local) expert; float32 ``[R, N]`` out.

    ``out_dtype``: the GEMM's own output dtype (float32, or :func:`row_dtype` for the down GEMM:
    the product is rounded to it, then scaled by a W4A4 dynamic row scale in float32).

    ``in_scale`` is the static per-expert activation scale float32 ``[G]`` (W4A4 static) or
    None. Rows whose expert id is G (not local) lie past the groups and come out 0. ``gather``:
    None, or int32 ``[R]``: the GEMM's rows are ``x_rows[gather]`` (the dispatch). An input
    quantized per row (dynamic W4A4, and the fp8 mode's e4m3 rows) is then quantized once per row
    of x_rows when there are no more of those than R, and the quantized rows gathered
    (:func:`_dispatch_in_forward`): the same numbers, ``top_k`` times fewer rows quantized
    than quantizing each token once per chosen expert.

    ``scatter``: None, or int32 ``[T, top_k]``, ``gather`` inverted (the sorted row of each
    token's copy; a row at or past R for none): the exact mode then writes the GEMM's bf16 input
    in one pass over x_rows (:func:`jax_nvfp4.ops.dispatch.dispatch_rows`). ``bf16_rows``: x_rows
    holds bf16 values (the layer's bf16 activation rows), read as bf16.

    ``paired``: w's rows (a gate/up weight) are in the paired order, so a ``[G, 2]`` global
    scale applies to the output columns in that order.

    Differentiable with respect to ``x_rows`` (reverse mode): the input rounding (bf16) or
    quantization (W4A4) is a straight-through estimator and the weights are frozen
    (:mod:`jax_nvfp4.ops.autodiff`).
    """
    if gather is not None and not _dispatch_in_forward(x_rows, gather, scatter, in_scale, config):
        x_rows, gather, scatter = take_rows(x_rows, gather), None, None
    g = w.shape[0]
    gs = w.global_scale.astype(jnp.float32)
    per_half = gs.ndim == 2                            # [G, 2]: gate and up differ
    # replace keeps w.layout: prepared (sm90, fp8) weights reach the kernel as they are.
    w = dataclasses.replace(w, global_scale=jnp.ones((g,), jnp.float32) if per_half else gs)

    def forward(x_rows, w, group_sizes, aux):
        row_expert, in_scale, gather, scatter = aux
        alpha = w.global_scale
        if config.activation == "w4a4" and in_scale is not None:
            alpha = in_scale * alpha                   # alpha_e = input scale * weight scale
        lhs, row_scale = _gemm_lhs(x_rows, row_expert, in_scale, gather, scatter, config, backend,
                                   bf16_rows)
        out = checked_grouped_gemm(lhs, dataclasses.replace(w, global_scale=alpha), group_sizes,
                                   out_dtype=out_dtype, backend=backend,
                                   rows_hint=check_rows_hint(rows_hint), kernel=None,
                                   precision=config.precision)
        out = keep_rounded(out).astype(jnp.float32)   # out_dtype bf16: rounded by every backend
        if row_scale is not None:
            out = out * row_scale[:, None]
        return out

    out = autodiff.frozen_weights(forward, x_rows, w, group_sizes,
                                  (row_expert, in_scale, gather, scatter), gather=gather)
    if per_half:
        e = jnp.minimum(row_expert, g - 1)
        n = out.shape[1]
        if paired:       # column c is an up column when c % 16 >= 8
            up = (jnp.arange(n) % GLU_ROW_BLOCK >= GLU_ROW_BLOCK // 2).astype(jnp.int32)
            out = out * gs[e][:, up]
        else:
            half = n // 2
            out = out * jnp.concatenate([jnp.repeat(gs[e, :1], half, 1),
                                         jnp.repeat(gs[e, 1:], half, 1)], axis=1)
    return out


def _dispatch_in_forward(x_rows, gather, scatter, in_scale, config: MoEConfig) -> bool:
    """Whether the dispatch ``x_rows[gather]`` happens inside the GEMM's straight-through forward
    (:func:`_gemm_lhs`), from each token once, rather than as a copy before it: for inputs made per
    row (a dynamic W4A4 input, the fp8 mode's e4m3 rows, and, given the inverted map ``scatter``,
    the exact mode's bf16 rows; not W4A4 with a static per-expert scale, which depends on the
    row's expert) when x_rows has no more rows than the dispatch (under expert parallelism with a
    capacity it may have more)."""
    if x_rows.shape[0] > gather.shape[0]:
        return False
    if config.activation == "w4a4":
        return in_scale is None
    return config.precision == "fp8" or scatter is not None


def _gemm_lhs(x_rows, row_expert, in_scale, gather, scatter, config: MoEConfig, backend,
              bf16_rows=False):
    """The grouped GEMM's input built from ``x_rows`` (dispatched by ``gather`` when given, see
    :func:`_dispatch_in_forward`) and the float32 row scale to apply to its output (dynamic
    W4A4) or None.

    The exact mode's input is bf16: the rows, or the values ``e2m1 * block scale`` of their
    per-row NVFP4 quantization (exact in bf16; what the kernels read for W4A4 anyway), written by
    :func:`jax_nvfp4.ops.dispatch.dispatch_rows` in one pass. A static W4A4 scale (per expert) keeps
    the NVFP4 codes. The fp8 mode's input is those bf16 rows quantized to e4m3 per 128-wide k
    chunk (:class:`jax_nvfp4.maths.formats.Fp8Rows`), written by the same dispatch pass: each token
    quantized once, its codes stored to each of its rows."""
    # the GEMMs' backend, resolved once by the layer's entry: the dispatch takes the same route
    dispatch_backend = backend
    fp8_rows = config.precision == "fp8"
    if config.activation == "w4a4":
        if in_scale is not None:                       # static: one scale per expert
            q_scale = jnp.concatenate([in_scale, jnp.ones((1,), jnp.float32)])[row_expert]
            q = jax.vmap(quantize)(x_rows, q_scale)
            return NVFP4Tensor(q.data, q.scales, jnp.float32(1.0)), None
        src = x_rows.astype(jnp.bfloat16) if bf16_rows else x_rows
        # the dynamic row scales made in the same pass: (GEMM input, scale of each GEMM row)
        return dispatch_rows_dynamic(src, gather, scatter, backend=dispatch_backend, fp8=fp8_rows)
    return dispatch_rows(x_rows, gather, scatter, backend=dispatch_backend, fp8=fp8_rows), None


def _fused_path(weights: MoEWeights, config: MoEConfig) -> bool:
    """Whether the layer runs gate/up GEMM + SwiGLU as one call (:func:`_gate_up_act`)."""
    return weights.w13_paired and config.precision == "exact"


def _gate_up_forward(x_rows, w, group_sizes, aux, *, config, backend, rows_hint):
    """The fused gate/up GEMM + SwiGLU: :func:`jax_nvfp4.grouped_gemm_swiglu` on the GEMM input
    :func:`_expert_gemm` would build (same rounding or quantization, same dispatch gather)."""
    row_expert, in_scale, gather, scatter = aux
    g = w.data.shape[0]
    gs = w.global_scale.astype(jnp.float32)
    alpha = gs if gs.ndim == 2 else jnp.broadcast_to(gs[:, None], (g, 2))   # (gate, up) per group
    if config.activation == "w4a4" and in_scale is not None:   # static: in both halves' factors
        alpha = in_scale[:, None] * alpha
    # a dynamic W4A4 row scale is applied before the SwiGLU
    lhs, row_scale = _gemm_lhs(x_rows, row_expert, in_scale, gather, scatter, config, backend)
    act = checked_grouped_gemm_swiglu(lhs, dataclasses.replace(w, global_scale=alpha),
                                      group_sizes, row_scale=row_scale, limit=config.swiglu_limit,
                                      out_dtype=row_dtype(config), backend=backend,
                                      rows_hint=check_rows_hint(rows_hint), kernel=None)
    # float32 for the down GEMM's (straight-through) cotangent; the down GEMM's input is the
    # row-dtype value either way (for W4A16 bf16 rows its cast is then a no-op round trip).
    return keep_rounded(act).astype(jnp.float32)


def _gate_up_unfused(x_rows, w, group_sizes, aux, *, config, backend, rows_hint):
    """The same activation without fusion: the differentiable GEMM, then the paired SwiGLU."""
    row_expert, in_scale, gather, scatter = aux
    h = _expert_gemm(x_rows, row_expert, w, in_scale, group_sizes, config, backend, rows_hint,
                     gather=gather, paired=True, scatter=scatter, out_dtype=gate_up_dtype(config))
    return _round_rows(_swiglu_paired(h, config.swiglu_limit), config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_with_unfused_grad(fused, unfused, x_rows, w, group_sizes, aux):
    return fused(x_rows, w, group_sizes, aux)


def _fused_fwd(fused, unfused, x_rows, w, group_sizes, aux):
    return fused(x_rows, w, group_sizes, aux), (x_rows, w, group_sizes, aux)


def _fused_bwd(fused, unfused, res, ct):
    x_rows, w, group_sizes, aux = res
    # Recompute the unfused path and take its vjp: the cotangent of the unfused layer (its
    # straight-through GEMM backward and the SwiGLU's derivative), at one more gate/up GEMM.
    _, vjp = jax.vjp(lambda x: unfused(x, w, group_sizes, aux), x_rows)
    return vjp(ct) + (None, None, None)


_fused_with_unfused_grad.defvjp(_fused_fwd, _fused_bwd)


def _gate_up_act(x_rows, row_expert, w: NVFP4Tensor, in_scale, group_sizes, config, backend,
                 rows_hint=None, gather=None, fused=True, scatter=None):
    """The activation ``swiglu(gate/up GEMM)`` of paired gate/up weights w: float32 ``[R, I]``.

    ``fused``: one :func:`jax_nvfp4.grouped_gemm_swiglu` call (exact precision), whose reverse-mode
    derivative is the unfused path's; else the GEMM (any precision) and the SwiGLU on the paired
    columns. Arguments as for :func:`_expert_gemm`.
    """
    kw: dict[str, Any] = dict(config=config, backend=backend, rows_hint=rows_hint)
    aux = (row_expert, in_scale, gather, scatter)
    unfused = functools.partial(_gate_up_unfused, config=config, backend=backend, rows_hint=rows_hint)
    if not fused:
        return unfused(x_rows, w, group_sizes, aux)
    if gather is not None and not _dispatch_in_forward(x_rows, gather, scatter, in_scale, config):
        x_rows, aux = take_rows(x_rows, gather), (row_expert, in_scale, None, None)  # as _expert_gemm does
    return _fused_with_unfused_grad(functools.partial(_gate_up_forward, **kw), unfused, x_rows, w,
                                    group_sizes, aux)


def _static_scale(weights, name, config, shape=None):
    if config.activation != "w4a4" or config.activation_scale != "static":
        return None
    v = getattr(weights, name)
    if v is None:
        raise ValueError(f"weights.{name}: required for activation_scale='static' (the "
                         "checkpoint's input scale)")
    v = jnp.asarray(v, jnp.float32)
    return v if shape is None else v.reshape(shape)


def row_ladder(capacity: int, rows: int) -> tuple:
    """The static row counts :func:`routed_experts` may run: ``capacity`` doubled until it
    reaches ``rows`` (the last is ``rows``), e.g. ``(30, 60, 120, 192)`` for 30 and 192."""
    sizes = []
    while capacity < rows:
        sizes.append(capacity)
        capacity *= 2
    return tuple(sizes) + (rows,)


COUNTING_SORT_MIN_ROWS = 4096
COUNTING_SORT_MAX_GROUPS = 64
"""When :func:`sort_rows` counts instead of sorting: from this many rows, up to this many groups
(on the H200 with 49 groups: 0.050 against 0.087 ms at 24576 rows, 0.045 against 0.069 at 6144,
slower at 1536; ``docs/archive/perf-log-layer.md``)."""

RANK_SORT_MAX_ROWS = 2048
"""Up to this many rows :func:`sort_rows` ranks by comparing every pair of rows on CUDA GPUs
(``R^2`` compares in two reductions, no sort kernel; ``docs/archive/perf-log-layer.md``)."""


def rank_sort_rows(key: jax.Array, groups: int):
    """:func:`sort_rows`' arrays by pairwise comparison (``R^2`` compares, no sort kernel).

    Args:
      key: int32 ``[R]``, each row's group in ``[0, groups)``; groups: static int.

    Returns:
      ``(order, inv, sizes)`` int32 ``[R]``, ``[R]``, ``[groups]``, as :func:`sort_rows`.
    """
    r = key.shape[0]
    # A row's sorted position: the rows with a smaller key, and those before it with its key.
    i = jnp.arange(r, dtype=jnp.int32)
    before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                              & (i[None, :] < i[:, None]))
    inv = jnp.sum(before, axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(inv[None, :] == i[:, None], i[None, :], 0), axis=1, dtype=jnp.int32)
    sizes = jnp.sum(key[:, None] == jnp.arange(groups, dtype=key.dtype)[None, :], axis=0,
                    dtype=jnp.int32)
    return order, inv, sizes


def sort_rows(key: jax.Array, groups: int):
    """The dispatch: the stable order of rows by group.

    Args:
      key: int32 ``[R]``, each row's group in ``[0, groups)``.
      groups: static number of groups.

    Returns:
      ``(order, inv, sizes)``, int32 ``[R]``, ``[R]``, ``[groups]``: ``key[order]`` is sorted with
      ties in row order, ``inv`` the inverse permutation (``order[inv] == arange(R)``), ``sizes``
      the rows per group. Small R ranks by pairwise comparison on CUDA GPUs, large R with few
      groups is a counting sort (one-hot prefix sums), else a stable sort; all give the same
      arrays. A symbolic R (``jax.export``) takes the stable sort.
    """
    r = key.shape[0]
    if not isinstance(r, int):
        return _sort_rows_by_sort(key, groups)
    if r <= RANK_SORT_MAX_ROWS:
        # on the CPU, XLA compiles and runs the R^2 form slower than its sort
        return jax.lax.platform_dependent(key, cuda=lambda k: rank_sort_rows(k, groups),
                                          default=lambda k: _sort_rows_by_sort(k, groups))
    if r >= COUNTING_SORT_MIN_ROWS and groups <= COUNTING_SORT_MAX_GROUPS:
        onehot = (key[:, None] == jnp.arange(groups, dtype=key.dtype)[None, :]).astype(jnp.int32)
        sizes = jnp.sum(onehot, axis=0)
        rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1   # earlier rows, same group
        inv = ((jnp.cumsum(sizes) - sizes)[key] + rank).astype(jnp.int32)
        order = jnp.zeros_like(inv).at[inv].set(jnp.arange(r, dtype=jnp.int32))
        return order, inv, sizes.astype(jnp.int32)
    return _sort_rows_by_sort(key, groups)


def _sort_rows_by_sort(key: jax.Array, groups: int):
    """:func:`sort_rows`' arrays by a stable ``lax.sort`` on (key, row index)."""
    r = key.shape[0]
    # lax.sort, not jnp.argsort: argsort's permutation does not inherit the keys' varying
    # manual axes (jax 0.10, 0.11), so under shard_map (where the keys depend on the device's
    # expert_offset) the dispatch x[token_of] would be typed replicated, and its reverse-mode
    # cotangent would be neither typed nor summed over the devices as the per-device rows it is.
    _, order = jax.lax.sort((key, jnp.arange(r, dtype=jnp.int32)), num_keys=1, is_stable=True)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(r, dtype=jnp.int32))
    return order, inv, jnp.bincount(key, length=groups).astype(jnp.int32)


def routed_experts(x, expert_ids, route_weights, weights: MoEWeights, config: MoEConfig, *,
                   expert_offset=0, backend="auto", capacity=None):
    """Run the routed experts held in ``weights`` (experts ``expert_offset ..`` + local count).

    Args:
      x: ``[T, H]`` all tokens.
      expert_ids: int32 ``[T, top_k]`` *global* expert ids; route_weights float32 ``[T, top_k]``.
      weights: w13 ``[L, 2I, H]``, w2 ``[L, H, I]`` (L local experts) and their input scales.
      expert_offset: global id of local expert 0 (a traced value inside shard_map is fine).
      capacity: None, or a static int ``C`` >= 1: the (token, expert) rows are sorted
        local-first and only the first ``n`` of them go through dispatch, the GEMMs, SwiGLU,
        requantization and the combine, ``n`` the smallest of ``row_ladder(C, T * top_k)``
        (``C, 2C, 4C, ..., T * top_k``) that holds every local row (``lax.switch``): the work
        follows the local rows within a factor of 2 (under expert parallelism most rows belong
        to other devices' experts), and the result never depends on C: nothing is dropped, and
        each row and each sum is computed the same way whichever size runs.

    Returns:
      float32 ``[T, H]``: the weighted sum over each token's chosen experts that are local
      (the others contribute 0, so summing this over devices gives the full layer).
    """
    t, h = x.shape
    k = expert_ids.shape[1]
    backend = resolve_backend(backend)          # once (as given by moe: already resolved)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 1):
        raise ValueError(f"capacity: expected a static int >= 1 or None, got {capacity!r}")
    num_local = weights.w13.shape[0]
    local = expert_ids.reshape(-1) - expert_offset       # global -> local ids
    is_local = (local >= 0) & (local < num_local)
    key = jnp.where(is_local, local, num_local).astype(jnp.int32)   # non-local pairs sort last
    order, inv, sizes = sort_rows(key, num_local + 1)
    row_expert = key[order]
    token_of = (order // k).astype(jnp.int32)
    group_sizes = sizes[:num_local]
    # Expected rows of the local experts (uniform routing): a kernel/tile hint only, so that
    # expert parallelism's non-local rows (past the groups) do not make decode look like prefill.
    hint = (None if num_local >= config.num_experts or not isinstance(t, int)   # t symbolic: export
            else -(-t * k * num_local // config.num_experts))
    rw = route_weights.reshape(-1)
    # NaN weights (a hash-routed token with an invalid id, routing.route) stay NaN on every
    # device, so the token's row is NaN after the combine whatever the device count.
    rw = jnp.where(is_local | jnp.isnan(rw), rw, 0.0).reshape(t, k, 1)

    def run_rows(n):
        """The first n sorted rows (every local row among them): [T, H] float32."""
        in_scale = _static_scale(weights, "w13_input_scale", config)
        scatter = inv.reshape(t, k)              # each copy's sorted row (>= n: not run here)
        if weights.w13_paired:                     # dispatch: x[token_of[:n]]
            act = _gate_up_act(x, row_expert[:n], weights.w13, in_scale, group_sizes, config,
                               backend, hint, gather=token_of[:n], fused=_fused_path(weights, config),
                               scatter=scatter)
        else:
            h1 = _expert_gemm(x, row_expert[:n], weights.w13, in_scale, group_sizes, config,
                              backend, hint, gather=token_of[:n], scatter=scatter,
                              out_dtype=gate_up_dtype(config))
            act = _round_rows(swiglu(h1, config.swiglu_limit), config)
        y = _expert_gemm(act, row_expert[:n], weights.w2,
                         _static_scale(weights, "w2_input_scale", config), group_sizes, config,
                         backend, hint, out_dtype=row_dtype(config),
                         bf16_rows=row_dtype(config) == jnp.bfloat16)
        # Combine: back to (token, slot) order by the inverse permutation (a gather), then a
        # weighted sum over the k slots in slot order. Deterministic (a scatter-add over token_of
        # would use atomics on the GPU, summing in a different order from run to run), and a
        # plain read of y instead of T*k*H atomic adds. Slots past the n rows (non-local) gather 0.
        ys = jnp.take(y, inv, axis=0, mode="fill", fill_value=0)
        return jnp.sum(ys.reshape(t, k, h) * rw, axis=1)

    if capacity is None or capacity >= t * k:
        return run_rows(t * k)
    sizes = row_ladder(capacity, t * k)
    rung = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < jnp.sum(group_sizes))  # first that fits
    return jax.lax.switch(rung, [functools.partial(run_rows, n) for n in sizes])


def shared_expert(x, weights: MoEWeights, config: MoEConfig, *, backend="auto"):
    """The shared expert (a plain SwiGLU MLP over all tokens), float32 ``[T, H]``."""
    t = x.shape[0]
    backend = resolve_backend(backend)          # once (as given by moe: already resolved)
    # a new leading axis on every leaf (NVFP4Tensor or Fp8Weights): the [N, K] blocks are unchanged
    one = lambda w: jax.tree.map(lambda a: a[None], w)  # noqa: E731
    zeros = jnp.zeros((t,), jnp.int32)
    sizes = jnp.full((1,), t, jnp.int32)
    in_scale = _static_scale(weights, "shared_w13_input_scale", config, (1,))
    if weights.w13_paired:
        act = _gate_up_act(x, zeros, one(weights.shared_w13), in_scale, sizes, config, backend,
                           fused=_fused_path(weights, config))
    else:
        act = _round_rows(swiglu(_expert_gemm(x, zeros, one(weights.shared_w13), in_scale, sizes,
                                              config, backend, out_dtype=gate_up_dtype(config)),
                                 config.swiglu_limit), config)
    return _expert_gemm(act, zeros, one(weights.shared_w2),
                        _static_scale(weights, "shared_w2_input_scale", config, (1,)), sizes,
                        config, backend, out_dtype=row_dtype(config),
                        bf16_rows=row_dtype(config) == jnp.bfloat16)


def _check_shape(v, name, shapes):
    if v is None:
        return None
    shape = tuple(jnp.shape(v))
    if shape not in shapes:
        raise ValueError(f"{name}: expected shape {' or '.join(str(list(s)) for s in shapes)}, "
                         f"got {list(shape)}")
    return v


def fp8_runs(backend) -> bool:
    """Whether ``backend`` (resolved) computes the FP8 mode on checkpoint weights where this trace
    runs, for :meth:`MoEConfig.for_tokens`: the reference and the CPU handler do; on a CUDA GPU
    (the device :func:`jax_nvfp4.config.kernel_config.choose` asks about), a build whose
    ``wgmma_fp8`` runs there (sm_90)."""
    if backend == REFERENCE:
        return True
    arch = kernel_config.device_arch()
    return arch == 0 or "wgmma_fp8" in kernel_config.runnable_families(arch)


def weight_layouts(weights: MoEWeights) -> set:
    """The layouts of the weights the layer multiplies (:class:`Fp8Weights`: ``"fp8"``), for
    :meth:`MoEConfig.for_tokens`; fields of other types are left to :func:`validate_moe`."""
    out = set()
    for w in (weights.w13, weights.w2, weights.shared_w13, weights.shared_w2):
        if isinstance(w, Fp8Weights):
            out.add(FP8_LAYOUT)
        elif isinstance(w, NVFP4Tensor):
            out.add(w.layout)
    return out


def call_config(config: MoEConfig, tokens, weights: MoEWeights, backend) -> MoEConfig:
    """``config`` for one call of the layer on ``tokens`` tokens (an int: T, the global count under
    expert parallelism), ``weights`` and the resolved ``backend``: ``precision="auto"`` resolved by
    :meth:`MoEConfig.for_tokens` (any other precision: ``config`` as it is)."""
    return config.for_tokens(tokens, weight_layouts(weights), fp8_runs(backend))


def validate_moe(x, weights: MoEWeights, config: MoEConfig):
    """Check x and the weights against config; errors name the argument or field."""
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config: expected a MoEConfig, got {type(config).__name__}")
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != config.hidden_size:
        raise ValueError(f"x: expected [T, {config.hidden_size}], got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a float dtype, got {x.dtype}")
    e = config.num_experts
    h, i = config.hidden_size, config.intermediate_size
    if weights.router_weight.shape != (config.num_experts, h):
        raise ValueError(f"weights.router_weight: expected [{config.num_experts}, {h}], "
                         f"got {weights.router_weight.shape}")
    _check_shape(weights.router_bias, "weights.router_bias", [(e,)])
    for name, shapes in (("w13_input_scale", [(e,)]), ("w2_input_scale", [(e,)]),
                         ("shared_w13_input_scale", [(), (1,)]),
                         ("shared_w2_input_scale", [(), (1,)])):
        v = _check_shape(getattr(weights, name), f"weights.{name}", shapes)
        known = known_range(v)            # values checked when known (eager or closed over)
        if known is not None:
            lo, hi = known
            if not (MIN_GLOBAL_SCALE <= lo and hi <= MAX_GLOBAL_SCALE):  # False for NaN
                raise ValueError(f"weights.{name}: static input scales must be finite and >= "
                                 f"2^-126 (the smallest normal float32, {MIN_GLOBAL_SCALE:.3g}), "
                                 f"got values in [{lo:.3g}, {hi:.3g}]")
    if weights.hash_table is not None:
        check_hash_table(weights.hash_table, config)
    for name, w, shape in (("w13", weights.w13, (e, 2 * i, h)), ("w2", weights.w2, (e, h, i)),
                           ("shared_w13", weights.shared_w13, None),
                           ("shared_w2", weights.shared_w2, None)):
        if w is None and shape is None:
            continue
        if not isinstance(w, (NVFP4Tensor, Fp8Weights)):
            raise ValueError(f"weights.{name}: expected an NVFP4Tensor (or Fp8Weights with "
                             f"precision='fp8'), got {type(w).__name__}")
        check_rhs_precision(w, config.precision, f"weights.{name}", "config.precision")
        if shape is None:
            continue
        if w.shape != shape:
            raise ValueError(f"weights.{name}: expected logical shape {list(shape)}, got "
                             f"{list(w.shape)}")
        ok = [(e,)] + ([(e, 2)] if name == "w13" else [])
        if tuple(w.global_scale.shape) not in ok:
            raise ValueError(f"weights.{name}.global_scale: expected one of {ok}, got "
                             f"{tuple(w.global_scale.shape)}")
    if config.n_shared_experts and (weights.shared_w13 is None or weights.shared_w2 is None):
        raise ValueError("weights.shared_w13 / shared_w2: config.n_shared_experts > 0 but the "
                         "shared expert weights are missing")
    return x


def moe(x, weights: MoEWeights, config: MoEConfig, *, token_ids=None, backend="auto"):
    """The NVFP4 MoE layer on one device.

    Args:
      x: ``[..., H]`` float tokens (bf16 typical): ``[T, H]``, ``[B, S, H]``, or one token ``[H]``.
        The leading axes are flattened into T tokens and restored on the output.
      weights: :class:`MoEWeights` (w13 ``[E, 2I, H]``, w2 ``[E, H, I]`` NVFP4), in the
        checkpoint layout or prepared by :func:`jax_nvfp4.prepare_weights`. The NVFP4 fields may
        also be qwix NVFP4 ``QArray`` s (:func:`jax_nvfp4.maths.qwix_interop.weights_from_qwix`:
        converted on each call; convert once to keep the conversion out of the step). Prepared weights
        have their gate/up rows paired (``w13_paired``) and, in exact precision, run the
        gate/up GEMM and the SwiGLU as one fused call (module docstring): the same result up to
        float32 ulps of the SwiGLU and its epilogue factors (a bf16 rounding or a requantized
        W4A4 code can move by one step). With ``config.precision="fp8"`` the weights may also be
        prepared as e4m3 (``prepare_weights(w, "fp8")``, :class:`~jax_nvfp4.maths.formats.Fp8Weights`):
        the same numbers as the NVFP4 weights they come from, on each backend; with
        ``precision="exact"`` such weights are a ValueError.
      config: :class:`MoEConfig` (static).
      token_ids: int, shaped like x's leading axes (``[T]``, ``[B, S]``): the input token ids,
        for hash-routed layers.
      backend: grouped GEMM backend, see :func:`jax_nvfp4.grouped_gemm`.

    Returns:
      x's shape and dtype: ``sum_k w_k * expert_k(x) (+ shared expert(x))``, each expert's row
      in bf16 (module docstring), accumulated in float32. No host synchronization: routing,
      dispatch and group sizes stay on the device.

    Gradients: reverse mode (``jax.grad``, ``jax.vjp``) with respect to x, on every backend. The
    NVFP4 expert weights are frozen (zero cotangents); the GEMMs' backward is pure jnp on the
    dequantized weights, and the bf16 rounding (W4A16) or NVFP4 quantization (W4A4) of the GEMM
    inputs is a straight-through estimator (identity in the backward); see
    :mod:`jax_nvfp4.ops.autodiff`. The router is plain float32 jnp, so ``router_weight`` does get its
    true gradient if differentiated (the modules in :mod:`jax_nvfp4.nn` hold all weights frozen).
    """
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config: expected a MoEConfig, got {type(config).__name__}")
    weights = qwix_interop.weights_from_qwix(weights)
    backend = resolve_backend(backend)          # the layer's one resolution, passed down
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] != config.hidden_size:
        raise ValueError(f"x: expected [..., {config.hidden_size}], got {x.shape}")
    lead = x.shape[:-1]
    if token_ids is not None:
        # not jnp.asarray: inside a jit that would make closed-over numpy ids a tracer, whose
        # values route() could then not check
        if not isinstance(token_ids, jax.Array):
            token_ids = np.asarray(token_ids)
        if token_ids.shape != lead:
            raise ValueError(f"token_ids: expected shape {list(lead)} (x's leading axes), got "
                             f"{list(token_ids.shape)}")
        token_ids = token_ids.reshape(-1)
    x = x.reshape(-1, config.hidden_size)
    config = call_config(config, x.shape[0], weights, backend)      # precision="auto"
    x = validate_moe(x, weights, config)
    ids, rw = route(x, weights, config, token_ids)
    out = routed_experts(x, ids, rw, weights, config, backend=backend)
    if weights.shared_w13 is not None:
        out = out + shared_expert(x, weights, config, backend=backend)
    return out.astype(x.dtype).reshape(lead + (config.hidden_size,))


# One compiled program per weight shape: called eagerly, the quantizer's ~40 operations would each
# be dispatched (and compiled) on their own, ~10x slower on the CPU. The result is the same: the
# quantizer is exact inside any jit (integer divisions, optimization barriers).
_quantize_experts = jax.jit(jax.vmap(quantize))
_quantize_one = jax.jit(quantize)


def quantize_moe(router_weight, w13, w2, *, router_bias=None, shared_w13=None, shared_w2=None,
                 hash_table=None, w13_input_scale=None, w2_input_scale=None,
                 shared_w13_input_scale=None, shared_w2_input_scale=None) -> MoEWeights:
    """Quantize a float MoE layer to NVFP4 (one global scale per expert and weight).

    Args:
      router_weight: float ``[E, H]`` (kept in float32).
      w13: float ``[E, 2I, H]`` (gate rows, then up rows); w2: float ``[E, H, I]``.
      router_bias: float ``[E]`` or None; hash_table: int ``[vocab, top_k]`` or None.
      shared_w13: float ``[2Is, H]``, shared_w2: float ``[H, Is]`` or None.
      *_input_scale: optional static activation scales (float32 ``[E]`` / ``[]``), e.g. from
        calibration: ``amax(activation) / 2688``.

    Returns:
      :class:`MoEWeights` with ``w13``/``w2`` NVFP4Tensors (global_scale ``[E]``).
    """
    f32 = lambda v: None if v is None else jnp.asarray(v, jnp.float32)  # noqa: E731
    if hash_table is not None:
        if not isinstance(hash_table, jax.Array):
            hash_table = np.asarray(hash_table)
        e = jnp.shape(router_weight)[0]
        if (not jnp.issubdtype(hash_table.dtype, jnp.integer) or hash_table.ndim != 2
                or hash_table.size == 0):
            raise ValueError(f"hash_table: expected integer expert ids [vocab, top_k], got "
                             f"{hash_table.dtype} {tuple(hash_table.shape)}")
        known = known_range(hash_table)       # values checked when known (not traced)
        if known is not None and (known[0] < 0 or known[1] >= e):
            raise ValueError(f"hash_table: expert ids must lie in [0, {e}) (E from "
                             f"router_weight), got values in [{known[0]}, {known[1]}]")
    return MoEWeights(
        router_weight=jnp.asarray(router_weight, jnp.float32),
        w13=_quantize_experts(jnp.asarray(w13)),
        w2=_quantize_experts(jnp.asarray(w2)),
        router_bias=f32(router_bias),
        w13_input_scale=f32(w13_input_scale), w2_input_scale=f32(w2_input_scale),
        shared_w13=None if shared_w13 is None else _quantize_one(jnp.asarray(shared_w13)),
        shared_w2=None if shared_w2 is None else _quantize_one(jnp.asarray(shared_w2)),
        shared_w13_input_scale=f32(shared_w13_input_scale),
        shared_w2_input_scale=f32(shared_w2_input_scale),
        hash_table=None if hash_table is None else jnp.asarray(hash_table, jnp.int32))
