"""Which CUDA kernel configuration runs a grouped GEMM: the typed configuration the custom call carries.

The configurations and the heuristic that picks one live in the extension's C++ contract
(``csrc/kernel_table.h``: ``kKernelConfigs``, ``ChooseKernelConfig``); this module calls them at
trace time, with the device's compute capability, and turns the result into the custom call's
attributes (``kernel``, ``token_tile``, ``stages``, ``cluster``, ``raster``: visible in the lowered
program).
Families (docs/design.md describes each kernel):

* ``"mma"``: mma.sync with a cp.async pipeline; every GPU from compute capability 8.0 (A100, L40S,
  RTX 4090, H100/H200, B200, RTX 50xx). Also the only kernel that reads packed e2m1 activations.
* ``"mma_ws"``: its warp-specialized variant (bulk copies, mbarriers), for decode-sized batches with
  ``layout="sm90"`` weights; compute capability 9.0 only.
* ``"wgmma"``: Hopper's wgmma, persistent and warp-specialized, for 16 rows per expert and more;
  compute capability 9.0 only; bf16 activations, K a multiple of 64.
* ``"wgmma_fp8"``: the FP8 mode (``precision="fp8"``): e4m3 wgmma with the weights rounded to e4m3
  in registers; compute capability 9.0 only; K a multiple of 128, checkpoint-layout weights.
* ``"wgmma_fp8_prepared"``: the FP8 mode on weights prepared once as e4m3 (layout ``"fp8"``,
  :class:`~jax_nvfp4.maths.formats.Fp8Weights`): both operands loaded by TMA, e4m3 wgmma; compute
  capability 9.0 only; K a multiple of 128.
* ``"cutlass_fp8"``: the FP8 mode on fp8-prepared weights on CUTLASS's SM90 grouped GEMM with
  blockwise scaling (its collective builders; 128-token cooperative or 64-token ping-pong tiles);
  compute capability 9.0 only; K a multiple of 128, N a multiple of 8.
  The three FP8 families compute that mode and nothing else; the weights' layout decides between
  ``wgmma_fp8`` (checkpoint layout) and the other two (layout ``"fp8"``), the heuristic between those.

``grouped_gemm(..., kernel=...)`` takes a family name (its token tile then follows the heuristic's
rule for that family) or a :class:`KernelConfig` from :func:`kernel_configs`. The environment
variable ``JAX_NVFP4_KERNEL`` (a family name) overrides the heuristic when ``kernel`` is not given;
where that family does not handle a problem, the heuristic's choice runs instead.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from .. import _extension
from .options import FAMILIES, FAMILY_CODES, FP8_FAMILIES, LAYOUT_CODES, check_precision


def _is_fp8(precision) -> bool:
    return check_precision(precision) == "fp8"


def _layout_code(rhs_layout) -> int:
    if rhs_layout not in LAYOUT_CODES:
        raise ValueError(f"rhs_layout: expected one of {tuple(LAYOUT_CODES)}, got {rhs_layout!r}")
    return LAYOUT_CODES[rhs_layout]


ENV_OVERRIDE = "JAX_NVFP4_KERNEL"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compiled kernel configuration (an entry of :func:`kernel_configs`).

    Attributes:
      family: one of :data:`FAMILIES`.
      token_tile: rows of one group per CTA tile.
      stages: pipeline depth.
      cluster: CTAs per cluster (2 for the 256-token wgmma tile; cutlass_fp8: along N).
      raster: cutlass_fp8's tile order (0 CUTLASS's heuristic, 1 along M, 2 along N); 0 elsewhere.
    """

    family: str
    token_tile: int
    stages: int
    cluster: int = 1
    raster: int = 0

    def attributes(self) -> dict:
        """The custom call's typed attributes for this configuration (int32 scalars)."""
        return {"kernel": np.int32(FAMILY_CODES[self.family]), "token_tile": np.int32(self.token_tile),
                "stages": np.int32(self.stages), "cluster": np.int32(self.cluster),
                "raster": np.int32(self.raster)}


def _ext():
    ext = _extension.load()
    if ext is None:
        raise RuntimeError("jax_nvfp4: the compiled extension is not built; kernel configurations need it")
    return ext


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel family, as the extension's C++ table (``kFamilyTable``, csrc/kernel_table.h) states it.

    Attributes:
      name: one of :data:`FAMILIES`; code: the custom call's ``kernel`` attribute.
      mode: ``"exact"`` or ``"fp8"`` (the ``precision`` it computes, and nothing else).
      layouts: the weight layouts it reads (``"checkpoint"``, ``"sm90"``, ``"fp8"``).
      archs: where it runs (``"sm_80 and newer"``, or ``"sm_90 (sm_90a image)"``).
      file: its kernel's source file; token_tiles: those of its compiled configurations.
      summary: what it is, in a few words.
    """

    name: str
    code: int
    mode: str
    layouts: tuple[str, ...]
    archs: str
    file: str
    token_tiles: tuple[int, ...]
    summary: str


def family_table() -> tuple[Family, ...]:
    """Every kernel family, in code order: the one table of their facts, from the extension."""
    return tuple(Family(**d) for d in _ext().kernel_families())


def kernel_configs() -> tuple[KernelConfig, ...]:
    """Every configuration the CUDA kernels are compiled for (the same table in every build)."""
    return tuple(KernelConfig(*c) for c in _ext().kernel_configs())


def device_arch(device=None) -> int:
    """Compute capability of ``device`` (default: the default backend's first device) as
    ``10 * major + minor`` (90 for an H100/H200), or 0 for a device that is not a CUDA GPU."""
    if device is None:
        device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not cc:
        return 0
    major, minor = (int(x) for x in str(cc).split(".")[:2])
    return 10 * major + minor


def runnable_families(arch: int) -> tuple[str, ...]:
    """The families this build of the extension runs on compute capability ``arch``."""
    return tuple(_ext().runnable_families(int(arch)))


def choose(m: int, n: int, k: int, groups: int, *, rows_hint: int = 0, w4a4: bool = False,
           rhs_layout: str = "checkpoint", arch: int | None = None,
           families: tuple[str, ...] | None = None, precision: str = "exact") -> KernelConfig:
    """The heuristic's configuration for a problem (the extension's ``ChooseKernelConfig``).

    Args:
      m, n, k, groups: lhs rows, output columns, reduction size, number of groups (experts).
      rows_hint: expected rows inside the groups (0: ``m``).
      w4a4: packed e2m1 activations reach the kernel (native W4A4).
      rhs_layout: "checkpoint", "sm90" or "fp8" (weights prepared as e4m3; the FP8 mode only).
      arch: compute capability as ``10 * major + minor`` (default: :func:`device_arch`).
      families: the families the device may run (default: those this build runs on ``arch``).
      precision: "exact" or "fp8" (the FP8 mode's family follows the weights' layout:
        ``wgmma_fp8_prepared`` for "fp8", ``wgmma_fp8`` otherwise).
    """
    fp8 = _is_fp8(precision)
    if arch is None:
        arch = device_arch()
    if families is not None and not set(families) <= set(FAMILIES):
        raise ValueError(f"families: expected names from {FAMILIES}, got {families!r}")
    mask = -1 if families is None else sum(1 << FAMILY_CODES[f] for f in families)
    return KernelConfig(*_ext().choose_kernel(int(arch), int(m), int(n), int(k), int(groups), int(rows_hint),
                                              bool(w4a4), _layout_code(rhs_layout), mask, fp8))


def for_family(family: str, m: int, n: int, k: int, groups: int, *, rows_hint: int = 0, w4a4: bool = False,
               rhs_layout: str = "checkpoint", precision: str = "exact") -> KernelConfig | None:
    """``family``'s configuration for a problem (its token-tile rule), or None where that family
    does not handle it (wgmma: packed activations or K % 64 != 0; mma_ws: not sm90 weights;
    wgmma_fp8: not the FP8 mode, K % 128 != 0 or not checkpoint weights; wgmma_fp8_prepared: not
    the FP8 mode or not fp8-prepared weights; the exact families: the FP8 mode)."""
    fp8 = _is_fp8(precision)
    if family not in FAMILIES:
        raise ValueError(f"kernel: expected one of {FAMILIES} or a KernelConfig, got {family!r}")
    c = _ext().config_for_family(family, int(m), int(n), int(k), int(groups), int(rows_hint), bool(w4a4),
                                 _layout_code(rhs_layout), fp8)
    return None if c is None else KernelConfig(*c)


def requested_family(kernel) -> str | KernelConfig | None:
    """The caller's kernel request: the argument, else the ``JAX_NVFP4_KERNEL`` override, else None.
    Raises ValueError for an unknown family name or configuration."""
    if kernel is None:
        env = os.environ.get(ENV_OVERRIDE)
        if not env:
            return None
        if env not in FAMILIES:
            raise ValueError(f"{ENV_OVERRIDE}: expected one of {FAMILIES}, got {env!r}")
        return env
    if isinstance(kernel, KernelConfig):
        if kernel not in kernel_configs():
            raise ValueError(f"kernel: {kernel} is not a compiled configuration; jax_nvfp4.config.kernel_config."
                             f"kernel_configs() lists them")
        return kernel
    if isinstance(kernel, str) and kernel in FAMILIES:
        return kernel
    raise ValueError(f"kernel: expected one of {FAMILIES}, a KernelConfig or None, got {kernel!r}")


def resolve(kernel, m: int, n: int, k: int, groups: int, *, rows_hint: int = 0, w4a4: bool = False,
            rhs_layout: str = "checkpoint", precision: str = "exact") -> KernelConfig:
    """The configuration a call runs: an explicit KernelConfig as given (ValueError when its family
    does not compute ``precision``); an explicit family at its token-tile rule (ValueError where it
    does not handle the problem); the ``JAX_NVFP4_KERNEL`` family likewise, falling back to the
    heuristic; else the heuristic."""
    fp8 = _is_fp8(precision)
    from_env = kernel is None
    req = requested_family(kernel)
    if isinstance(req, KernelConfig):
        if (req.family in FP8_FAMILIES) != fp8:
            raise ValueError(f"kernel: {req} does not compute precision={precision!r} "
                             f"({' and '.join(FP8_FAMILIES)} compute the FP8 mode, the other "
                             "families the exact mode)")
        if fp8 and (req.family != "wgmma_fp8") != (rhs_layout == "fp8"):
            raise ValueError(f"kernel: {req} does not read {rhs_layout!r} weights "
                             "(wgmma_fp8_prepared and cutlass_fp8 read weights prepared by "
                             "prepare_weights(w, 'fp8'), wgmma_fp8 checkpoint-layout NVFP4)")
        return req
    shape: dict[str, Any] = dict(rows_hint=rows_hint, w4a4=w4a4, rhs_layout=rhs_layout, precision=precision)
    if req is not None:
        c = for_family(req, m, n, k, groups, **shape)
        if c is not None:
            return c
        if not from_env:
            raise ValueError(f"kernel: the {req!r} kernel does not handle this problem (K={k}, "
                             f"{'W4A4' if w4a4 else 'W4A16'}, rhs layout {rhs_layout!r}, precision "
                             f"{precision!r}); wgmma needs bf16 activations and K % 64 == 0, mma_ws sm90 "
                             "weights and bf16 activations, wgmma_fp8 the FP8 mode with K % 128 == 0 and "
                             "checkpoint weights, wgmma_fp8_prepared the FP8 mode with fp8-prepared "
                             "weights, cutlass_fp8 that and N % 8 == 0; the exact families do not "
                             "compute the FP8 mode")
    return choose(m, n, k, groups, **shape)
