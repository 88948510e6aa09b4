"""PyTorch's grouped GEMMs as peers of :mod:`jax_nvfp4.bench.gemm` (rows ``torch_fp8_grouped`` and
``torch_bf16_grouped``), on the bench's skewed group sizes.

torch is never a dependency of jax_nvfp4: it is imported inside :func:`torch_or_reason`, and
where it does not import or has no CUDA device the rows are skipped with the reason printed.

Calling conventions (PyTorch 2.9-2.11, ``aten/src/ATen/native/cuda/GroupedBlas.cpp``,
``GroupedMMUtils.h``), the "2d x 3d" MoE case, groups along the rows of ``mat_a``:

- ``torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs,
  out_dtype=torch.bfloat16, use_fast_accum=False)``: ``mat_a`` float8_e4m3fn ``[M, K]``
  row-major; ``mat_b`` float8_e4m3fn ``[G, K, N]`` column-major (a contiguous ``[G, N, K]``
  transposed: ``w.transpose(-2, -1)``); ``scale_a`` float32 ``[M]`` (one per row of
  ``mat_a``), ``scale_b`` float32 ``[G, N]`` (one per output column and group): row-wise
  scales, ``out[m, n] = scale_a[m] * scale_b[g, n] * sum_k a[m, k] b[g, k, n]``; ``offs`` int32
  ``[G]``, the cumulative group ends (``cumsum(sizes)``); K and N multiples of 16; bf16 output
  only; sm90/sm100 only. Group sizes need no padding in this case (each group's rows start at
  ``a + offs[g - 1] * K``, 16-byte aligned since K % 16 == 0; the multiple-of-16 rule of
  torchao's MoE training is for the K-grouped "2d x 2d" backward and the MX formats); should a
  build refuse them, :func:`torch_fp8_fn` retries with each group padded to a multiple of 16
  rows and says so in the row's ``config``.
- ``torch._grouped_mm(mat_a, mat_b, offs=offs)``: bf16 ``mat_a`` ``[M, K]``, ``mat_b``
  ``[G, K, N]`` (row- or column-major, 16-byte aligned strides), same ``offs``; output in
  ``mat_a``'s dtype (bf16).

``use_fast_accum=False``: the CUTLASS kernel promotes its accumulators to float32 in the
mainloop, as the fp8 mode of jax_nvfp4 does every 128 k (fast accumulation would skip that).

Timing (:func:`time_ms_torch`) mirrors :func:`jax_nvfp4.bench.common.time_ms`: a warm-up call,
one timed call to pick n (3 to 50) calls per sample of about ``target_s``, then ``repeats``
samples of n back-to-back calls between two ``torch.cuda.Event`` records; the median ms per call.
The operands are moved from JAX through host numpy once per case, outside the timing; the timed
call is the grouped GEMM alone (operands already e4m3 for the fp8 one: no activation
quantization, unlike the bench's jax_nvfp4 rows).
"""

from __future__ import annotations

import statistics

import jax
import numpy as np

from jax_nvfp4.bench.common import rowwise_e4m3

TORCH_IMPLS = ("torch_fp8_grouped", "torch_bf16_grouped")
FP8_WEIGHT_FACTOR = 8.0
"""Value of a weight prepared for the fp8 mode: ``code * 2^3 * global_scale``
(:class:`jax_nvfp4.Fp8Weights`); the torch peer folds ``2^3 * global_scale`` into ``scale_b``."""


def torch_or_reason():
    """``(torch, None)`` where torch imports and has a CUDA device, else ``(None, reason)``."""
    try:
        import torch  # noqa: PLC0415 - optional peer, never a dependency
    except Exception as e:  # noqa: BLE001 - any import failure means: no torch peer
        return None, f"torch does not import ({type(e).__name__}: {e})"
    try:
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} has no CUDA device"
    except Exception as e:  # noqa: BLE001
        return None, f"torch.cuda: {type(e).__name__}: {e}"
    for name in ("_scaled_grouped_mm", "_grouped_mm"):
        if not hasattr(torch, name):
            return None, f"torch {torch.__version__} has no torch.{name}"
    return torch, None


def to_torch(torch, a, device="cuda"):
    """A numpy array (float8_e4m3fn, bfloat16, float32, int32: ml_dtypes types included) on
    ``device`` as a torch tensor of the same dtype and shape: through a same-width integer view,
    since ``torch.from_numpy`` does not know ml_dtypes' float8 and bfloat16."""
    a = np.ascontiguousarray(a)
    name = str(a.dtype)
    if name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    return torch.from_numpy(a).to(device)


def padded_rows(sizes, multiple):
    """``(index, padded_sizes)``: for group sizes int ``[G]`` summing to R, each group padded to a
    multiple of ``multiple`` rows; ``index`` int64 ``[R]`` the padded position of each row
    (gather the real rows' outputs back with ``out[index]``)."""
    sizes = np.asarray(sizes, np.int64)
    padded = -(-sizes // multiple) * multiple
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    index = np.concatenate([s + np.arange(n) for s, n in zip(starts, sizes)] or [np.zeros(0)])
    return index.astype(np.int64), padded.astype(np.int32)


def offsets(torch, sizes, device="cuda"):
    """int32 ``[G]`` cumulative group ends on ``device`` (what ``offs`` means to torch)."""
    return to_torch(torch, np.cumsum(np.asarray(sizes, np.int64)).astype(np.int32), device)


def fp8_operands(x, w_codes, w_global_scale):
    """numpy operands of the fp8 peer: ``(a, scale_a, b, scale_b)``.

    ``x``: bf16 ``[R, K]`` tokens, quantized row-wise to e4m3
    (:func:`jax_nvfp4.bench.common.rowwise_e4m3`).
    ``w_codes``: float8_e4m3fn ``[G, N, K]`` in the logical k order
    (:meth:`jax_nvfp4.Fp8Weights.logical_codes`); ``w_global_scale`` float32 ``[G]`` or
    ``[G, 2]`` (halves of N). ``scale_b`` float32 ``[G, N]`` = ``2^3 * global scale``, so that
    the product is the fp8-prepared weights' value.
    """
    a, scale_a = (np.asarray(v) for v in jax.jit(rowwise_e4m3)(x))
    b = np.asarray(w_codes)
    g, n, _ = b.shape
    gs = np.asarray(w_global_scale, np.float32).reshape(g, -1)
    scale_b = np.repeat(gs, n // gs.shape[1], axis=1) * np.float32(FP8_WEIGHT_FACTOR)
    return a, scale_a, b, np.ascontiguousarray(scale_b, np.float32)


def torch_fp8_fn(torch, a, scale_a, b, scale_b, sizes, log=print):
    """``(fn, config, index)``: a no-argument callable running ``torch._scaled_grouped_mm`` on
    the numpy operands of :func:`fp8_operands` (moved to the GPU here, once), a note for the JSON
    row, and None or, for padded groups, the torch int64 ``[R]`` rows of its output that hold the
    tokens (``fn()[index]``: bf16 ``[R, N]``; the gather is left out of the timed call). Tries the
    group sizes as they are, then, if torch refuses them, each group padded to a multiple of 16
    rows (zero rows, scale 1)."""
    dev_b = to_torch(torch, b).transpose(-2, -1)          # [G, K, N] column-major
    dev_sb = to_torch(torch, scale_b)

    def call(dev_a, dev_sa, offs):
        return lambda: torch._scaled_grouped_mm(dev_a, dev_b, dev_sa, dev_sb, offs=offs,
                                                out_dtype=torch.bfloat16, use_fast_accum=False)

    run = call(to_torch(torch, a), to_torch(torch, scale_a), offsets(torch, sizes))
    try:
        run()
        torch.cuda.synchronize()
        return run, "row-wise scales, use_fast_accum=False", None
    except Exception as e:  # noqa: BLE001 - retry with padded groups (a refusal raises at once)
        log(f"  torch_fp8_grouped on unpadded groups: {type(e).__name__}: {str(e)[:300]}; "
            "retrying with each group padded to a multiple of 16 rows")
    index, psizes = padded_rows(sizes, 16)
    pa = np.zeros((int(psizes.sum()), a.shape[1]), a.dtype)
    pa[index] = a
    psa = np.ones(int(psizes.sum()), np.float32)
    psa[index] = scale_a
    run = call(to_torch(torch, pa), to_torch(torch, psa), offsets(torch, psizes))
    config = "row-wise scales, use_fast_accum=False, groups padded to multiples of 16 rows"
    return run, config, to_torch(torch, index)


def torch_bf16_fn(torch, x, wb, sizes):
    """A no-argument callable running ``torch._grouped_mm`` on bf16 ``x`` ``[R, K]`` and bf16
    weights ``wb`` ``[G, K, N]`` (row-major; numpy, moved to the GPU here, once): bf16
    ``[R, N]``."""
    dev_x, dev_w, offs = to_torch(torch, x), to_torch(torch, wb), offsets(torch, sizes)
    return lambda: torch._grouped_mm(dev_x, dev_w, offs=offs)


def time_ms_torch(torch, f, target_s=0.25, repeats=5):
    """Median ms per call of ``f()`` by CUDA events, as :func:`jax_nvfp4.bench.common.time_ms`
    times JAX: warm up, pick n calls per sample of about ``target_s`` (3 to 50), ``repeats``
    samples of n back-to-back calls."""
    f()                                                   # warm up (autotuning, allocations)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    end.record()
    end.synchronize()
    one_s = start.elapsed_time(end) / 1e3
    n = int(min(50, max(3, target_s / max(one_s, 1e-6))))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(n):
            f()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / n)
    return statistics.median(samples)


def torch_peers(x, rhs_fp8, wb, sizes, impls, log=print, **timing):
    """Time the torch rows of ``impls`` on one case: ``{impl: (ms, config, out)}`` (``out``:
    float32 numpy ``[R, N]``, for ``--check``). ``x`` bf16 ``[R, K]``, ``rhs_fp8`` the
    :class:`jax_nvfp4.Fp8Weights` ``[G, N, K]``, ``wb`` bf16 ``[G, K, N]``, ``sizes`` int32
    ``[G]``. Rows that cannot run are skipped with the reason logged (torch missing, no CUDA
    device, or any torch error on that row): never an exception."""
    want = [i for i in TORCH_IMPLS if i in impls]
    if not want:
        return {}
    torch, reason = torch_or_reason()
    if torch is None:
        for impl in want:
            log(f"  {impl} skipped: {reason}")
        return {}
    results = {}
    for impl in want:
        try:
            if impl == "torch_fp8_grouped":
                ops = fp8_operands(x, rhs_fp8.logical_codes(), rhs_fp8.global_scale)
                f, config, index = torch_fp8_fn(torch, *ops, np.asarray(sizes), log=log)
            else:
                f, config, index = (torch_bf16_fn(torch, np.asarray(x), np.asarray(wb),
                                                  np.asarray(sizes)), "", None)
            ms = time_ms_torch(torch, f, **timing)
            out = f() if index is None else f()[index]
            out = out.float().cpu().numpy()
            results[impl] = (ms, config, out)
        except Exception as e:  # noqa: BLE001 - one peer's failure never stops the benchmark
            log(f"  {impl} skipped: {type(e).__name__}: {str(e)[:300]}")
        finally:
            f = index = None                              # this row's GPU tensors: freed
            try:
                torch.cuda.empty_cache()                  # for JAX and the next row
            except Exception:  # noqa: BLE001 - e.g. a sticky CUDA error, logged above
                pass
    return results
