"""Loads the compiled extension (if built) and registers its FFI targets with JAX."""

from __future__ import annotations

import functools

import jax

TARGET = "jax_nvfp4_grouped_gemm"


@functools.lru_cache(maxsize=None)
def load():
    """Import ``jax_nvfp4._jax_nvfp4`` and register its handlers; None if it was not built."""
    try:
        from . import _jax_nvfp4 as ext  # noqa: PLC0415
    except ImportError:
        return None
    for name, capsule in ext.cpu_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    for name, capsule in ext.cuda_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return ext


def available() -> bool:
    """Whether the compiled extension (at least the CPU handler) is importable."""
    return load() is not None


def has_cuda() -> bool:
    """Whether the extension was built with the CUDA (sm_90a) handler."""
    ext = load()
    return ext is not None and bool(ext.built_with_cuda())
