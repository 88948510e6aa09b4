"""The NVFP4 MoE layer as an Equinox Module (needs equinox: ``jax_nvfp4[frameworks]``)."""

from __future__ import annotations

import jax

from . import require

equinox = require("equinox", "equinox")

from ..moe import moe  # noqa: E402
from ..moe_params import MoEConfig, MoEWeights  # noqa: E402


class MoE(equinox.Module):
    """The NVFP4 MoE layer (:func:`jax_nvfp4.moe`) with frozen weights.

    ``weights`` is an ordinary (array) field, so the module goes through ``eqx.filter_jit`` and
    ``jax.jit`` as a pytree and the weights are traced arguments, not compile-time constants;
    ``config`` and ``backend`` are static fields. ``__call__`` applies ``jax.lax.stop_gradient``
    to the weights (the Equinox idiom for buffers), so their gradients are zero. The weights hold
    inexact leaves (float32 router, float8 scales), so an optimizer that moves parameters without
    a gradient (weight decay) must not see them: partition with :func:`trainable` as the filter
    (``eqx.partition(model, trainable(model))``).

    Call: ``layer(x, token_ids=None)`` with x ``[..., H]``; returns x's shape and dtype.
    """

    weights: MoEWeights
    config: MoEConfig = equinox.field(static=True)
    backend: str = equinox.field(static=True, default="auto")

    def __check_init__(self):
        if not isinstance(self.weights, MoEWeights):
            raise TypeError(f"weights: expected a jax_nvfp4.MoEWeights, got "
                            f"{type(self.weights).__name__}")
        if not isinstance(self.config, MoEConfig):
            raise TypeError(f"config: expected a jax_nvfp4.MoEConfig, got "
                            f"{type(self.config).__name__}")

    def __call__(self, x: jax.Array, token_ids=None, *, key=None) -> jax.Array:
        w = jax.lax.stop_gradient(self.weights)
        return moe(x, w, self.config, token_ids=token_ids, backend=self.backend)


def trainable(model):
    """A filter spec for ``eqx.partition``: ``eqx.is_inexact_array`` for every leaf of ``model``
    except the weights of any :class:`MoE` inside it (False)."""
    return jax.tree.map(lambda v: False if isinstance(v, MoEWeights) else equinox.is_inexact_array(v),
                        model, is_leaf=lambda v: isinstance(v, MoEWeights))
