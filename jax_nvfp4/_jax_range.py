"""The jax versions this package supports, and the checks that refuse others before anything is
registered with JAX.

Two things can go wrong, and both would otherwise break every JAX computation of the process
(a handler XLA refuses fails the backend's initialization, not only our calls):

- a jax older than the supported range (its APIs differ; pip keeps it out unless forced);
- handlers compiled against the XLA FFI headers of a newer jaxlib than the running one: XLA
  registers handlers that declare its own FFI API version or an older one, never a newer one.
  The build compiles against the oldest supported jaxlib (pyproject.toml's build requirements),
  so this happens only with a build made otherwise (``--no-build-isolation`` in an environment
  with a newer jax, then a downgrade).

Both raise an ImportError naming the versions, at ``import jax_nvfp4``, with JAX left usable.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from typing import Optional

import jax

JAX_MIN = (0, 10, 0)
"""The oldest supported jax (pyproject.toml's ``jax>=0.10.0,<0.13``)."""
JAX_BELOW = (0, 13)
"""The first jax release series not supported (not yet tested)."""
SUPPORTED = f">={'.'.join(map(str, JAX_MIN))},<{'.'.join(map(str, JAX_BELOW))}"
"""The range as a requirement specifier: ``">=0.10.0,<0.13"``."""


def version_tuple(version: str) -> tuple:
    """The leading numeric components of a version string: ``"0.12.0.1"`` -> ``(0, 12, 0, 1)``,
    ``"0.13.0.dev20261201"`` -> ``(0, 13, 0)``."""
    parts = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(parts)


def _fix_command() -> str:
    return f'pip install "jax{SUPPORTED}"'


def check_jax(version: Optional[str] = None) -> None:
    """ImportError unless ``version`` (default: the running jax's) is at least :data:`JAX_MIN`.

    A newer jax than the range passes: XLA keeps registering handlers of older FFI API versions.
    """
    version = jax.__version__ if version is None else version
    if version_tuple(version) < JAX_MIN:
        raise ImportError(
            f"jax_nvfp4 needs jax {SUPPORTED}; the installed jax is {version}. Nothing was "
            f"registered with JAX, which stays usable. Fix: {_fix_command()}")


def framework_ffi_api_version() -> Optional[tuple]:
    """``(major, minor)`` of the XLA FFI API of the installed jaxlib, read from the headers it
    ships (``jaxlib/include/xla/ffi/api/c_api.h``, the ones its XLA was built with), or None when
    they cannot be read. Located, not imported: no backend starts."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    header = os.path.join(list(spec.submodule_search_locations)[0], "include", "xla", "ffi", "api",
                          "c_api.h")
    try:
        with open(header, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    major = re.search(r"^#define XLA_FFI_API_MAJOR (\d+)", text, re.M)
    minor = re.search(r"^#define XLA_FFI_API_MINOR (\d+)", text, re.M)
    if major is None or minor is None:
        return None
    return int(major.group(1)), int(minor.group(1))


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_ffi_api(handlers: tuple, built_with: str, source: str = "<jax_nvfp4 source folder>",
                  framework: Optional[tuple] = None) -> None:
    """ImportError if XLA would refuse handlers declaring FFI API version ``handlers``
    (``(major, minor)``, compiled against jaxlib ``built_with``'s headers, from the source folder
    ``source``): another major version, or a newer minor one than ``framework`` (default: the
    installed jaxlib's). Passes when the installed jaxlib's version cannot be read (XLA then
    decides at registration)."""
    framework = framework_ffi_api_version() if framework is None else framework
    if framework is None:
        return
    h, f = tuple(handlers), tuple(framework)
    if h[0] == f[0] and h[1] <= f[1]:
        return
    raise ImportError(
        f"jax_nvfp4's compiled extension was built against the XLA FFI headers of jaxlib "
        f"{built_with} (FFI API {h[0]}.{h[1]}); the installed jax {jax.__version__} (jaxlib "
        f"{_jaxlib_version()}) has FFI API {f[0]}.{f[1]} and would refuse its handlers, failing "
        "every JAX computation of this process. Nothing was registered with JAX, which stays "
        "usable. Fix: rebuild jax_nvfp4 with pip's build isolation (the default: it compiles "
        "against the oldest supported jaxlib): pip install --force-reinstall --no-deps "
        f"{source}, or install a jax of FFI API "
        f"{h[0]}.{h[1]} or newer ({_fix_command()})")


check_jax()
