"""jax_nvfp4: NVFP4 grouped GEMM and Mixture-of-Experts for JAX.

The subpackages are the package's layers, bottom to top (an import only points down):
:mod:`.maths` (the formats and quantization), :mod:`.config` (options, the kernel heuristic, the
layer's configuration), :mod:`.ops` (the GEMMs and their custom calls), :mod:`.layer` (the MoE
layer, expert parallelism, export), :mod:`.checkpoint` and :mod:`.nn` (loaders and frameworks),
and :mod:`.bench` (the benchmarks, users of the public API). See :mod:`jax_nvfp4.maths.formats` for the
storage convention.
"""

import sys as _sys
from importlib import metadata as _metadata

# first: its import refuses a jax older than the supported range before any module uses its API
from . import _jax_range as _jax_range
from . import checkpoint
from .config import hf_config, kernel_config, moe_params, options
from .layer import export, routing, sharding
from .maths import formats, layout, quantization, qwix_interop, rows, swizzle, varying
from .ops import autodiff, dispatch, fp8, gemm, gemm_args, prepare, ragged, reference
from ._extension import ExtensionInfo, extension_info
from .maths.formats import LAYOUTS, Fp8Weights, NVFP4Tensor, scales_from_bytes
from .ops.gemm import grouped_gemm, grouped_gemm_swiglu
from .ops.prepare import prepare_weights
from .layer.moe import moe, quantize_moe, swiglu
from .config.moe_params import MoEConfig, MoEWeights
from .layer.routing import route
from .ops.ragged import RaggedRhs, ragged_dot, ragged_rhs
from .layer.sharding import moe_expert_parallel, shard_moe_weights
from .maths.quantization import dequantize, quantize, stage_activation
from .maths.swizzle import swizzle_scales, unswizzle_scales
from .layer.export import export_checks
from .checkpoint import hf_folder, safetensors_io
from . import _extension as _ext

# The module paths of the flat layout the package had (``jax_nvfp4.formats``,
# ``jax_nvfp4.dispatch`` ...) keep importing, as the same module objects: one table, the old
# name on the left. ``jax_nvfp4.moe`` as an attribute is the layer function, as before; as a
# module path it is the layer's module.
_MOVED = {"rows": rows, "swizzle": swizzle, "varying": varying, "formats": formats, "layout": layout,
          "quantization": quantization, "qwix_interop": qwix_interop, "options": options,
          "kernel_config": kernel_config, "hf_config": hf_config, "moe_params": moe_params,
          "gemm_args": gemm_args, "autodiff": autodiff, "fp8": fp8, "reference": reference,
          "gemm": gemm, "dispatch": dispatch, "ragged": ragged, "prepare": prepare,
          "routing": routing, "moe": _sys.modules[__name__ + ".layer.moe"], "sharding": sharding,
          "export": export, "safetensors_io": safetensors_io, "hf_folder": hf_folder}
for _old, _module in _MOVED.items():
    _sys.modules.setdefault(f"{__name__}.{_old}", _module)

# The custom calls are registered at import (not at the first call): a deserialized jax.export
# artifact calls them by name, with no call into this package before it compiles. An extension
# whose handlers this jaxlib's XLA would refuse is an ImportError here, before any registration.
_ext.load()

try:
    __version__ = _metadata.version("jax_nvfp4")
except _metadata.PackageNotFoundError:     # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "ExtensionInfo", "Fp8Weights", "LAYOUTS", "NVFP4Tensor", "MoEConfig", "MoEWeights", "autodiff", "checkpoint",
    "export_checks", "extension_info", "fp8", "kernel_config", "swiglu", "dequantize", "grouped_gemm",
    "grouped_gemm_swiglu",
    "layout", "moe", "qwix_interop", "RaggedRhs", "ragged_dot", "ragged_rhs", "options", "quantize", "moe_expert_parallel", "prepare_weights", "quantize_moe", "route",
    "shard_moe_weights",
    "reference", "scales_from_bytes", "stage_activation", "swizzle_scales", "unswizzle_scales",
]
