"""Frozen storage of a :class:`jax_nvfp4.MoEWeights` for the framework modules (no framework).

:class:`FrozenMoEWeights` holds every array of the weights as its raw bits in an unsigned integer
dtype of the same width (float8 block scales as uint8, float32 router and global scales as
uint32; codes and hash tables as they are). Why:

* No framework's way of picking what trains selects integer arrays (``eqx.is_inexact_array``,
  ``jax.grad``), so an optimizer never moves them, not even by weight decay, and never keeps
  float8 moments whose ``eps`` underflows to NaN.
* Integer leaves round-trip bit for bit through every serializer (``np.save`` in Equinox's
  ``tree_serialise_leaves``, orbax, msgpack), float8 ones do not everywhere.
* The leaves' key paths name the byte layout of each NVFP4 tensor (``"w13.data@sm90-paired"``;
  weights prepared as e4m3 are ``"w13.codes@fp8"``),
  so a checkpoint of sm90-prepared weights restored into a target built from checkpoint-layout
  weights (or the reverse) is a key mismatch, not the wrong layout read silently: the layout is
  pytree metadata (static), which a restore takes from the target, not from the saved file.

:meth:`FrozenMoEWeights.weights` bit-casts back (free under ``jit``) to the exact arrays stored.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from ..maths.formats import Fp8Weights, NVFP4Tensor
from ..config.moe_params import MoEWeights
from ..maths.qwix_interop import weights_from_qwix

_ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(MoEWeights)
                      if not f.metadata.get("static"))
_NVFP4_FIELDS = ("w13", "w2", "shared_w13", "shared_w2")
_NVFP4_PARTS = ("data", "scales", "global_scale")
_FP8_PARTS = ("codes", "global_scale")          # Fp8Weights (layout "fp8")
_PAIRED_FIELDS = ("w13", "shared_w13")


def _bits_dtype(dtype) -> np.dtype:
    """The unsigned integer dtype of a float dtype's width; integer dtypes stay."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_:
        return dtype
    return np.dtype(f"uint{8 * dtype.itemsize}")


def _to_bits(v) -> jax.Array:
    v = jnp.asarray(v)
    bits = _bits_dtype(v.dtype)
    return v if v.dtype == bits else jax.lax.bitcast_convert_type(v, bits)


def _from_bits(bits, dtype: str):
    if bits.dtype == np.dtype(dtype):
        return bits
    return jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype))


def _parts(layout: str) -> tuple:
    return _FP8_PARTS if layout == Fp8Weights.layout else _NVFP4_PARTS


def _tensor_key(field: str, part: str, layout: str, paired: bool) -> str:
    tag = layout + ("-paired" if paired and field in _PAIRED_FIELDS else "")
    return f"{field}.{part}@{tag}"


@jax.tree_util.register_pytree_with_keys_class
class FrozenMoEWeights:
    """A :class:`jax_nvfp4.MoEWeights` stored as integer bits (module docstring: why).

    Build it with :meth:`freeze`; read the weights with :meth:`weights`. A pytree whose leaves are
    the integer arrays, keyed (``jax.tree_util.DictKey``) by field, part and, for NVFP4 tensors,
    the layout: ``"router_weight"``, ``"w13.data@checkpoint"``, ``"w13.scales@sm90-paired"``, ...
    The original dtypes, ``expert_ids``, ``w13_paired`` and the layouts are static metadata.
    """

    def __init__(self, bits: dict, meta: tuple):
        self.bits = bits    # key -> integer array (or whatever a tree_map put there)
        self.meta = meta    # (keys, original dtype names, expert_ids, w13_paired, layouts)

    @classmethod
    def freeze(cls, weights: MoEWeights) -> "FrozenMoEWeights":
        """Store ``weights`` (a :class:`jax_nvfp4.MoEWeights`; raises TypeError otherwise). Fields
        that are qwix NVFP4 ``QArray`` s (as :func:`jax_nvfp4.moe` takes them) are stored as
        their conversions (:func:`jax_nvfp4.maths.qwix_interop.weights_from_qwix`)."""
        if isinstance(weights, FrozenMoEWeights):
            return weights
        if not isinstance(weights, MoEWeights):
            raise TypeError(f"weights: expected a jax_nvfp4.MoEWeights, got "
                            f"{type(weights).__name__}")
        weights = weights_from_qwix(weights)
        bits, dtypes, layouts = {}, [], []
        for field in _ARRAY_FIELDS:
            value = getattr(weights, field)
            if value is None:
                continue
            if isinstance(value, (NVFP4Tensor, Fp8Weights)):
                layouts.append((field, value.layout))
                for part in _parts(value.layout):
                    key = _tensor_key(field, part, value.layout, weights.w13_paired)
                    bits[key] = _to_bits(getattr(value, part))
                    dtypes.append(str(jnp.asarray(getattr(value, part)).dtype))
            else:
                bits[field] = _to_bits(value)
                dtypes.append(str(jnp.asarray(value).dtype))
        meta = (tuple(bits), tuple(dtypes), weights.expert_ids, weights.w13_paired,
                tuple(layouts))
        return cls(bits, meta)

    def weights(self) -> MoEWeights:
        """The stored :class:`jax_nvfp4.MoEWeights`, bit for bit (arrays in their own dtypes)."""
        keys, dtypes, expert_ids, paired, layouts = self.meta
        values = {k: _from_bits(self.bits[k], d) for k, d in zip(keys, dtypes)}
        fields = {}
        for field, layout in layouts:
            parts = [values[_tensor_key(field, p, layout, paired)] for p in _parts(layout)]
            fields[field] = (Fp8Weights(*parts) if layout == Fp8Weights.layout
                             else NVFP4Tensor(*parts, layout=layout))
        fields.update((k, v) for k, v in values.items() if "." not in k)
        return MoEWeights(**fields, expert_ids=expert_ids, w13_paired=paired)

    @property
    def layouts(self) -> dict:
        """``{field: layout}`` of the weight tensors, e.g. ``{"w13": "sm90", "w2": "sm90"}``
        (``"fp8"`` for weights prepared as e4m3)."""
        return dict(self.meta[4])

    def tree_flatten_with_keys(self):
        keys = self.meta[0]
        return [(jax.tree_util.DictKey(k), self.bits[k]) for k in keys], self.meta

    def tree_flatten(self):
        return [self.bits[k] for k in self.meta[0]], self.meta

    @classmethod
    def tree_unflatten(cls, meta, children):
        return cls(dict(zip(meta[0], children)), meta)

    def __repr__(self) -> str:
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in self.bits.items()}
        return f"FrozenMoEWeights({shapes}, expert_ids={self.meta[2]}, w13_paired={self.meta[3]})"


def _meta_to_bytes(meta) -> bytes:
    keys, dtypes, expert_ids, paired, layouts = meta
    return json.dumps([list(keys), list(dtypes), None if expert_ids is None else list(expert_ids),
                       bool(paired), [list(p) for p in layouts]]).encode("utf-8")


def _meta_from_bytes(b: bytes):
    keys, dtypes, expert_ids, paired, layouts = json.loads(b.decode("utf-8"))
    return (tuple(keys), tuple(dtypes), None if expert_ids is None else tuple(expert_ids),
            bool(paired), tuple(tuple(p) for p in layouts))


# jax.export serializes the pytree structure of an exported function's arguments
# (jax_nvfp4.layer.export registers the core types)
jax.export.register_pytree_node_serialization(
    FrozenMoEWeights, serialized_name="jax_nvfp4.nn.FrozenMoEWeights",
    serialize_auxdata=_meta_to_bytes, deserialize_auxdata=_meta_from_bytes)
