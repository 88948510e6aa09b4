"""``jax.export`` support: the library's pytree types serialize, and :func:`export_checks` lists
its custom calls for ``jax.export.export(..., disabled_checks=...)``.

Importing ``jax_nvfp4`` registers the pytree serializations (this module) and the custom calls
(:mod:`jax_nvfp4._extension`), so a process that imports it deserializes and runs an exported
artifact with nothing else written by hand::

    exp = jax.export.export(jax.jit(f), disabled_checks=jn.export_checks())(x_spec, weights)
    blob = exp.serialize()
    ...                                  # another process: import jax_nvfp4
    y = jax.export.deserialize(blob).call(x, weights)

The custom-call targets carry the interface version (``jax_nvfp4_grouped_gemm_v3``,
:data:`jax_nvfp4._extension.ABI_VERSION`): an artifact that calls another version's targets fails
to compile, naming the target, rather than running a handler on arguments it does not expect.
"""

from __future__ import annotations

import json

import jax

from .. import _extension
from ..maths.formats import Fp8Rows, Fp8Weights, NVFP4Tensor
from ..config.moe_params import MoEWeights
from ..ops.ragged import RaggedRhs

_PREFIX = "jax_nvfp4."


def export_checks() -> list:
    """The ``disabled_checks`` that let ``jax.export.export`` serialize this library's custom calls.

    ``jax.export`` refuses custom calls it does not know to be stable unless each target is listed;
    these are the library's targets (:data:`jax_nvfp4._extension.TARGETS`, plus any other target
    the compiled extension registers).

    Returns:
      list of ``jax.export.DisabledSafetyCheck.custom_call(name)``, one per target.
    """
    names = set(_extension.TARGETS)
    ext = _extension.load()
    if ext is not None:
        names |= set(ext.cpu_registrations()) | set(ext.cuda_registrations())
    return [jax.export.DisabledSafetyCheck.custom_call(n) for n in sorted(names)]


def _str_codec(name: str, nodetype: type) -> None:
    """Auxdata that is one str (a layout, a k order)."""
    jax.export.register_pytree_node_serialization(
        nodetype, serialized_name=_PREFIX + name,
        serialize_auxdata=lambda aux: aux.encode("utf-8"),
        deserialize_auxdata=lambda b: b.decode("utf-8"))


def _json_codec(name: str, nodetype: type, to_json, from_json) -> None:
    jax.export.register_pytree_node_serialization(
        nodetype, serialized_name=_PREFIX + name,
        serialize_auxdata=lambda aux: json.dumps(to_json(aux)).encode("utf-8"),
        deserialize_auxdata=lambda b: from_json(json.loads(b.decode("utf-8"))))


def _moe_meta_to_json(aux):
    # register_dataclass's auxdata: the static fields in declaration order (expert_ids, w13_paired)
    expert_ids, paired = aux
    return [None if expert_ids is None else list(expert_ids), bool(paired)]


def _moe_meta_from_json(v):
    expert_ids, paired = v
    return (None if expert_ids is None else tuple(expert_ids), bool(paired))


_str_codec("NVFP4Tensor", NVFP4Tensor)
_str_codec("Fp8Rows", Fp8Rows)
_json_codec("Fp8Weights", Fp8Weights, lambda aux: None, lambda v: None)
_json_codec("MoEWeights", MoEWeights, _moe_meta_to_json, _moe_meta_from_json)
_json_codec("RaggedRhs", RaggedRhs, lambda aux: None, lambda v: None)
