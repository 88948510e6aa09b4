"""Expert parallelism: experts sharded over a mesh axis, all tokens on every device, psum combine.

Each device routes only its slice of the tokens (``ceil(T / devices)`` of them, T padded to a
multiple of the device count), and the routing decisions (expert ids int32 and weights float32,
``[T, top_k]`` each) are all-gathered over the axis (one int32 ``[T, 2 top_k]`` array): the
router's work is split, and every device ends up with the same decisions for every token,
computed by the same per-token math as one device's :func:`jax_nvfp4.route`. Each device then
keeps the (token, expert) pairs whose expert it holds, maps global expert ids to local ones
(``global - axis_index * experts_per_device``; local weights are never indexed with global ids),
runs its experts, and the partial outputs are summed over the axis. The shared expert runs once
in total: each device computes it for its own slice of the tokens and adds it into the sum.
Activation scales are per row (dynamic) or per expert (static), so the answer does not depend on
the number of devices (see :mod:`jax_nvfp4.moe`).
Each device runs only about as many routed rows as its own experts received (its own, sorted
first): the smallest of ``C, 2C, 4C, ..., T * top_k`` rows that holds them, ``C =
ceil(capacity_factor * T * top_k / devices)``; the result is the same whichever size runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .moe import call_config, routed_experts, shared_expert, validate_moe
from ..config.moe_params import MoEConfig, MoEWeights
from ..config.options import COMBINES, resolve_backend
from ..maths.qwix_interop import weights_from_qwix
from .routing import check_token_ids, route
from ..maths.varying import varying_axes

DEFAULT_CAPACITY_FACTOR = 1.25
"""``moe_expert_parallel``'s default: the first row count a device runs is 1.25x its even share."""
_EXPERT_FIELDS = ("w13", "w2", "w13_input_scale", "w2_input_scale")


def weight_specs(weights: MoEWeights, axis_name: str = "ep") -> MoEWeights:
    """PartitionSpecs for each field: routed experts split on axis 0, everything else replicated."""
    specs = {}
    for f in dataclasses.fields(weights):
        v = getattr(weights, f.name)
        if f.metadata.get("static"):   # pytree metadata (expert_ids): kept, so the trees match
            specs[f.name] = v
            continue
        spec = P(axis_name) if f.name in _EXPERT_FIELDS else P()
        specs[f.name] = None if v is None else jax.tree.map(lambda _: spec, v)
    return MoEWeights(**specs)


def _ep_size(mesh, axis_name):
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name: {axis_name!r} is not an axis of the mesh "
                         f"{dict(mesh.shape)}")
    return mesh.shape[axis_name]


def shard_moe_weights(weights: MoEWeights, mesh: jax.sharding.Mesh, axis_name: str = "ep"):
    """Place the weights on the mesh: experts (w13, w2, their input scales) split along
    ``axis_name`` on the expert axis, router, bias, hash table and shared expert replicated.

    Only the expert axis is split, never N or K, so weights prepared in the sm90 layout
    (:func:`jax_nvfp4.prepare_weights`, whose blocks are 128 rows x 64 k of one expert) keep it.
    Fields that are qwix NVFP4 ``QArray`` s are placed as their conversions
    (:func:`jax_nvfp4.maths.qwix_interop.weights_from_qwix`: a qwix scale shared by every expert has no
    expert axis to split).
    """
    weights = weights_from_qwix(weights)
    ep = _ep_size(mesh, axis_name)
    e = weights.w13.shape[0]
    if e % ep:
        raise ValueError(f"weights: {e} experts cannot be split evenly over {ep} devices "
                         f"(mesh axis {axis_name!r})")
    specs = weight_specs(weights, axis_name)
    return jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), weights, specs)


def device_capacity(tokens: int, top_k: int, devices: int, capacity_factor) -> int | None:
    """The first (smallest) row count one device runs: ``ceil(capacity_factor * tokens * top_k
    / devices)``, or None (all ``tokens * top_k`` rows) for ``capacity_factor=None`` and for a
    symbolic ``tokens`` (``jax.export``: the row counts a device may run are static sizes)."""
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real) \
            or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor: expected a finite number > 0 or None, got "
                         f"{capacity_factor!r}")
    if not isinstance(tokens, int):
        return None
    factor = typing.cast(float, capacity_factor)       # a Real (an int, Fraction, ...), kept exact
    return max(1, math.ceil(factor * tokens * top_k / devices))


def token_slice(a, device_index, devices: int):
    """Rows ``device_index * S .. (device_index + 1) * S`` of ``a`` (``[T, ...]``), ``S =
    ceil(T / devices)``, after padding T with zeros to ``S * devices``."""
    size = -(-a.shape[0] // devices)
    a = jnp.pad(a, ((0, size * devices - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))
    return jax.lax.dynamic_slice_in_dim(a, device_index * size, size)


def route_token_slice(x, weights: MoEWeights, config: MoEConfig, *, device_index, devices: int,
                      token_ids=None):
    """Route one device's slice of the tokens: :func:`jax_nvfp4.route` on
    ``token_slice(x, device_index, devices)`` (and the same slice of ``token_ids``).

    Returns:
      ``(expert_ids int32 [S, top_k], routing_weights float32 [S, top_k])``, ``S = ceil(T /
      devices)``; rows past T (padding: zero tokens, token id 0) are to be dropped. Concatenated
      over the devices and cut to T rows they are ``route(x, ...)``'s decisions.
    """
    tok = None
    if weights.hash_table is not None:
        tok = token_slice(jnp.asarray(token_ids), device_index, devices)
    return route(token_slice(x, device_index, devices), weights, config, tok)


def local_routed_experts(x, weights: MoEWeights, config: MoEConfig, *, device_index, devices: int,
                         token_ids=None, backend: str = "auto",
                         capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR, routing=None):
    """What one device of :func:`moe_expert_parallel` computes for its routed experts, before
    the combine (also usable outside ``shard_map``, e.g. to time one device's share on one GPU).

    Args:
      x: ``[T, H]`` all tokens.
      weights: this device's :class:`MoEWeights`: its ``num_experts / devices`` experts (w13,
        w2 and their input scales), the full router (and hash table).
      device_index: this device's index on the expert axis (int or traced int32).
      devices: the axis size.
      routing: ``(expert_ids int32 [T, top_k], routing_weights float32 [T, top_k])`` for all
        tokens (under :func:`moe_expert_parallel`: the all-gathered
        :func:`route_token_slice` results), or None to route all T tokens here.

    Returns:
      float32 ``[T, H]``: the routed experts' output restricted to this device's experts.
    """
    local_e = config.num_experts // devices
    if routing is None:
        routing = route(x, weights, config,
                        token_ids if weights.hash_table is not None else None)
    ids, rw = routing
    capacity = device_capacity(x.shape[0], config.top_k, devices, capacity_factor)
    return routed_experts(x, ids, rw, weights, config, expert_offset=device_index * local_e,
                          backend=backend, capacity=capacity)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather_decisions(ids, rw, axis_name, devices, t):
    """Every device's routing decisions, all-gathered over ``axis_name`` (``devices`` long):
    ids int32 and weights float32 ``[S, top_k]`` each -> ``[t, top_k]`` each (``t <= S *
    devices``), moved as one all-gather of int32 ``[S * devices, 2 top_k]`` (the weights' bits
    beside the ids). Differentiable with respect to the weights."""
    k = ids.shape[1]
    both = jnp.concatenate([ids, jax.lax.bitcast_convert_type(rw, jnp.int32)], axis=1)
    both = jax.lax.all_gather(both, axis_name, tiled=True)[:t]
    return both[:, :k], jax.lax.bitcast_convert_type(both[:, k:], jnp.float32)


def _gather_decisions_fwd(ids, rw, axis_name, devices, t):
    return _gather_decisions(ids, rw, axis_name, devices, t), rw[:, :0]   # rw's [S] and type


def _gather_decisions_bwd(axis_name, devices, t, rw_proto, cts):
    # The bit cast carries no derivative; the weights' cotangent is the (float) all-gather's
    # transpose: each device's slice of the padded [S * devices, top_k] cotangent, summed over
    # the devices (one reduce-scatter), so the router gets its gradient as on one device.
    _, drw = cts
    s = rw_proto.shape[0]
    drw = jnp.pad(drw.astype(jnp.float32), ((0, s * devices - t), (0, 0)))
    drw = jax.lax.psum_scatter(drw, axis_name, scatter_dimension=0, tiled=True)
    return None, drw


_gather_decisions.defvjp(_gather_decisions_fwd, _gather_decisions_bwd)


def _check_expert_parallel_args(x, weights, config, mesh, axis_name, combine, token_ids,
                                capacity_factor) -> int:
    """The checks of moe_expert_parallel's arguments beyond validate_moe's; returns the size of
    the mesh axis."""
    ep = _ep_size(mesh, axis_name)
    if config.num_experts % ep:
        raise ValueError(f"config.num_experts={config.num_experts} is not divisible by the "
                         f"{ep} devices of mesh axis {axis_name!r}")
    if combine not in COMBINES:
        raise ValueError(f"combine: expected one of {COMBINES}, got {combine!r}")
    t = x.shape[0]
    if combine == "psum_scatter" and t % ep:
        raise ValueError(f"x: combine='psum_scatter' needs T={t} divisible by {ep}")
    if weights.hash_table is not None and token_ids is None:
        raise ValueError("token_ids: this layer is hash-routed (weights.hash_table is set)")
    if weights.hash_table is not None:                     # concrete ids: checked here, eagerly
        check_token_ids(token_ids, weights.hash_table, t)
    device_capacity(t, config.top_k, ep, capacity_factor)        # checks capacity_factor
    return ep


def _place_for_shard_map(mesh, specs, x, weights, tok):
    """On an Explicit mesh shard_map's in_specs only assert: move the inputs where the specs say
    (a token-sharded x from a previous psum_scatter, weights not yet sharded). Other meshes: as
    they are."""
    if not any(a == jax.sharding.AxisType.Explicit for a in getattr(mesh, "axis_types", ())):
        return x, weights, tok
    put = lambda v, s: jax.sharding.reshard(v, NamedSharding(mesh, s))  # noqa: E731
    return put(x, P()), jax.tree.map(put, weights, specs), put(tok, P())


def moe_expert_parallel(x, weights: MoEWeights, config: MoEConfig, mesh: jax.sharding.Mesh, *,
                        axis_name: str = "ep", combine: str = "psum", token_ids=None,
                        backend: str = "auto",
                        capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR):
    """The MoE layer with experts spread over ``mesh`` axis ``axis_name`` (``jax.shard_map``).

    Each device routes ``ceil(T / devices)`` of the tokens and the decisions are all-gathered
    (``T * top_k`` int32 ids and float32 weights); the routed experts, their dispatch and combine
    are then split by expert, the shared expert by token.

    Args:
      x: ``[T, H]`` tokens (replicated: every device sees all tokens).
      weights: :class:`MoEWeights` for all E experts (ideally from :func:`shard_moe_weights`);
        fields may be qwix NVFP4 ``QArray`` s as for :func:`jax_nvfp4.moe` (converted here:
        shard the converted weights to convert once).
      config: :class:`MoEConfig`; ``num_experts`` must be divisible by the axis size.
      mesh: the device mesh; other axes are left alone (the layer is replicated over them).
      combine: "psum" -> replicated ``[T, H]``; "psum_scatter" -> ``[T, H]`` sharded on tokens
        along the axis (half the traffic; T must be divisible by the axis size).
      token_ids: int ``[T]`` for hash-routed layers.
      capacity_factor: a float > 0 (default 1.25): each device sorts the ``T * top_k`` routed
        rows with its own first and runs dispatch, both GEMMs, SwiGLU, requantization and the
        combine over the first ``n`` of them only, ``n`` the smallest of ``C, 2C, 4C, ...,
        T * top_k`` that holds all its own rows, ``C = ceil(capacity_factor * T * top_k /
        devices)`` (``lax.switch`` per device, every size compiled). Exact whatever the routing
        (nothing is dropped, and the answer does not depend on which size runs); the work follows
        the device's own rows within a factor of 2 when routing is skewed, and is ``C`` rows when
        it is near even. None: every device runs all ``T * top_k`` rows (no data-dependent
        branch; the other devices' rows lie past the groups and are zeros).

    Returns:
      ``[T, H]`` in x's dtype, equal to :func:`jax_nvfp4.moe` up to float32 summation order
      (``[0, H]`` for no tokens, whatever the combine and capacity).

    Gradients: reverse mode with respect to x, :func:`jax_nvfp4.moe`'s (frozen weights,
    straight-through GEMM inputs, the router's true derivative) up to float32 summation order;
    the backward sums x's cotangent over the axis (one all-reduce of ``[T, H]``) and
    reduce-scatters the routing weights' (``[T, top_k]`` float32).
    """
    weights = weights_from_qwix(weights)               # qwix NVFP4 fields, as jn.moe takes them
    backend = resolve_backend(backend)                 # once, passed down
    if isinstance(config, MoEConfig) and jnp.ndim(x) == 2:   # precision="auto": the global count
        config = call_config(config, jnp.shape(x)[0], weights, backend)
    x = validate_moe(x, weights, config)
    ep = _check_expert_parallel_args(x, weights, config, mesh, axis_name, combine, token_ids,
                                     capacity_factor)
    t, h = x.shape
    tslice = -(-t // ep)                                   # tokens per device (padded T / ep)
    has_shared = weights.shared_w13 is not None
    tok = jnp.zeros((t,), jnp.int32) if token_ids is None else jnp.asarray(token_ids)

    def body(x, w, tok):
        if isinstance(t, int) and t == 0:   # no tokens (zero-size collectives and a zero-row
            return jnp.zeros((0, h), x.dtype)          # switch do not lower): nothing to do
        idx = jax.lax.axis_index(axis_name)
        # x is the same on every device, and every device uses it (its token slice, its
        # experts' rows): typed as varying once here (no data moves), the backward sums x's
        # cotangent over the devices once (one all-reduce of [T, H]) instead of at each use.
        if axis_name not in varying_axes(x):
            x = jax.lax.pcast(x, axis_name, to="varying")
        # The router runs on this device's token slice only; the decisions are gathered (ids
        # and the weights' bits side by side: one all-gather of int32 [T, 2 top_k]), so every
        # device holds every token's, made by the same per-token math as routing all T here.
        ids, rw = route_token_slice(x, w, config, device_index=idx, devices=ep, token_ids=tok)
        ids, rw = _gather_decisions(ids, rw, axis_name, ep, t)
        out = local_routed_experts(x, w, config, device_index=idx, devices=ep, backend=backend,
                                   capacity_factor=capacity_factor, routing=(ids, rw))
        if has_shared:                                     # once in total: a token slice each
            part = shared_expert(token_slice(x, idx, ep), w, config, backend=backend)
            full = jax.lax.dynamic_update_slice_in_dim(
                jnp.zeros((tslice * ep, h), jnp.float32), part, idx * tslice, 0)
            out = out + full[:t]
        if combine == "psum":
            out = jax.lax.psum(out, axis_name)
        else:
            out = jax.lax.psum_scatter(out, axis_name, scatter_dimension=0, tiled=True)
        return out.astype(x.dtype)

    specs = weight_specs(weights, axis_name)
    x, weights, tok = _place_for_shard_map(mesh, specs, x, weights, tok)
    f = jax.shard_map(body, mesh=mesh,
                      in_specs=(P(), specs, P()),
                      out_specs=P() if combine == "psum" else P(axis_name))
    return f(x, weights, tok)
