"""What the benchmarks (:mod:`jax_nvfp4.bench.gemm`, :mod:`jax_nvfp4.bench.ep`,
:mod:`jax_nvfp4.bench.layer`) share: the timer, the run's description (device, driver, jax) and
random NVFP4 layer weights. Built on the public API only (``import jax_nvfp4 as jn``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

import jax_nvfp4 as jn

EXPERTS_PER_CALL = 16
"""Experts :func:`random_layer` makes and quantizes per call of :func:`jax_nvfp4.quantize_moe`."""


def time_ms(f, *args, target_s=0.25, repeats=5, wait_each=False):
    """Median ms per call of ``f(*args)``: after a compile and warm-up call, ``repeats`` samples
    of n back-to-back calls with one block at the end (n chosen so that a sample takes about
    ``target_s``, 3 to 50 calls). ``wait_each`` blocks on every call instead (multi-device CPU
    runs: see :mod:`jax_nvfp4.bench.ep`)."""
    jax.block_until_ready(f(*args))                      # compile + warm up
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = time.perf_counter() - t0
    n = int(min(50, max(3, target_s / max(one, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = f(*args)
            if wait_each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(samples)


def rowwise_e4m3(x):
    """Row-wise e4m3 quantization of float ``x`` ``[..., K]``: ``(codes, scale)``,
    float8_e4m3fn ``[..., K]`` and float32 ``[...]`` with ``x ~= codes * scale[..., None]`` (each
    row's amax mapped to 448, e4m3's largest finite value; an all-zero row gets scale 1). The
    operands of the benchmarks' fp8 peers (cuBLAS through XLA, PyTorch); jittable."""
    x = jnp.asarray(x).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, initial=0.0)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def driver_version():
    """The NVIDIA driver version (one value: nvidia-smi prints a line per GPU), or None without
    nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    versions = sorted({v.strip() for v in out.splitlines() if v.strip()})
    return ", ".join(versions) or None


def run_info(device=None):
    """``{"gpu", "platform", "driver", "jax"}`` of a run on ``device`` (default: JAX's first):
    the header of every benchmark's JSON."""
    dev = device or jax.devices()[0]
    return {"gpu": dev.device_kind, "platform": dev.platform, "driver": driver_version(),
            "jax": jax.__version__}


def write_json(path, meta):
    """Write ``meta`` (a dict) as indented JSON to ``path``: to a temporary file beside it, then
    renamed over it, so that ``path`` always holds a whole JSON (a benchmark rewriting it as it
    goes may be stopped at any time)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(meta, fh, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _normal(key, shape, fan_in):
    """bf16 Gaussian with std ``fan_in ** -0.5``."""
    return (jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5).astype(jnp.bfloat16)


_EXPERT_FIELDS = ("router_weight", "router_bias", "w13", "w2")
"""The :class:`jax_nvfp4.MoEWeights` fields with a leading expert axis (joined over the calls)."""

_normal_jit = jax.jit(_normal, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _router(key_weight, key_bias, e, h):
    """float32 router weight ``[E, H]`` (std ``H ** -0.5``) and bias ``[E]`` (std 0.01)."""
    return (jax.random.normal(key_weight, (e, h), jnp.float32) * h ** -0.5,
            jax.random.normal(key_bias, (e,), jnp.float32) * 0.01)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _experts(keys, shape, fan_in):
    """bf16 ``[len(keys), *shape]``: one :func:`_normal` matrix per key."""
    return jax.vmap(lambda k: _normal(k, shape, fan_in))(keys)


def random_layer(config: jn.MoEConfig, seed: int = 0, device=None,
                 experts_per_call: int = EXPERTS_PER_CALL) -> jn.MoEWeights:
    """Random DeepSeek-style NVFP4 MoE weights in the checkpoint layout.

    Gaussian weights with std ``fan_in ** -0.5`` (bf16), quantized by
    :func:`jax_nvfp4.quantize_moe` ``experts_per_call`` experts at a time, so that only those
    experts' float weights exist at once (384 V4-Pro experts are 14 GB in NVFP4 but 51 GB in
    bf16); a float32 router ``[E, H]`` with std ``H ** -0.5`` and bias ``[E]`` with std 0.01;
    ``config.n_shared_experts`` shared experts of width I (one shared MLP, the same kind).
    Each expert has its own random key, so the weights do not depend on ``experts_per_call``.
    Placed on ``device`` (default: JAX's default device).
    """
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    si = i * config.n_shared_experts
    keys = jax.random.split(jax.random.key(seed), 7)
    with jax.default_device(device or jax.devices()[0]):
        w13_keys, w2_keys = jax.random.split(keys[1], e), jax.random.split(keys[2], e)
        router, bias = _router(keys[0], keys[3], e, h)
        shared = {} if not si else dict(shared_w13=_normal_jit(keys[4], (2 * si, h), h),
                                        shared_w2=_normal_jit(keys[5], (h, si), si))
        parts = []
        for a in range(0, e, experts_per_call):
            b = min(e, a + experts_per_call)
            parts.append(jn.quantize_moe(router[a:b], _experts(w13_keys[a:b], (2 * i, h), h),
                                         _experts(w2_keys[a:b], (h, i), i),
                                         router_bias=bias[a:b], **(shared if a == 0 else {})))
        concat = lambda f: jax.tree.map(lambda *v: jnp.concatenate(v),  # noqa: E731
                                        *(getattr(p, f) for p in parts))
        weights = dataclasses.replace(parts[0], **{f: concat(f) for f in _EXPERT_FIELDS})
    return weights
