"""Run by tests/test_jax_range.py in a fresh environment holding one built jax_nvfp4 wheel and one
jax of the supported range: the compiled extension registers on that jax, and a grouped GEMM and
the MoE layer run through the custom calls (backend="ffi", on the CPU) against the float64
oracles of tests/oracles.py (this file's folder is first on sys.path; the package is the
installed one). Prints one JSON line: the versions and the errors."""

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4 import _jax_range
from oracles import dequant64, grouped_gemm64, moe64, rel_err

info = jn.extension_info()
assert info.built and not info.source_tree, info
r = np.random.default_rng(0)

# W4A16 grouped GEMM: 3 groups, one empty, 8 rows past them (zeros); float32 out
w = r.standard_normal((3, 32, 64)).astype(np.float32)
rhs = jax.vmap(jn.quantize)(jnp.asarray(w))
x = jnp.asarray(r.standard_normal((40, 64)), jnp.bfloat16)
sizes = jnp.array([7, 0, 25], jnp.int32)
gemm = jax.jit(lambda x, s: jn.grouped_gemm(x, rhs, s, out_dtype=jnp.float32, backend="ffi"))
assert jn._extension.TARGET in gemm.lower(x, sizes).as_text(), "not the custom call"
out = gemm(x, sizes)
ref = grouped_gemm64(np.asarray(x, np.float64), dequant64(rhs.data, rhs.scales),
                     np.asarray(rhs.global_scale, np.float64), np.asarray(sizes))
gemm_err = rel_err(out, ref)
assert gemm_err <= 1e-5 and not np.asarray(out[32:]).any(), gemm_err  # tests/test_gemm.py F32_OUT_TOL

# the MoE layer, W4A4, a shared expert, jit with the weights as arguments
e, h, i, t = 4, 64, 32, 16
cfg = jn.MoEConfig(num_experts=e, top_k=2, hidden_size=h, intermediate_size=i, n_shared_experts=1,
                   swiglu_limit=10.0, activation="w4a4")
n = lambda *shape: (r.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
weights = jn.quantize_moe(n(e, h), n(e, 2 * i, h), n(e, h, i), shared_w13=n(2 * i, h),
                          shared_w2=n(h, i))
xs = r.standard_normal((t, h)).astype(np.float32)
layer = jax.jit(lambda x, w: jn.moe(x, w, cfg, backend="ffi"))
out = layer(jnp.asarray(xs), weights)
ref64, _ = moe64(xs, weights, cfg)
moe_err = rel_err(out, ref64)
assert moe_err <= 1e-3, moe_err  # tests/test_sharding.py ORACLE_TOL

print(json.dumps({
    "python": sys.version.split()[0], "jax": jax.__version__,
    "jaxlib_ffi_api": list(_jax_range.framework_ffi_api_version()),
    "handlers_ffi_api": list(info.xla_ffi_api), "built_against_jaxlib": info.built_against_jaxlib,
    "extension_sha256": hashlib.sha256(open(info.path, "rb").read()).hexdigest(),
    "gemm_rel_err": gemm_err, "moe_rel_err": moe_err}))
