"""Loads the compiled extension (if built) and registers its FFI targets with JAX."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from pathlib import Path
from typing import Optional

import jax

ABI_VERSION = 3
"""The version of the custom calls' interface (operands, attributes, what they compute), the
suffix ``_v3`` of every target name: ``kInterfaceVersion`` of csrc/gemm_attributes.h, from which
ffi/module.cc builds the names it registers (bump both on any such change; a test checks them). A program serialized by ``jax.export`` calls the targets by name, so an artifact from a
build of another version fails to compile, naming the missing target, instead of running the
handlers on arguments they do not expect."""


def target_name(base: str) -> str:
    """The registered name of custom call ``base``: ``"jax_nvfp4_grouped_gemm"`` ->
    ``"jax_nvfp4_grouped_gemm_v3"``."""
    return f"{base}_v{ABI_VERSION}"


TARGET = target_name("jax_nvfp4_grouped_gemm")
TARGETS = tuple(target_name(f"jax_nvfp4_{n}") for n in (
    "grouped_gemm", "grouped_gemm_glu", "dispatch_rows", "quantize_fp8"))
"""Every custom call of the extension (CPU handlers; CUDA ones where built, same names)."""
PACKAGE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _import():
    """``(module, None)`` or ``(None, import error text)``."""
    try:
        from . import _jax_nvfp4 as ext  # noqa: PLC0415
        _check_abi(ext)
    except ImportError as e:
        return None, f"{type(e).__name__}: {e}"
    return ext, None


def compiled_module():
    """The compiled module ``jax_nvfp4._jax_nvfp4`` without registering its handlers, or None if
    it is not built (or is a build of another ABI version)."""
    return _import()[0]


@functools.lru_cache(maxsize=None)
def load():
    """Import ``jax_nvfp4._jax_nvfp4`` and register its handlers; None if it was not built."""
    ext, _ = _import()
    if ext is None:
        return None
    for name, capsule in ext.cpu_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    for name, capsule in ext.cuda_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return ext


def _check_abi(ext) -> None:
    """ImportError unless the compiled module registers this package's target names (a stale
    build of another ABI version would otherwise surface as a missing target at the first call);
    the extension then counts as not built, with this as the reason."""
    missing = sorted(set(TARGETS) - set(ext.cpu_registrations()))
    if missing:
        raise ImportError(
            f"jax_nvfp4: the compiled extension {ext.__file__} does not register the custom calls "
            f"{missing} that this jax_nvfp4 (ABI version {ABI_VERSION}) calls; it registers "
            f"{sorted(ext.cpu_registrations())}. It is a build of another version: reinstall "
            "(pip install .) or rebuild it in place")


def available() -> bool:
    """Whether the compiled extension (at least the CPU handler) is importable."""
    return load() is not None


def has_cuda() -> bool:
    """Whether the extension was built with the CUDA (sm_90a) handler."""
    ext = load()
    return ext is not None and bool(ext.built_with_cuda())


def source_tree_shadowing() -> Optional[str]:
    """If jax_nvfp4 was imported from a source checkout without a compiled extension, a message
    saying so and how to run instead; else None.

    A source checkout is a folder holding pyproject.toml and CMakeLists.txt above the package;
    ``python -m pytest`` or ``python -m jax_nvfp4.bench`` run there put it first on sys.path, so
    it shadows the installed (built) package.
    """
    root = PACKAGE_DIR.parent
    if not ((root / "pyproject.toml").is_file() and (root / "CMakeLists.txt").is_file()):
        return None
    if any(PACKAGE_DIR.glob("_jax_nvfp4*.so")) or any(PACKAGE_DIR.glob("_jax_nvfp4*.pyd")):
        return None
    installed = ""
    try:
        dist = importlib.metadata.distribution("jax_nvfp4")
        where = Path(str(dist.locate_file("jax_nvfp4"))).resolve()
        if where != PACKAGE_DIR:
            installed = f"; it shadows the installed jax_nvfp4 {dist.version} ({where})"
    except importlib.metadata.PackageNotFoundError:
        installed = "; no installed jax_nvfp4 was found either"
    return (f"jax_nvfp4 was imported from the source tree {root} (the current directory or "
            f"PYTHONPATH put it first on sys.path), which holds no compiled extension{installed}. "
            "Run from another directory, or with `python -P` (keeps the current directory off "
            "sys.path), after `pip install .`; or build in place with "
            "`pip install -Ceditable.mode=inplace -e .`")


def not_built_message() -> str:
    """Why the extension is not available, and what to do (for errors and warnings)."""
    shadow = source_tree_shadowing()
    if shadow is not None:
        return shadow
    _, err = _import()
    return (f"the compiled extension jax_nvfp4._jax_nvfp4 is not importable ({err}); reinstall "
            "with a C++17 compiler and CMake >= 3.24 (see README)")


@dataclasses.dataclass(frozen=True)
class ExtensionInfo:
    """What :func:`jax_nvfp4.extension_info` reports.

    Attributes:
      built: the compiled extension (C++ CPU handler) imports.
      cuda: it was built with the CUDA handler.
      cuda_archs: the CUDA images the handler carries, e.g. ``("sm_80", "sm_90a", "compute_80")``
        (machine code for sm_80 and sm_90a, PTX for compute_80; the portable build: only
        ``("compute_80",)``).
      path: the compiled module's file, or None.
      package_dir: the folder jax_nvfp4 was imported from.
      source_tree: that folder is a source checkout (pyproject.toml and CMakeLists.txt above it).
      reason: why it is not built (the import error, or the source tree shadowing the installed
        package, with what to do), or None when built.
    """

    built: bool
    cuda: bool
    cuda_archs: tuple
    path: Optional[str]
    package_dir: str
    source_tree: bool
    reason: Optional[str]


def extension_info() -> ExtensionInfo:
    """Whether the compiled extension is built, with which CUDA handler, and from where.

    Returns:
      :class:`ExtensionInfo`; ``print(jax_nvfp4.extension_info())`` after installing shows
      whether the build found nvcc (the build's own message is hidden by pip unless ``-v``).
    """
    ext = load()
    root = PACKAGE_DIR.parent
    source = (root / "pyproject.toml").is_file() and (root / "CMakeLists.txt").is_file()
    if ext is None:
        return ExtensionInfo(False, False, (), None, str(PACKAGE_DIR), source, not_built_message())
    cuda = bool(ext.built_with_cuda())
    archs = ext.cuda_targets() if cuda else ""
    return ExtensionInfo(True, cuda, tuple(archs.split()), ext.__file__,
                         str(PACKAGE_DIR), source, None)
