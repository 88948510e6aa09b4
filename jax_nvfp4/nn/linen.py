"""The NVFP4 MoE layer as a ``flax.linen`` Module (needs flax: ``jax_nvfp4[frameworks]``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import require

nn = require("flax.linen", "flax")

from ..formats import NVFP4Tensor  # noqa: E402
from ..moe import moe  # noqa: E402
from ..moe_params import MoEConfig, MoEWeights  # noqa: E402

COLLECTION = "nvfp4"
"""The variable collection holding the weights (not ``"params"``: optimizers over params skip it)."""


def placeholder_weights(config: MoEConfig) -> MoEWeights:
    """All-zero :class:`jax_nvfp4.MoEWeights` of ``config``'s shapes (global scales 1): what
    ``init`` puts in the collection, to be replaced by the real weights."""
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size

    def zeros(*shape):
        lead = shape[:-1]
        return NVFP4Tensor(jnp.zeros(lead + (shape[-1] // 2,), jnp.uint8),
                           jnp.zeros(lead + (shape[-1] // 16,), jnp.float8_e4m3fn),
                           jnp.ones(lead[:1] if len(lead) > 1 else (), jnp.float32))

    shared = config.n_shared_experts * i
    return MoEWeights(router_weight=jnp.zeros((e, h), jnp.float32), w13=zeros(e, 2 * i, h),
                      w2=zeros(e, h, i),
                      shared_w13=zeros(2 * shared, h) if shared else None,
                      shared_w2=zeros(h, shared) if shared else None)


class MoE(nn.Module):
    """The NVFP4 MoE layer (:func:`jax_nvfp4.moe`) with frozen weights.

    The weights live in the ``"nvfp4"`` variable collection (:data:`COLLECTION`) under the name
    ``"weights"``, not in ``"params"``: ``init`` fills it with :func:`placeholder_weights`; put the
    real :class:`jax_nvfp4.MoEWeights` there before ``apply``, e.g.
    ``variables["nvfp4"]["moe"]["weights"] = weights`` for a submodule named ``moe`` (or
    ``{"nvfp4": {"weights": weights}}`` for the layer alone). Gradients and optimizers over
    ``"params"`` never see them, and ``apply`` stops their gradient anyway.

    Attributes:
      config: :class:`jax_nvfp4.MoEConfig` (static, hashable).
      backend: grouped GEMM backend (``"auto"``, ``"ffi"``, ``"reference"``).

    Call: ``layer(x, token_ids=None)`` with x ``[..., H]``; returns x's shape and dtype,
    differentiable with respect to x.
    """

    config: MoEConfig
    backend: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, token_ids=None) -> jax.Array:
        weights = self.variable(COLLECTION, "weights", placeholder_weights, self.config).value
        if not isinstance(weights, MoEWeights):
            raise TypeError(f'variables["{COLLECTION}"]...["weights"]: expected a '
                            f"jax_nvfp4.MoEWeights, got {type(weights).__name__}")
        w = jax.lax.stop_gradient(weights)
        return moe(x, w, self.config, token_ids=token_ids, backend=self.backend)
