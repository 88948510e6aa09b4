"""jax_nvfp4: NVFP4 grouped GEMM and Mixture-of-Experts for JAX.

See :mod:`jax_nvfp4.formats` for the storage convention.
"""

from . import checkpoint, kernel_config, layout, reference
from .formats import LAYOUTS, NVFP4Tensor, scales_from_bytes
from .gemm import grouped_gemm
from .layout import prepare_weights
from .moe import moe, quantize_moe
from .moe_params import MoEConfig, MoEWeights
from .routing import route
from .sharding import moe_expert_parallel, shard_moe_weights
from .quantization import dequantize, quantize, stage_activation
from .swizzle import swizzle_scales, unswizzle_scales

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS", "NVFP4Tensor", "MoEConfig", "MoEWeights", "checkpoint", "dequantize", "grouped_gemm",
    "kernel_config",
    "layout", "moe", "quantize", "moe_expert_parallel", "prepare_weights", "quantize_moe", "route",
    "shard_moe_weights",
    "reference", "scales_from_bytes", "stage_activation", "swizzle_scales", "unswizzle_scales",
]
