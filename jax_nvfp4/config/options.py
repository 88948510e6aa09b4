"""The library's options and their validation: one place for every choice a caller makes.

This module sits above the formats' maths (it imports :mod:`jax_nvfp4._extension` and the
formats' own vocabularies from :mod:`jax_nvfp4.maths.formats`): every module above it takes its option
names and checks from here, and each option is checked once, where it enters the public API.

* ``backend``: how a grouped GEMM (and the dispatch and FP8 quantizer calls) runs. ``"ffi"`` is
  the custom call on whichever platform the arrays live (CPU handler or CUDA kernels),
  ``"reference"`` the pure-jnp definition, ``"auto"`` the custom call when the extension is built
  (with the CUDA handler on a GPU), else the reference with a one-time warning.
* ``precision``: the GEMMs' compute mode, ``"exact"`` (bf16 tensor cores, the exact NVFP4
  product) or ``"fp8"`` (e4m3 operands, K a multiple of :data:`FP8_CHUNK`).
* ``layout``: the byte order of NVFP4 weight codes and block scales, ``"checkpoint"`` (as stored)
  or ``"sm90"`` (:func:`jax_nvfp4.prepare_weights`); ``"fp8"``, weights prepared once as e4m3 for
  ``precision="fp8"`` (one byte per weight, :class:`jax_nvfp4.maths.formats.Fp8Weights`).
* The MoE layer's: ``activation``, ``activation_scale``, ``scoring_func``, ``row_dtype``
  (:class:`jax_nvfp4.MoEConfig`); the expert-parallel ``combine``.
* ``kernel``: a CUDA kernel family (:data:`FAMILIES`; :mod:`jax_nvfp4.config.kernel_config`), and the
  custom call's codes for families and weight layouts (:data:`LAYOUT_CODES`): the C++ enums of
  ``csrc/kernel_table.h`` and ``csrc/gemm_attributes.h``, taken from the compiled extension (a copy where it is not built).
* The FP8 activation rows' k order (:data:`FP8_K_ORDERS`), the checkpoint formats
  (:data:`CHECKPOINT_FORMATS`).

``precision`` and ``backend`` are checked where they enter the public API (:func:`check_precision`
returns a :class:`Precision`, :func:`resolve_backend` a :class:`Backend`), and what is passed down
as one of these is not checked again; every vocabulary is checked by :func:`check_choice`.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import jax

from .. import _extension
# The formats' own vocabularies (byte layouts, the FP8 chunk and k orders) are facts of the
# formats: defined there, below this module, and named here beside the options that take them.
from ..maths.formats import FP8_CHUNK, FP8_K_ORDERS, FP8_LAYOUT, LAYOUTS  # noqa: F401 (named here too)

BACKENDS = ("auto", "ffi", "reference")
PRECISIONS = ("exact", "fp8")
LAYER_PRECISIONS = PRECISIONS + ("auto",)
"""What :class:`jax_nvfp4.MoEConfig` takes as ``precision``: a GEMM precision, or ``"auto"`` (the
layer picks one per call from its token count, :meth:`jax_nvfp4.MoEConfig.for_tokens`)."""
WEIGHT_LAYOUTS = LAYOUTS + (FP8_LAYOUT,)
"""What :func:`jax_nvfp4.prepare_weights` prepares: the NVFP4 byte layouts, and ``"fp8"``."""
ACTIVATIONS = ("w4a4", "w4a16")
ACTIVATION_SCALES = ("dynamic", "static")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
ROW_DTYPES = ("bfloat16", "float32")
COMBINES = ("psum", "psum_scatter")
"""How :func:`jax_nvfp4.moe_expert_parallel` combines the devices' outputs."""
CHECKPOINT_FORMATS = ("modelopt", "quark")
"""Checkpoint formats :func:`jax_nvfp4.checkpoint.load_moe` understands (``"auto"`` picks one
from the names)."""

# The custom call's codes are the C++ enums of csrc/kernel_table.h and gemm_attributes.h; the compiled module hands them
# over (family_codes, fp8_families, layout_codes in ffi/module.cc). These copies serve a package
# without the extension (the reference backend); tests/test_options.py checks them against the
# module, tests/test_docs.py against the header.
_FAMILY_CODES_UNBUILT = {"mma": 0, "mma_ws": 1, "wgmma": 2, "wgmma_fp8": 3, "wgmma_fp8_prepared": 4,
                         "cutlass_fp8": 5}
_FP8_FAMILIES_UNBUILT = ("wgmma_fp8", "wgmma_fp8_prepared", "cutlass_fp8")
_LAYOUT_CODES_UNBUILT = {"checkpoint": 0, "sm90": 1, "fp8": 2}


def contract_codes(ext) -> tuple[dict, tuple, dict]:
    """``(family codes, FP8 families, layout codes)`` from the compiled module ``ext`` (the C++
    enums), or, for ``ext=None`` (not built), this module's copies of them."""
    if ext is None:
        return dict(_FAMILY_CODES_UNBUILT), _FP8_FAMILIES_UNBUILT, dict(_LAYOUT_CODES_UNBUILT)
    return dict(ext.family_codes()), tuple(ext.fp8_families()), dict(ext.layout_codes())


FAMILY_CODES, FP8_FAMILIES, LAYOUT_CODES = contract_codes(_extension.compiled_module())
# FAMILY_CODES: {family: the custom call's ``kernel`` attribute code} (the ``KernelFamily`` enum);
# FP8_FAMILIES: the families that compute the FP8 mode (and nothing else); LAYOUT_CODES: {weight
# layout: the ``rhs_layout`` attribute code, as the heuristic takes it too} (the ``RhsLayout`` enum).
FAMILIES = tuple(sorted(FAMILY_CODES, key=lambda f: FAMILY_CODES[f]))
"""Kernel families, in the order of their codes (:data:`FAMILY_CODES`)."""


def check_choice(value, choices: tuple[str, ...], name: str) -> str:
    """``value`` if it is one of ``choices`` (strings), else a ValueError naming ``name``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r:.100}")
    return value


class Precision(str):
    """A ``precision`` that :func:`check_precision` accepted (equal to, and hashed as, its name):
    functions that receive one pass it on without checking it again."""

    __slots__ = ()


def check_precision(precision, k: int | None = None, name: str = "precision") -> Precision:
    """``precision`` as a :class:`Precision` if it is one of :data:`PRECISIONS` (a Precision
    already is); with ``"fp8"`` and a reduction size ``k``, also checks ``k % FP8_CHUNK == 0``.
    ValueError naming the argument otherwise."""
    if not isinstance(precision, Precision):
        precision = Precision(check_choice(precision, PRECISIONS, name))
    if precision == "fp8" and k is not None:
        check_fp8_k(k, name)
    return precision


def check_layer_precision(precision, name: str = "precision") -> str:
    """``precision`` of the layer: ``"auto"`` as it is, else as :func:`check_precision` gives it.
    ValueError naming the argument and :data:`LAYER_PRECISIONS` otherwise."""
    if isinstance(precision, Precision):
        return precision
    check_choice(precision, LAYER_PRECISIONS, name)
    return precision if precision == "auto" else Precision(precision)


EXACT = Precision("exact")
FP8 = Precision("fp8")
"""The two precisions, checked."""


def check_fp8_k(k: int, name: str = "precision") -> None:
    """ValueError unless the reduction size ``k`` is a multiple of :data:`FP8_CHUNK` (what
    ``precision="fp8"`` needs: one activation scale per 128-wide k chunk)."""
    if k % FP8_CHUNK:
        raise ValueError(f"K={k}: {name}='fp8' needs K to be a multiple of {FP8_CHUNK} (one "
                         "activation scale per 128-wide k chunk)")


_warned_fallback = False
_PACKAGE_DIRS = tuple(os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep
                      for m in (sys.modules[__name__.split(".")[0]], jax))


def caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for a warning issued in the function calling this, of the
    first frame outside jax_nvfp4 and JAX: the user's line, however many wrappers (the autodiff
    rule, a jit trace) lie between."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class Backend(str):
    """A backend that :func:`resolve_backend` resolved, ``"ffi"`` or ``"reference"`` (equal to,
    and hashed as, its name): functions that receive one pass it on without resolving it again."""

    __slots__ = ()


FFI = Backend("ffi")
REFERENCE = Backend("reference")


def resolve_backend(backend) -> Backend:
    """The backend a call runs, ``"ffi"`` or ``"reference"`` as a :class:`Backend`, for the
    option ``backend`` (a Backend already is one: returned as it is).

    ``"ffi"`` without a built extension is a RuntimeError saying why; ``"auto"`` falls back to the
    reference (with a one-time RuntimeWarning) where the custom call cannot run: no extension, or
    a GPU default backend with an extension built without the CUDA handler."""
    global _warned_fallback
    if isinstance(backend, Backend):
        return backend
    check_choice(backend, BACKENDS, "backend")
    if backend != "auto":
        if backend == "ffi" and not _extension.available():
            raise RuntimeError(f"backend='ffi': {_extension.not_built_message()}")
        return FFI if backend == "ffi" else REFERENCE
    on_gpu = jax.default_backend() == "gpu"
    if _extension.available() and (not on_gpu or _extension.has_cuda()):
        return FFI
    if not _warned_fallback:
        _warned_fallback = True
        why = (_extension.no_cuda_message() if _extension.available()
               else _extension.not_built_message())
        warnings.warn(f"jax_nvfp4: grouped_gemm falls back to the pure-jnp reference (slow): {why}",
                      RuntimeWarning, stacklevel=caller_stacklevel())
    return REFERENCE
