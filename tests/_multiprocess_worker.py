"""Worker for the multi-process expert-parallel test (tests/test_sharding.py).

Run as ``python _multiprocess_worker.py --process-id I --num-processes 2 --port P --out DIR``.
Each process gets ``--local-devices`` CPU devices, joins ``jax.distributed`` on localhost, builds
the same layer from a fixed seed (:func:`make_case`), runs :func:`jax_nvfp4.moe_expert_parallel`
on the global mesh (psum and psum_scatter, for each ``--backend``) and writes the rows it can
see to ``DIR/process_I.npz``, next to the single-device :func:`jax_nvfp4.moe` answer computed
locally. Failures are written to ``DIR/process_I.error`` (the test reads it to tell "no CPU
collectives" apart from a real bug).

Importable without side effects: the test process uses :func:`make_case` to build the same
inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

SEED = 20260517
E, H, I, T, TOP_K = 16, 128, 64, 32, 4


def make_case(seed: int = SEED):
    """A small V4-style layer (router bias, shared expert, SwiGLU limit) and float32 tokens."""
    import numpy as np  # noqa: PLC0415

    import jax_nvfp4 as jn  # noqa: PLC0415

    r = np.random.default_rng(seed)
    cfg = jn.MoEConfig(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                       routed_scaling_factor=2.5, swiglu_limit=10.0, n_shared_experts=1,
                       activation="w4a4")
    weights = jn.quantize_moe(
        r.normal(size=(E, H)).astype(np.float32) * 0.3,
        r.normal(size=(E, 2 * I, H)).astype(np.float32) * 0.08,
        r.normal(size=(E, H, I)).astype(np.float32) * 0.08,
        router_bias=r.normal(size=(E,)).astype(np.float32) * 0.05,
        shared_w13=r.normal(size=(2 * I, H)).astype(np.float32) * 0.08,
        shared_w2=r.normal(size=(H, I)).astype(np.float32) * 0.08)
    x = r.normal(size=(T, H)).astype(np.float32)
    return cfg, weights, x


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--local-devices", type=int, default=4)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", action="append", default=None)
    args = ap.parse_args(argv)
    backends = args.backend or ["ffi"]
    pid = args.process_id
    err_path = os.path.join(args.out, f"process_{pid}.error")

    # The parent (pytest) exported --xla_force_host_platform_device_count=8: replace it.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={args.local_devices}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"

    try:
        import numpy as np  # noqa: PLC0415

        import jax  # noqa: PLC0415
        try:
            jax.config.update("jax_num_cpu_devices", args.local_devices)
        except (AttributeError, RuntimeError):
            pass
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError) as e:  # option missing in this jax
            print(f"worker {pid}: no gloo option ({e})", file=sys.stderr)
        jax.distributed.initialize(coordinator_address=f"localhost:{args.port}",
                                   num_processes=args.num_processes, process_id=pid,
                                   initialization_timeout=90)
        from jax.sharding import NamedSharding  # noqa: PLC0415
        from jax.sharding import PartitionSpec as P  # noqa: PLC0415

        import jax_nvfp4 as jn  # noqa: PLC0415

        n = args.num_processes * args.local_devices
        assert jax.device_count() == n, (jax.device_count(), n)
        assert jax.local_device_count() == args.local_devices
        cfg, weights, x_np = make_case()

        results = {"device_count": np.int32(jax.device_count()),
                   "process_count": np.int32(jax.process_count())}
        # The single-device answer, on this process's first device.
        local0 = jax.local_devices()[0]
        w_local = jax.device_put(weights, local0)
        x_local = jax.device_put(x_np, local0)
        for b in backends:
            results[f"single_{b}"] = np.asarray(
                jax.jit(lambda x, w, b=b: jn.moe(x, w, cfg, backend=b))(x_local, w_local))

        mesh = jax.make_mesh((n,), ("ep",))                # every device of every process
        ws = jn.shard_moe_weights(jax.tree.map(np.asarray, weights), mesh)
        xg = jax.device_put(x_np, NamedSharding(mesh, P()))
        for b in backends:
            # both combines in one jit: one compile per backend (each output has its sharding)
            outs = jax.jit(lambda x, w, b=b: {c: jn.moe_expert_parallel(
                x, w, cfg, mesh, combine=c, backend=b) for c in ("psum", "psum_scatter")})(xg, ws)
            for combine in ("psum", "psum_scatter"):
                out = outs[combine]
                rows, vals = [], []
                for shard in out.addressable_shards:      # the rows this process holds
                    idx = np.arange(x_np.shape[0])[shard.index[0]]
                    rows.append(idx)
                    vals.append(np.asarray(shard.data))
                results[f"ep_{b}_{combine}_rows"] = np.concatenate(rows)
                results[f"ep_{b}_{combine}"] = np.concatenate(vals)
        np.savez(os.path.join(args.out, f"process_{pid}.npz"), **results)
        jax.distributed.shutdown()
        return 0
    except BaseException:
        with open(err_path, "w") as fh:
            fh.write(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(_main())
