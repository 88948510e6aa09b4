"""The NVFP4 MoE layer as a ``flax.linen`` Module (needs flax: ``jax_nvfp4[frameworks]``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import require
from .frozen import FrozenMoEWeights

nn = require("flax.linen", "flax")

from ..layer.moe import moe  # noqa: E402
from ..config.moe_params import MoEConfig, MoEWeights  # noqa: E402

COLLECTION = "nvfp4"
"""The variable collection holding the weights (not ``"params"``: optimizers over params skip it)."""


def freeze(weights: MoEWeights) -> FrozenMoEWeights:
    """The value to put in the :data:`COLLECTION` for a :class:`MoE`: ``weights`` (a
    :class:`jax_nvfp4.MoEWeights`, either layout) stored as integer bits with the layout in the
    key paths (:class:`~jax_nvfp4.nn.frozen.FrozenMoEWeights`)."""
    return FrozenMoEWeights.freeze(weights)


class MoE(nn.Module):
    """The NVFP4 MoE layer (:func:`jax_nvfp4.moe`) with frozen weights.

    The weights live in the ``"nvfp4"`` variable collection (:data:`COLLECTION`) under the name
    ``"weights"``, not in ``"params"``, as :func:`freeze` ``(weights)``: e.g.
    ``variables["nvfp4"] = {"moe": {"weights": freeze(weights)}}`` for a submodule named ``moe``
    (``{"nvfp4": {"weights": freeze(weights)}}`` for the layer alone). ``init`` does not create
    them (there is nothing to initialize: an all-zero layer would silently output zeros), and its
    output for this layer is zeros of x's shape; ``apply`` without them raises ValueError.
    Gradients and optimizers over ``"params"`` never see them (integer leaves, another
    collection). A restore (orbax) into a target built with weights of another layout is a
    path mismatch: the layout is part of each leaf's key.

    Attributes:
      config: :class:`jax_nvfp4.MoEConfig` (static, hashable).
      backend: grouped GEMM backend (``"auto"``, ``"ffi"``, ``"reference"``).

    Call: ``layer(x, token_ids=None)`` with x ``[..., H]`` float (``token_ids`` int, x's leading
    axes, for hash-routed layers); returns x's shape and dtype, differentiable with respect to x.
    """

    config: MoEConfig
    backend: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, token_ids=None) -> jax.Array:
        if not isinstance(self.config, MoEConfig):
            raise TypeError(f"config: expected a jax_nvfp4.MoEConfig, got "
                            f"{type(self.config).__name__}")
        if not self.has_variable(COLLECTION, "weights"):
            if self.is_initializing():
                return self._init_output(x)
            raise ValueError(
                f'variables["{COLLECTION}"]{self._where()}["weights"]: missing; this MoE\'s '
                f"NVFP4 weights are not created by init: put "
                f"jax_nvfp4.nn.linen.freeze(weights) there before apply")
        stored = self.get_variable(COLLECTION, "weights")
        if not isinstance(stored, FrozenMoEWeights):
            raise TypeError(
                f'variables["{COLLECTION}"]{self._where()}["weights"]: expected '
                f"jax_nvfp4.nn.linen.freeze(weights) (a FrozenMoEWeights), got "
                f"{type(stored).__name__}")
        return moe(x, stored.weights(), self.config, token_ids=token_ids, backend=self.backend)

    def _where(self) -> str:
        return "".join(f'["{p}"]' for p in self.scope.path)

    def _init_output(self, x):
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"x: expected [..., {self.config.hidden_size}], got {x.shape}")
        return jnp.zeros_like(x)
