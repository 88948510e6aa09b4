"""The Mixture-of-Experts layer (layer 4): routing (:mod:`.routing`), the layer itself (:mod:`.moe`:
router, dispatch, gate/up GEMM, SwiGLU, requantization, down GEMM, combine), expert parallelism
under ``shard_map`` with the combine as a ``psum`` (:mod:`.sharding`), and ``jax.export`` support
for the layer's pytree types and custom calls (:mod:`.export`)."""
