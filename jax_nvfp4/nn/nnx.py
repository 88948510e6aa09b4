"""The NVFP4 MoE layer as a ``flax.nnx`` Module (needs flax: ``jax_nvfp4[frameworks]``)."""

from __future__ import annotations

import sys

import jax

from . import require
from .frozen import FrozenMoEWeights

nnx = require("flax.nnx", "flax")

from ..layer.moe import moe  # noqa: E402
from ..config.moe_params import MoEConfig, MoEWeights  # noqa: E402


class FrozenWeights(nnx.Variable):
    """An ``nnx.Variable`` for weights that are never trained.

    Not an ``nnx.Param``: ``nnx.grad``/``nnx.value_and_grad`` (whose default ``wrt`` is
    ``nnx.Param``) and ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` skip it, and it is its own
    collection in ``nnx.split(model, nnx.Param, FrozenWeights, ...)``. Its value is a
    :class:`~jax_nvfp4.nn.frozen.FrozenMoEWeights` (integer bits; the layout in the key paths).

    An ``nnx.Optimizer`` whose ``wrt`` selects it (``wrt=nnx.Variable``) raises TypeError at
    construction, saying what to pass instead.
    """

    def get_value(self, **kwargs):
        # nnx.Optimizer reads each variable its `wrt` selected in optimizer.to_opt_state: being
        # read there means the optimizer was told to train these weights, which cannot work
        # (integer bits, no gradient) and otherwise fails later with a pytree-mismatch message.
        caller = sys._getframe(1)
        if (caller.f_code.co_name == "_to_opt_state"
                and caller.f_globals.get("__name__", "").startswith("flax.nnx")):
            raise TypeError(_OPTIMIZER_WRT_MESSAGE)
        return super().get_value(**kwargs)


_OPTIMIZER_WRT_MESSAGE = (
    "nnx.Optimizer(model, tx, wrt=...): wrt selects the frozen NVFP4 weights of a "
    "jax_nvfp4.nn.nnx.MoE (a jax_nvfp4.nn.nnx.FrozenWeights variable: stored as integer bits, "
    "never trained, no gradient). Pass wrt=nnx.Param (the trainable parameters), or a filter "
    "that leaves them out, e.g. wrt=nnx.All(nnx.Variable, nnx.Not(FrozenWeights)), and give "
    "nnx.grad the same filter")


class MoE(nnx.Module):
    """The NVFP4 MoE layer (:func:`jax_nvfp4.moe`) with frozen weights.

    Args:
      weights: :class:`jax_nvfp4.MoEWeights` (e.g. from :func:`jax_nvfp4.checkpoint.load_moe`,
        in either layout), held as ``self.weights``, a :class:`FrozenWeights` variable whose
        value is a :class:`~jax_nvfp4.nn.frozen.FrozenMoEWeights`.
      config: :class:`jax_nvfp4.MoEConfig`, a static attribute.
      backend: grouped GEMM backend (``"auto"``, ``"ffi"``, ``"reference"``), static.

    The layout travels with the state: ``nnx.state``/``nnx.update`` carry it with the value, and
    in a checkpoint (orbax) it is part of each leaf's path, so restoring sm90-prepared weights
    into a model built with checkpoint-layout weights fails with a path mismatch instead of
    running with the wrong layout (build the restore target with weights of the saved layout).

    Call: ``layer(x, token_ids=None)`` with x ``[..., H]`` float; returns x's shape and dtype.
    Differentiable with respect to x; the weights get no gradient (integer leaves, and not an
    ``nnx.Param``).
    """

    def __init__(self, weights: MoEWeights, config: MoEConfig, *, backend: str = "auto"):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a jax_nvfp4.MoEConfig, got {type(config).__name__}")
        self.weights = FrozenWeights(FrozenMoEWeights.freeze(weights))
        self.config = config
        self.backend = backend

    @property
    def moe_weights(self) -> MoEWeights:
        """The layer's :class:`jax_nvfp4.MoEWeights` (bit-cast back from the stored bits)."""
        v = self.weights
        stored = v.get_value() if hasattr(v, "get_value") else v.value
        if not isinstance(stored, FrozenMoEWeights):
            raise TypeError(f"MoE.weights: expected a FrozenWeights holding a "
                            f"jax_nvfp4.nn.frozen.FrozenMoEWeights, got {type(stored).__name__}")
        return stored.weights()

    def __call__(self, x: jax.Array, token_ids=None) -> jax.Array:
        return moe(x, self.moe_weights, self.config, token_ids=token_ids, backend=self.backend)
