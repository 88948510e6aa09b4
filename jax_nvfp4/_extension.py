"""Loads the compiled extension (if built) and registers its FFI targets with JAX."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from pathlib import Path
from typing import Optional

import jax

from . import _jax_range

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
    """Import ``jax_nvfp4._jax_nvfp4`` and register its handlers; None if it was not built.

    ImportError, before anything is registered, if the installed jaxlib's XLA would refuse the
    handlers (built against a newer jaxlib's FFI headers: :func:`_jax_range.check_ffi_api`)."""
    ext, _ = _import()
    if ext is None:
        return None
    _jax_range.check_ffi_api(ext.xla_ffi_api_version(), ext.built_against_jaxlib(),
                             reinstall_source(ext))
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
    if not missing and not all(hasattr(ext, f) for f in _BUILD_QUERIES):
        raise ImportError(
            f"jax_nvfp4: the compiled extension {ext.__file__} predates this jax_nvfp4 (it lacks "
            f"{[f for f in _BUILD_QUERIES if not hasattr(ext, f)]}): reinstall (pip install .) or "
            "rebuild it in place")
    if missing:
        raise ImportError(
            f"jax_nvfp4: the compiled extension {ext.__file__} does not register the custom calls "
            f"{missing} that this jax_nvfp4 (ABI version {ABI_VERSION}) calls; it registers "
            f"{sorted(ext.cpu_registrations())}. It is a build of another version: reinstall "
            "(pip install .) or rebuild it in place")


_BUILD_QUERIES = ("xla_ffi_api_version", "built_against_jaxlib", "cuda_off_reason", "source_dir",
                  "cuda_compiler_source")
"""What the compiled module reports about its build (ffi/module.cc), beside the registrations."""


def reinstall_source(ext) -> str:
    """The source folder to reinstall from: the one the extension was built from if it is still
    there (pip builds a local folder in place), else a placeholder."""
    src = ext.source_dir()
    if src and (Path(src) / "pyproject.toml").is_file():
        return src
    return "<jax_nvfp4 source folder>"


def no_cuda_message(ext=None) -> Optional[str]:
    """Why the extension has no CUDA handler and the command that builds it (None if it has one,
    or if the extension is not built: :func:`not_built_message` says why)."""
    ext = compiled_module() if ext is None else ext
    if ext is None or ext.built_with_cuda():
        return None
    reason = ext.cuda_off_reason() or "it was built without it"
    src = reinstall_source(ext)
    if "JAX_NVFP4_CUDA=OFF" in reason:
        fix = f"pip install --force-reinstall --no-deps {src}"
    else:
        # nvidia-cuda-nvcc brings nvcc, cicc, the runtime and crt headers (jax[cuda13] installs
        # it too); the build finds it in the environment's site-packages (CMakeLists.txt)
        fix = (f"pip install nvidia-cuda-nvcc && pip install --force-reinstall --no-deps {src} "
               "(or put a CUDA toolkit's nvcc on the PATH first)")
    return f"jax_nvfp4 was built without the CUDA handler: {reason}. To build it: {fix}"


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
      cuda_reason: why it has no CUDA handler, with the command that builds it, or None (built
        with it, or not built at all: ``reason`` says why).
      cuda_compiler: where the build's nvcc came from: ``"path"`` (a CUDA toolkit: the PATH,
        CUDACXX), ``"wheels"`` (NVIDIA's wheels in site-packages), or None without the handler.
      xla_ffi_api: ``(major, minor)`` of the XLA FFI API the handlers declare, or None.
      built_against_jaxlib: the jaxlib whose FFI headers they were compiled against, or None.
    """

    built: bool
    cuda: bool
    cuda_archs: tuple
    path: Optional[str]
    package_dir: str
    source_tree: bool
    reason: Optional[str]
    cuda_reason: Optional[str] = None
    cuda_compiler: Optional[str] = None
    xla_ffi_api: Optional[tuple] = None
    built_against_jaxlib: Optional[str] = None


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
                         str(PACKAGE_DIR), source, None, no_cuda_message(ext),
                         ext.cuda_compiler_source() or None, tuple(ext.xla_ffi_api_version()),
                         ext.built_against_jaxlib())
