"""The ops and their custom calls (layer 3): the grouped GEMM and its fused SwiGLU (:mod:`.gemm`,
with the argument checks and group arithmetic every backend shares in :mod:`.gemm_args`), the FP8
mode's operands (:mod:`.fp8`), the pure-jnp definitions every custom call is tested against
(:mod:`.reference`), their derivatives (:mod:`.autodiff`), the layer's row dispatch
(:mod:`.dispatch`), ``ragged_dot`` (:mod:`.ragged`) and ``prepare_weights`` (:mod:`.prepare`)."""
