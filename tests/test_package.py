"""The package's public paths (jax_nvfp4/__init__.py): what ``jn.*`` names, and the module paths of
the flat layout the package had before its layers became folders (``jax_nvfp4.formats``,
``jax_nvfp4.dispatch`` ...), which import the same module objects as their new paths."""

import importlib
import subprocess
import sys

import jax_nvfp4 as jn

# the old path's last name -> its module now (the table in jax_nvfp4/__init__.py, written out again
# here so that a row dropped there fails)
MOVED = {
    "rows": "maths.rows", "swizzle": "maths.swizzle", "varying": "maths.varying",
    "formats": "maths.formats", "layout": "maths.layout", "quantization": "maths.quantization",
    "qwix_interop": "maths.qwix_interop", "options": "config.options",
    "kernel_config": "config.kernel_config", "hf_config": "config.hf_config",
    "moe_params": "config.moe_params", "gemm_args": "ops.gemm_args", "autodiff": "ops.autodiff",
    "fp8": "ops.fp8", "reference": "ops.reference", "gemm": "ops.gemm", "dispatch": "ops.dispatch",
    "ragged": "ops.ragged", "prepare": "ops.prepare", "routing": "layer.routing", "moe": "layer.moe",
    "sharding": "layer.sharding", "export": "layer.export",
    "safetensors_io": "checkpoint.safetensors_io", "hf_folder": "checkpoint.hf_folder",
}


def test_old_module_paths_are_the_new_modules():
    for old, now in MOVED.items():
        new = importlib.import_module(f"jax_nvfp4.{now}")
        assert importlib.import_module(f"jax_nvfp4.{old}") is new, old
        assert sys.modules[f"jax_nvfp4.{old}"] is new, old


def test_the_table_is_every_moved_module():
    assert {k: v.__name__ for k, v in jn._MOVED.items()} == {
        k: f"jax_nvfp4.{v}" for k, v in MOVED.items()}


def test_documented_paths_in_a_fresh_process():
    """The forms the README, docs/usage.md and the examples use, each in a process that has
    imported nothing of the package: ``from jax_nvfp4.<old> import name``, ``import
    jax_nvfp4.<old>``, ``jn.<module>.<name>``, ``jax_nvfp4.checkpoint.load_moe`` and the
    framework modules' paths; ``jn.moe`` stays the layer function after ``import jax_nvfp4.moe``."""
    code = "\n".join([
        "from jax_nvfp4.formats import NVFP4Tensor",
        "from jax_nvfp4.dispatch import dispatch_rows",
        "from jax_nvfp4.checkpoint import load_moe, save_moe, read_safetensors, SafetensorsReader, MIN_SCALE",
        "import jax_nvfp4.moe, jax_nvfp4.layout, jax_nvfp4.qwix_interop",
        "import jax_nvfp4 as jn",
        "assert callable(jn.moe) and not isinstance(jn.moe, type(jn))",
        "assert jn.layout.pair_gate_up is jax_nvfp4.maths.layout.pair_gate_up",
        "assert jn.qwix_interop.from_qwix and jn.reference.grouped_gemm and jn.fp8.quantize_rows",
        "assert jn.kernel_config.kernel_configs and jn.autodiff.frozen_weights",
        "assert NVFP4Tensor is jn.NVFP4Tensor and load_moe is jn.checkpoint.load_moe",
        "import jax_nvfp4.nn, jax_nvfp4.nn.frozen",
        "print('ok')",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
