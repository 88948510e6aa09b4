"""``python -m jax_nvfp4.bench``: the grouped GEMM benchmark (:mod:`jax_nvfp4.bench.gemm`)."""

from jax_nvfp4.bench.gemm import main

main()
