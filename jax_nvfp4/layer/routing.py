"""MoE routers: DeepSeek noaux_tc top-k (optionally grouped) and hash routing, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..ops.gemm_args import round_to
from ..config.moe_params import MoEConfig, MoEWeights, known_range


def _bf16_terms(w: jax.Array) -> jax.Array:
    """float32 ``[E, H]`` -> bfloat16 ``[3E, H]``: three terms per row whose float32 sum is w
    exactly (8 + 8 + 8 significand bits; :func:`jax_nvfp4.ops.gemm_args.round_to`, so that no excess
    precision can skip a rounding inside jit)."""
    w1 = round_to(w, jnp.bfloat16)
    r = w - w1                                          # exact: w's low 16 bits
    w2 = round_to(r, jnp.bfloat16)
    return jnp.concatenate([w1, w2, r - w2]).astype(jnp.bfloat16)   # r - w2: exact, <= 8 bits


def router_logits(x: jax.Array, router_weight: jax.Array) -> jax.Array:
    """float32 ``[T, E]``: ``x @ router_weight.T`` in float32 arithmetic.

    bf16 x (the model's activations) runs as bf16 dots with float32 accumulation against the
    weight split into three bf16 terms (:func:`_bf16_terms`): every product is then exact in
    float32, so this is a float32 dot (up to the summation order) that reads x as it is, instead
    of writing and reading a float32 copy of x for a float32 (non-tensor-core) dot. Other dtypes
    take the float32 dot. Non-finite x gives what the float32 dot gives: the leading term has
    w's sign and zeros (subnormal w aside), so it carries x's Inf and NaN as ``x * w`` does; the
    two low terms meet only x's finite values (their zeros and opposite signs would add Inf * 0
    and Inf - Inf NaNs the float32 dot does not have).
    """
    w = router_weight.astype(jnp.float32)
    if x.dtype != jnp.bfloat16:
        return _dot_rows(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    e = w.shape[0]
    terms = _bf16_terms(w)
    lead = _dot_rows(x, terms[:e], preferred_element_type=jnp.float32)              # [T, E]
    finite_x = jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))
    low = _dot_rows(finite_x, terms[e:], preferred_element_type=jnp.float32)        # [T, 2E]
    return lead + (low[:, :e] + low[:, e:])             # the small terms first


def _dot_rows(a: jax.Array, b: jax.Array, **kw) -> jax.Array:
    """``a [T, H] . b [E, H]^T -> [T, E]`` contracting both H axes, without a transpose op: with
    ``b.T`` XLA's CPU dot sums in another order when b is an argument (the transpose folded into
    the dot) than when it is a closed-over constant (the transpose folded into the constant) or
    eager, so a jit would route differently from its closed-over and eager self by float32 ulps."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), **kw)


def router_scores(x: jax.Array, router_weight: jax.Array, scoring_func: str) -> jax.Array:
    """float32 ``[T, E]`` scores from x ``[T, H]`` and router_weight ``[E, H]`` (float32 math,
    :func:`router_logits`)."""
    logits = router_logits(x, router_weight)
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if scoring_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"scoring_func: unknown {scoring_func!r}")


RANK_TOP_K_MAX_COMPARES = 1 << 22
"""Up to this many compares (``T * E * E``) :func:`top_k_ids` ranks every pair of experts on CUDA
GPUs instead of running ``lax.top_k`` (a sort kernel there): the decode-sized router."""


def _total_order_key(x: jax.Array) -> jax.Array:
    """int32 keys in the float32 total order of ``lax.top_k``: -NaN < -inf < ... < -0.0 < +0.0 <
    ... < +inf < +NaN."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, b ^ jnp.int32(0x7FFFFFFF), b)


def rank_top_k_ids(choice: jax.Array, k: int) -> jax.Array:
    """:func:`top_k_ids` by ranking each expert against every other one (``T x E x E`` compares in
    two reductions, no sort): float32 ``[T, E]`` scores and a static ``k <= E`` to int32 ``[T, k]``
    ids, largest first, ties to the lower id, in ``lax.top_k``'s float32 total order."""
    t, e = choice.shape
    key = _total_order_key(choice.astype(jnp.float32))
    j = jnp.arange(e, dtype=jnp.int32)
    a, b = key[:, None, :], key[:, :, None]        # [T, 1, E] others, [T, E, 1] the ranked one
    beats = (a > b) | ((a == b) & (j[None, None, :] < j[None, :, None]))
    rank = jnp.sum(beats, axis=2, dtype=jnp.int32)                         # [T, E], distinct
    slot = jnp.arange(k, dtype=jnp.int32)
    return jnp.sum(jnp.where(rank[:, None, :] == slot[None, :, None], j[None, None, :], 0),
                   axis=2, dtype=jnp.int32)


def top_k_ids(choice: jax.Array, k: int) -> jax.Array:
    """int32 ``[T, k]``: the indices of the k largest of each row of float32 ``[T, E]``, largest
    first, ties to the lower index (``lax.top_k``'s order). On CUDA GPUs a small ``T x E x E``
    runs :func:`rank_top_k_ids` (no sort kernel: -3..10 us per decode layer on the H200); elsewhere,
    and for larger ones, ``lax.top_k`` (XLA's CPU backend compiles and runs the pairwise form
    slower than its sort). A symbolic T (``jax.export`` with a symbolic token count) sorts: the
    pairwise form's size is not known to be bounded."""
    t, e = choice.shape
    by_sort = lambda c: jax.lax.top_k(c, k)[1].astype(jnp.int32)  # noqa: E731
    if not isinstance(t, int) or t * e * e > RANK_TOP_K_MAX_COMPARES:
        return by_sort(choice)
    return jax.lax.platform_dependent(choice, cuda=lambda c: rank_top_k_ids(c, k), default=by_sort)


def _grouped_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Keep the ``topk_group`` groups with the largest sum of their top-2 choice scores."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    top2 = jax.lax.top_k(grouped, min(2, e // n_group))[0].sum(-1)          # [T, n_group]
    _, keep = jax.lax.top_k(top2, topk_group)
    gmask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
    return jnp.repeat(gmask, e // n_group, axis=1)


def _as_given(v):
    """A jax Array (concrete or traced) as it is, anything else as a numpy array: not
    ``jnp.asarray``, which inside a jit makes a traced copy of a concrete value, whose values
    then could not be checked."""
    return v if isinstance(v, jax.Array) else np.asarray(v)


def check_hash_table(hash_table, config: MoEConfig) -> jax.Array:
    """``hash_table`` int ``[vocab, top_k]`` with entries in ``[0, E)`` (values checked when
    concrete); returns it as a jax array. Errors name ``weights.hash_table``."""
    hash_table = _as_given(hash_table)
    dtype, shape = hash_table.dtype, hash_table.shape
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"weights.hash_table: expected an integer array, got {dtype}")
    if len(shape) != 2 or shape[1] != config.top_k or shape[0] < 1:
        raise ValueError(f"weights.hash_table: expected [vocab, top_k={config.top_k}] with "
                         f"vocab >= 1, got {tuple(shape)}")
    # the values as given: inside a jit, jnp.asarray of a closed-over numpy table is a tracer
    known = known_range(hash_table)
    if known is not None and (known[0] < 0 or known[1] >= config.num_experts):
        raise ValueError(f"weights.hash_table: expert ids must lie in [0, {config.num_experts}) "
                         f"(num_experts), got values in [{known[0]}, {known[1]}]")
    return jnp.asarray(hash_table)


def check_token_ids(token_ids, table, num_tokens: int) -> jax.Array:
    """``token_ids`` int ``[T]`` for a hash-routed layer, in ``[0, vocab)`` when concrete."""
    if token_ids is None:
        raise ValueError("token_ids: this layer is hash-routed (weights.hash_table is set); "
                         "pass the input token ids [T]")
    token_ids = _as_given(token_ids)
    dtype, shape = token_ids.dtype, token_ids.shape
    if tuple(shape) != (num_tokens,):
        raise ValueError(f"token_ids: expected shape [{num_tokens}], got {tuple(shape)}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"token_ids: expected integer ids, got {dtype}")
    vocab = table.shape[0]
    known = known_range(token_ids)      # as given: a closed-over numpy array is known too
    if known is not None and (known[0] < 0 or known[1] >= vocab):
        raise ValueError(f"token_ids: expected ids in [0, {vocab}) (the hash table's "
                         f"vocabulary), got values in [{known[0]}, {known[1]}]")
    return jnp.asarray(token_ids)


def route(x: jax.Array, weights: MoEWeights, config: MoEConfig, token_ids=None):
    """Choose experts for each token.

    Args:
      x: ``[T, H]`` tokens.
      weights: the layer; uses router_weight ``[E, H]``, router_bias ``[E]`` and hash_table
        ``[vocab, top_k]`` when present.
      config: the layer's MoEConfig.
      token_ids: int ``[T]``, required when the layer has a hash table; concrete ids must lie in
        ``[0, vocab)`` (else ValueError). A traced id outside it, or a table row with an id
        outside ``[0, E)`` (a traced table), routes its token nowhere: ids -1, weights NaN.

    Returns:
      ``(expert_ids int32 [T, top_k], routing_weights float32 [T, top_k])``. Selection uses
      ``score + bias`` (noaux_tc) and, for ``n_group > 1``, only the best ``topk_group`` groups;
      the weights are the *unbiased* scores of the chosen experts, renormalized to sum to 1 when
      ``norm_topk_prob``, times ``routed_scaling_factor``. Ties go to the lower expert id.
    """
    scores = router_scores(x, weights.router_weight, config.scoring_func)
    bad_token = None
    if weights.hash_table is not None:
        table = check_hash_table(weights.hash_table, config)
        token_ids = check_token_ids(token_ids, table, x.shape[0])
        vocab, e = table.shape[0], config.num_experts
        ids = table[jnp.clip(token_ids, 0, vocab - 1)].astype(jnp.int32)
        # Traced ids cannot be checked: a token whose id is outside [0, vocab) or whose table
        # row holds an id outside [0, E) goes to no expert (ids -1) with NaN routing weights, so
        # its layer output row is NaN on every backend and device count (visible, and no other
        # token is touched).
        ok = (token_ids >= 0) & (token_ids < vocab)
        bad_token = ~(ok & jnp.all((ids >= 0) & (ids < e), axis=-1))
        ids = jnp.where(bad_token[:, None], -1, ids)
    else:
        choice = scores
        if weights.router_bias is not None:
            choice = choice + weights.router_bias.astype(jnp.float32)[None, :]
        if config.n_group > 1:
            choice = jnp.where(_grouped_mask(choice, config.n_group, config.topk_group), choice,
                               -jnp.inf)
        ids = top_k_ids(choice, config.top_k)
    w = jnp.take_along_axis(scores, jnp.maximum(ids, 0), axis=1)
    if config.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    if bad_token is not None:
        w = jnp.where(bad_token[:, None], jnp.nan, w)
    return ids, w * jnp.float32(config.routed_scaling_factor)
