"""shard_map's varying manual axes (vma) of arrays, for the custom calls' result types.

Inside ``jax.shard_map`` every value carries the mesh axes along which it varies; a custom call's
results must declare theirs (the union of its operands'), else JAX rejects the call under
``check_vma``. Outside shard_map (or on a JAX without vma) the set is empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def varying_axes(a) -> frozenset:
    """The manual mesh axes (inside ``jax.shard_map``) along which ``a``'s type says it varies."""
    aval = jax.typeof(a)
    if hasattr(aval, "manual_axis_type"):          # jax >= 0.10
        return frozenset(aval.manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", ()))      # older spelling


def varying_type(args, shape, dtype):
    """An ffi_call result type carrying the union of the inputs' varying manual axes.

    Inside ``shard_map`` a bare ShapeDtypeStruct is typed invariant, and ``out_specs=P()`` would
    then silently return one shard's values (jax_ffi notes, section 2). Summing one element of
    each input gives a scalar whose type has the union of their axes; its type is updated to
    the result's shape and dtype.
    """
    probe = sum(jnp.sum(a.reshape(-1)[:1].astype(jnp.float32)) for a in args)
    aval = jax.typeof(probe)
    base = jax.typeof(jnp.zeros((), jnp.float32)).update(shape=shape, dtype=jnp.dtype(dtype))
    if hasattr(aval, "manual_axis_type"):          # jax >= 0.10
        return base.update_manual_axis_type(aval.manual_axis_type)
    return base.update(vma=aval.vma)               # older spelling
