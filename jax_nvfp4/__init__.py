"""jax_nvfp4: NVFP4 grouped GEMM and Mixture-of-Experts for JAX.

See :mod:`jax_nvfp4.formats` for the storage convention.
"""

from importlib import metadata as _metadata

# first: its import refuses a jax older than the supported range before any module uses its API
from . import _jax_range as _jax_range
from . import autodiff, checkpoint, fp8, kernel_config, layout, options, qwix_interop, reference
from ._extension import ExtensionInfo, extension_info
from .formats import LAYOUTS, Fp8Weights, NVFP4Tensor, scales_from_bytes
from .gemm import grouped_gemm, grouped_gemm_swiglu
from .prepare import prepare_weights
from .moe import moe, quantize_moe, swiglu
from .moe_params import MoEConfig, MoEWeights
from .routing import route
from .ragged import RaggedRhs, ragged_dot, ragged_rhs
from .sharding import moe_expert_parallel, shard_moe_weights
from .quantization import dequantize, quantize, stage_activation
from .swizzle import swizzle_scales, unswizzle_scales
from .export import export_checks
from . import _extension as _ext

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
