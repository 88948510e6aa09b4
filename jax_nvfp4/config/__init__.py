"""The options (layer 2): every option's vocabulary and its one check (:mod:`.options`), the
kernel heuristic's choice as typed custom-call attributes (:mod:`.kernel_config`), the layer's
configuration and weights (:mod:`.moe_params`: ``MoEConfig``, ``MoEWeights``) and a Hugging Face
``config.json`` read into the layer's option fields (:mod:`.hf_config`). Options are checked once,
where they enter the public API, and passed down as checked values."""
