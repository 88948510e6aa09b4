"""Types of the compiled extension ``jax_nvfp4._jax_nvfp4`` (ffi/module.cc; tests/test_kernel_config.py
checks that this stub names exactly the module's functions)."""

from typing import Any, TypedDict

class _Family(TypedDict):
    name: str
    code: int
    mode: str
    layouts: tuple[str, ...]
    archs: str
    file: str
    token_tiles: tuple[int, ...]
    summary: str

_Config = tuple[str, int, int, int, int]  # (family, token_tile, stages, cluster, raster)

def cpu_registrations() -> dict[str, Any]:
    """{target name: the CPU handler's capsule}."""

def cuda_registrations() -> dict[str, Any]:
    """{target name: the CUDA handler's capsule} (empty without the CUDA handler)."""

def family_codes() -> dict[str, int]: ...
def fp8_families() -> list[str]: ...
def layout_codes() -> dict[str, int]: ...
def kernel_families() -> list[_Family]: ...
def weight_shifts() -> dict[str, int]: ...
def interface_version() -> int: ...
def built_with_cuda() -> bool: ...
def cuda_off_reason() -> str:
    """Why the CUDA handler was left out of this build (empty when it was built)."""
def source_dir() -> str:
    """The source folder that was built."""
def cuda_compiler_source() -> str:
    """Where the build's nvcc came from: 'path', 'wheels' (NVIDIA's wheels), '' without CUDA."""
def built_against_jaxlib() -> str:
    """The jaxlib whose XLA FFI headers the handlers were compiled against."""
def xla_ffi_api_version() -> tuple[int, int]:
    """(major, minor) of the XLA FFI API the handlers declare."""
def cuda_targets() -> str: ...
def workspace_bytes(g: int, cpu_row_bytes: int) -> int: ...
def kernel_configs() -> list[_Config]: ...
def runnable_families(arch: int) -> list[str]: ...
def config_for_family(family: str, m: int, n: int, k: int, g: int, rows_hint: int, a_fp4: bool,
                      rhs_layout: int, fp8: bool = False) -> _Config | None: ...
def choose_kernel(arch: int, m: int, n: int, k: int, g: int, rows_hint: int, a_fp4: bool,
                  rhs_layout: int, families: int = -1, fp8: bool = False) -> _Config: ...
