"""The MoE layer's median ms through the public API only, so that two builds of jax_nvfp4 (say the
tree an issue's baseline was measured on and today's) can be timed in one device call, alternated:

    PYTHONPATH=/tmp/old_site python3 -P tools/lab/layer_versions.py --label old --json old.json
    python3 -P tools/lab/layer_versions.py --label new --json new.json

bench_layer's per-GPU V4-Pro shard (48 experts, top-6, H 7168, I 3072, no shared expert), random
NVFP4 weights in the sm90 layout (``prepare_weights``), bf16 tokens, real routing from the random
router (``--precision fp8``: the FP8 mode, weights in the checkpoint layout, which its kernel
reads); uses only ``MoEConfig.deepseek_v4_pro``, ``bench_ep.random_layer``, ``prepare_weights`` and
``moe``, which every build since 2026-11-30 has, and that build's own ``time_ms`` and
``random_layer`` (``bench_common``, or ``bench`` and ``bench_ep`` before it).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import jax_nvfp4
try:
    from jax_nvfp4.bench.common import random_layer, time_ms
except ImportError:   # builds before bench_common (the same weights: bench_common's are bit-identical)
    from jax_nvfp4.bench.gemm import time_ms
    from jax_nvfp4.bench.ep import random_layer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default=jax_nvfp4.__file__)
    ap.add_argument("--tokens", default="32,256,1024,4096")
    ap.add_argument("--activations", default="w4a4,w4a16")
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--precision", choices=("exact", "fp8"), default="exact")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = []
    for act in a.activations.split(","):
        cfg = jax_nvfp4.MoEConfig.deepseek_v4_pro(num_experts=a.experts, n_shared_experts=0,
                                                  activation=act, hidden_size=a.hidden,
                                                  intermediate_size=a.inter, precision=a.precision)
        w = random_layer(cfg, seed=0)
        w = w if a.precision == "fp8" else jax_nvfp4.prepare_weights(w)
        f = jax.jit(lambda x, w, cfg=cfg: jax_nvfp4.moe(x, w, cfg))
        for t in (int(v) for v in a.tokens.split(",")):
            x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.bfloat16)
            ms = time_ms(f, x, w)
            rows.append({"label": a.label, "precision": a.precision, "activation": act,
                         "tokens": t, "layer_ms": ms})
            print(f"{a.label} {a.precision} {act} {t} tokens: {ms:.4f} ms", flush=True)
        del w
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
