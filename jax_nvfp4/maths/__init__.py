"""The formats' maths (layer 1): the NVFP4 tensor and its byte layouts, quantization and
dequantization, the fp8-prepared operand types and their k orders, scale swizzling, row gathers as
words, shard_map result types, and qwix NVFP4 arrays to and from ours. Pure jnp: nothing here calls
the compiled extension or reads an option, and every op above builds on these definitions
(:mod:`.formats`, :mod:`.layout`, :mod:`.quantization`, :mod:`.swizzle`, :mod:`.rows`,
:mod:`.varying`, :mod:`.qwix_interop`)."""
