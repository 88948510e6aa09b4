"""Framework modules around the NVFP4 MoE layer, each an optional import:

* :mod:`jax_nvfp4.nn.nnx`: ``MoE``, a ``flax.nnx.Module``;
* :mod:`jax_nvfp4.nn.linen`: ``MoE``, a ``flax.linen.Module``;
* :mod:`jax_nvfp4.nn.eqx`: ``MoE``, an ``equinox.Module``.

Install the frameworks with ``pip install "jax_nvfp4[frameworks]"`` (flax, equinox). Every module
holds a :class:`jax_nvfp4.MoEWeights` as frozen state, a
:class:`jax_nvfp4.nn.frozen.FrozenMoEWeights` (integer bits, the layout in the key paths: never
selected by a framework's usual filter of what trains, restored only into a target of the same
layout; see each module), takes ``x`` of shape ``[..., H]`` (and ``token_ids`` shaped like
x's leading axes for hash-routed layers), keeps the :class:`jax_nvfp4.MoEConfig` static, and is
differentiable with respect to x (:func:`jax_nvfp4.moe`: straight-through GEMM inputs, frozen
weights).
"""


import importlib


def require(module: str, package: str):
    """Import ``module`` or raise an ImportError naming the extra that installs ``package``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"jax_nvfp4.nn needs {package} for this module ({e}); install it with "
                          f'pip install {package} or pip install "jax_nvfp4[frameworks]"') from e
