"""NVFP4 Mixture-of-Experts checkpoints (layer 5): ModelOpt and Quark safetensors exports loaded
into :class:`jax_nvfp4.MoEWeights` and saved back (:mod:`.moe_files`: the formats, tensor names
and checks), Hugging Face model folders and their shard index (:mod:`.hf_folder`), and the
safetensors reader and writer (:mod:`.safetensors_io`). The public functions are importable from
here: ``jax_nvfp4.checkpoint.load_moe``, ``save_moe``, ``load_model_moe`` ..."""

from .hf_folder import open_checkpoint
from .moe_files import FORMATS, MIN_SCALE, detect_format, iter_model_moe, load_model_moe, load_moe, moe_layer_prefixes, save_moe
from .safetensors_io import SafetensorsReader, read_safetensors, read_safetensors_metadata, save_safetensors

__all__ = [
    "load_moe", "save_moe", "read_safetensors", "save_safetensors", "read_safetensors_metadata",
    "SafetensorsReader", "detect_format", "FORMATS", "load_model_moe", "iter_model_moe",
    "moe_layer_prefixes", "open_checkpoint", "MIN_SCALE",
]
