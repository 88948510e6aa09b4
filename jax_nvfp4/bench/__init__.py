"""The benchmarks: the package's users, not part of it. Nothing in ``jax_nvfp4`` imports this
subpackage (tests/test_bench.py checks it); each module uses the public API only.

    python -m jax_nvfp4.bench           the grouped GEMM against its peers (:mod:`.gemm`)
    python -m jax_nvfp4.bench.layer     the MoE layer against its two GEMMs (:mod:`.layer`)
    python -m jax_nvfp4.bench.ep        the expert-parallel layer on the devices present (:mod:`.ep`)

:mod:`.common` holds what they share (timer, run description, random weights),
:mod:`.torch_peers` PyTorch's grouped GEMMs as peers of the GEMM benchmark.
"""
