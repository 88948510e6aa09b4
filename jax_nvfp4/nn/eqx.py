"""The NVFP4 MoE layer as an Equinox Module (needs equinox: ``jax_nvfp4[frameworks]``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import require
from .frozen import FrozenMoEWeights

equinox = require("equinox", "equinox")

from ..layer.moe import moe  # noqa: E402
from ..config.moe_params import MoEConfig, MoEWeights  # noqa: E402


class MoE(equinox.Module):
    """The NVFP4 MoE layer (:func:`jax_nvfp4.moe`) with frozen weights.

    Args:
      weights: :class:`jax_nvfp4.MoEWeights` (or a :class:`jax_nvfp4.nn.frozen.FrozenMoEWeights`),
        held as ``self.weights``, a :class:`~jax_nvfp4.nn.frozen.FrozenMoEWeights`: every array
        as its integer bits (uint8 codes and block scales, uint32 float32 scales and router).
      config: :class:`jax_nvfp4.MoEConfig`, a static field.
      backend: grouped GEMM backend (``"auto"``, ``"ffi"``, ``"reference"``), static.

    The weights are ordinary pytree leaves, so the module goes through ``eqx.filter_jit`` and
    ``jax.jit`` as an argument and they are traced, not compile-time constants. Being integer
    arrays, ``eqx.is_inexact_array`` does not select them: ``eqx.filter(model,
    eqx.is_inexact_array)`` / ``eqx.partition`` with it, ``eqx.filter_grad`` and any optimizer
    over that filter (weight decay and momentum included) leave them bit for bit as they are, and
    ``eqx.tree_serialise_leaves`` / ``tree_deserialise_leaves`` round-trip them exactly.
    ``eqx.filter(model, eqx.is_array)`` does select them (integer arrays): optax's sgd and
    rmsprop steps over that filter leave them as they are (their gradients are None), while
    optax's adam family raises a pytree structure error there for any model holding an integer
    array; use ``eqx.is_inexact_array`` (docs/usage.md).
    Those save leaves only, in order, and take the layouts (static metadata) from ``like``: so
    that a file saved from weights of one layout is not read silently as another (same shapes,
    other byte orders), ``self.layout_tag`` is a small uint8 leaf whose length is a code of the
    layouts (:func:`layout_code`), and ``tree_deserialise_leaves`` into a module of other layouts
    raises (Equinox's "changed shape" error at ``.layout_tag``).
    Nothing of this module trains; the surrounding model's layers do (gradients flow through x).

    Call: ``layer(x, token_ids=None)`` with x ``[..., H]`` float (``token_ids`` int, x's leading
    axes, for hash-routed layers); returns x's shape and dtype.
    """

    weights: FrozenMoEWeights
    layout_tag: jax.Array
    config: MoEConfig = equinox.field(static=True)
    backend: str = equinox.field(static=True, default="auto")

    def __init__(self, weights, config: MoEConfig, backend: str = "auto"):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a jax_nvfp4.MoEConfig, got {type(config).__name__}")
        self.weights = FrozenMoEWeights.freeze(weights)
        self.layout_tag = jnp.zeros((layout_code(self.weights),), jnp.uint8)
        self.config = config
        self.backend = backend

    @property
    def moe_weights(self) -> MoEWeights:
        """The layer's :class:`jax_nvfp4.MoEWeights` (bit-cast back from the stored bits)."""
        code = layout_code(self.weights)
        if tuple(self.layout_tag.shape) != (code,):
            raise ValueError(
                f"layout_tag: shape {tuple(self.layout_tag.shape)} does not match the weights' "
                f"layouts {self.weights.layouts} (w13_paired={self.weights.meta[3]}), which give "
                f"({code},): the leaves come from weights of other layouts")
        return self.weights.weights()

    def __call__(self, x: jax.Array, token_ids=None, *, key=None) -> jax.Array:
        return moe(x, self.moe_weights, self.config, token_ids=token_ids, backend=self.backend)


_LAYOUT_DIGITS = {"checkpoint": 1, "sm90": 2, "fp8": 3}      # 0: the field is absent


def layout_code(weights: FrozenMoEWeights) -> int:
    """A positive integer that differs for every combination of the weight tensors' layouts
    (``w13``, ``w2``, ``shared_w13``, ``shared_w2``: absent, checkpoint, sm90, fp8) and
    ``w13_paired``: at most 512."""
    layouts = weights.layouts
    code = sum(_LAYOUT_DIGITS[layouts[f]] * 4 ** i if f in layouts else 0
               for i, f in enumerate(("w13", "w2", "shared_w13", "shared_w2")))
    return 1 + code + 256 * bool(weights.meta[3])


def trainable(model):
    """A filter spec for ``eqx.partition``: ``eqx.is_inexact_array`` on every leaf of ``model``.

    The same as ``eqx.is_inexact_array`` itself (an :class:`MoE`'s weights are integer leaves);
    kept as a name for code that partitions with it."""
    return jax.tree.map(equinox.is_inexact_array, model)
