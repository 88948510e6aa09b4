"""MoE routers: DeepSeek noaux_tc top-k (optionally grouped) and hash routing, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .moe_params import MoEConfig, MoEWeights


def router_scores(x: jax.Array, router_weight: jax.Array, scoring_func: str) -> jax.Array:
    """float32 ``[T, E]`` scores from x ``[T, H]`` and router_weight ``[E, H]`` (float32 math)."""
    logits = jnp.dot(x.astype(jnp.float32), router_weight.astype(jnp.float32).T,
                     precision=jax.lax.Precision.HIGHEST)
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if scoring_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"scoring_func: unknown {scoring_func!r}")


def _grouped_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Keep the ``topk_group`` groups with the largest sum of their top-2 choice scores."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    top2 = jax.lax.top_k(grouped, min(2, e // n_group))[0].sum(-1)          # [T, n_group]
    _, keep = jax.lax.top_k(top2, topk_group)
    gmask = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
    return jnp.repeat(gmask, e // n_group, axis=1)


def route(x: jax.Array, weights: MoEWeights, config: MoEConfig, token_ids=None):
    """Choose experts for each token.

    Args:
      x: ``[T, H]`` tokens.
      weights: the layer; uses router_weight ``[E, H]``, router_bias ``[E]`` and hash_table
        ``[vocab, top_k]`` when present.
      config: the layer's MoEConfig.
      token_ids: int ``[T]``, required when the layer has a hash table.

    Returns:
      ``(expert_ids int32 [T, top_k], routing_weights float32 [T, top_k])``. Selection uses
      ``score + bias`` (noaux_tc) and, for ``n_group > 1``, only the best ``topk_group`` groups;
      the weights are the *unbiased* scores of the chosen experts, renormalized to sum to 1 when
      ``norm_topk_prob``, times ``routed_scaling_factor``. Ties go to the lower expert id.
    """
    scores = router_scores(x, weights.router_weight, config.scoring_func)
    if weights.hash_table is not None:
        if token_ids is None:
            raise ValueError("token_ids: this layer is hash-routed (weights.hash_table is set); "
                             "pass the input token ids [T]")
        token_ids = jnp.asarray(token_ids)
        if token_ids.shape != (x.shape[0],):
            raise ValueError(f"token_ids: expected shape [{x.shape[0]}], got {token_ids.shape}")
        ids = weights.hash_table[token_ids].astype(jnp.int32)
    else:
        choice = scores
        if weights.router_bias is not None:
            choice = choice + weights.router_bias.astype(jnp.float32)
        if config.n_group > 1:
            choice = jnp.where(_grouped_mask(choice, config.n_group, config.topk_group), choice,
                               -jnp.inf)
        _, ids = jax.lax.top_k(choice, config.top_k)
        ids = ids.astype(jnp.int32)
    w = jnp.take_along_axis(scores, ids, axis=1)
    if config.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids, w * jnp.float32(config.routed_scaling_factor)
