"""The NVFP4 MoE layer as a ``flax.nnx`` Module (needs flax: ``jax_nvfp4[frameworks]``)."""

from __future__ import annotations

import jax

from . import require

nnx = require("flax.nnx", "flax")

from ..moe import moe  # noqa: E402
from ..moe_params import MoEConfig, MoEWeights  # noqa: E402


class FrozenWeights(nnx.Variable):
    """An ``nnx.Variable`` for weights that are never trained.

    Not an ``nnx.Param``: ``nnx.grad``/``nnx.value_and_grad`` (whose default ``wrt`` is
    ``nnx.Param``) and ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` skip it, and it is its own
    collection in ``nnx.split(model, nnx.Param, FrozenWeights, ...)``.
    """


class MoE(nnx.Module):
    """The NVFP4 MoE layer (:func:`jax_nvfp4.moe`) with frozen weights.

    Args:
      weights: :class:`jax_nvfp4.MoEWeights` (e.g. from :func:`jax_nvfp4.checkpoint.load_moe`),
        held as ``self.weights``, a :class:`FrozenWeights` variable.
      config: :class:`jax_nvfp4.MoEConfig`, a static attribute.
      backend: grouped GEMM backend (``"auto"``, ``"ffi"``, ``"reference"``), static.

    Call: ``layer(x, token_ids=None)`` with x ``[..., H]``; returns x's shape and dtype.
    Differentiable with respect to x; the weights get no gradient (``stop_gradient``, and they
    are not an ``nnx.Param``).
    """

    def __init__(self, weights: MoEWeights, config: MoEConfig, *, backend: str = "auto"):
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights: expected a jax_nvfp4.MoEWeights, got {type(weights).__name__}")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a jax_nvfp4.MoEConfig, got {type(config).__name__}")
        self.weights = FrozenWeights(weights)
        self.config = config
        self.backend = backend

    def __call__(self, x: jax.Array, token_ids=None) -> jax.Array:
        v = self.weights
        w = jax.lax.stop_gradient(v.get_value() if hasattr(v, "get_value") else v.value)
        return moe(x, w, self.config, token_ids=token_ids, backend=self.backend)
