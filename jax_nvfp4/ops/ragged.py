"""``ragged_dot`` with ``jax.lax.ragged_dot``'s signature on NVFP4 weights: code written against
ragged_dot (MaxText's MoE block, tokamax's ``ragged_dot(..., implementation=...)``) runs the grouped
NVFP4 GEMM with one changed line.

The rhs is ragged_dot's ``[G, K, N]`` with NVFP4 blocks along K: a qwix NVFP4 ``QArray`` (tiled
along K), or :class:`RaggedRhs`, a view of the library's ``NVFP4Tensor [G, N, K]`` with that
shape (no data moves: NVFP4 stores K last). :func:`ragged_rhs` makes one, once, from either.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..maths import qwix_interop
from ..maths.formats import NVFP4Tensor
from .gemm import grouped_gemm

DEFAULT_DIMENSION_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
"""``[M, K] x [G, K, N] -> [M, N]``, groups along M (``jax.lax.ragged_dot``'s)."""
TRANSPOSED_RHS_DIMENSION_NUMBERS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
"""``[M, K] x [G, N, K] -> [M, N]``: the rhs K-last, as an ``NVFP4Tensor`` stores it."""


class Unsupported(NotImplementedError, ValueError):
    """A call :func:`ragged_dot` does not compute (argument named in the message). A
    NotImplementedError, so that tokamax tries its next implementation, and a ValueError."""


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class RaggedRhs:
    """NVFP4 weights as ragged_dot's rhs: shape ``[G, K, N]``, blocks along K.

    Attributes:
      tensor: the :class:`NVFP4Tensor` ``[G, N, K]`` (either layout) it views.
    """

    tensor: NVFP4Tensor

    def tree_flatten(self):
        return (self.tensor,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, int, int]:
        g, n, k = self.tensor.shape
        return (g, k, n)

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self):
        """bfloat16: the type the weights compute in (e2m1 x e4m3 is exact in it)."""
        return jnp.dtype(jnp.bfloat16)


def ragged_rhs(w) -> RaggedRhs:
    """ragged_dot's rhs ``[G, K, N]`` from NVFP4 weights, converted once.

    Args:
      w: :class:`NVFP4Tensor` ``[G, N, K]`` (the grouped GEMM's rhs, K last), a qwix NVFP4
        ``QArray`` ``[G, K, N]`` tiled along K (converted by
        :func:`jax_nvfp4.maths.qwix_interop.from_qwix`), or a :class:`RaggedRhs` (returned as is).

    Returns:
      :class:`RaggedRhs` of shape ``[G, K, N]``.
    """
    if isinstance(w, RaggedRhs):
        return w
    if qwix_interop.is_qwix_array(w):
        w = _from_qwix(w, 1, "[G, K, N]")
    if not isinstance(w, NVFP4Tensor) or w.ndim != 3:
        raise ValueError(f"w: expected an NVFP4Tensor [G, N, K] or a qwix NVFP4 QArray "
                         f"[G, K, N], got {type(w).__name__} {getattr(w, 'shape', '')}")
    return RaggedRhs(w.validate("w"))


def _from_qwix(q, k_axis: int, want: str) -> NVFP4Tensor:
    """A 3-D qwix NVFP4 QArray tiled along ``k_axis`` (K's place in ``want``), converted; the
    tiled axis is checked itself, not the converted shape (equal either way when N == K)."""
    t = qwix_interop.from_qwix(q, name="rhs")          # its own checks first
    qs, ss = tuple(q.qvalue.shape), tuple(q.scale.shape)
    if len(qs) != 3 or qwix_interop._tiled_axis(qs, ss, "rhs") != k_axis:
        raise Unsupported(f"rhs: expected a qwix NVFP4 QArray {want} tiled along K (axis "
                          f"{k_axis}), got qvalue {qs} with scale {ss}")
    return t


def _rhs_tensor(rhs, dims) -> NVFP4Tensor:
    """The grouped GEMM's ``[G, N, K]`` NVFP4Tensor for ``rhs`` under dimension numbers ``dims``."""
    if dims == DEFAULT_DIMENSION_NUMBERS:
        if isinstance(rhs, RaggedRhs):
            return rhs.tensor
        if isinstance(rhs, NVFP4Tensor):
            raise Unsupported("rhs: an NVFP4Tensor is [G, N, K] (K last), ragged_dot's rhs "
                              "[G, K, N]: pass jax_nvfp4.ragged_rhs(rhs) (a view, no copy), or "
                              "ragged_dot_dimension_numbers=TRANSPOSED_RHS_DIMENSION_NUMBERS")
        if qwix_interop.is_qwix_array(rhs):
            return _from_qwix(rhs, 1, "[G, K, N]")
    elif dims == TRANSPOSED_RHS_DIMENSION_NUMBERS:
        if isinstance(rhs, NVFP4Tensor):
            return rhs
        if qwix_interop.is_qwix_array(rhs):
            return _from_qwix(rhs, 2, "[G, N, K]")
    else:
        raise Unsupported(f"ragged_dot_dimension_numbers: expected [M, K] x [G, K, N] (or the "
                          f"rhs transposed, [G, N, K]) with groups along M, got {dims}")
    raise Unsupported(f"rhs: expected NVFP4 weights (jax_nvfp4.ragged_rhs(w), or a qwix NVFP4 "
                      f"QArray), got {type(rhs).__name__}; other weights are not computed here")


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None, *, ragged_dot_dimension_numbers=None, activation=None,
               backend: str = "auto"):
    """``jax.lax.ragged_dot`` on NVFP4 weights: ``[M, K] x [G, K, N] -> [M, N]``, the rows of
    group g (consecutive, in group order) times weight g; rows past the groups are 0.

    The same signature as ``jax.lax.ragged_dot`` (and ``tokamax.ragged_dot``'s implementation
    callables: ``ragged_dot_dimension_numbers``, ``activation``), so
    ``tokamax.ragged_dot(x, w, gs, implementation=(jax_nvfp4.ragged_dot,))`` runs it; calls it does
    not compute raise :class:`Unsupported` (a NotImplementedError: tokamax then tries the next
    implementation of a sequence).

    Args:
      lhs: bfloat16 ``[M, K]`` (the exact W4A16 GEMM), or an ``NVFP4Tensor [M, K]`` (W4A4).
      rhs: ``[G, K, N]``, NVFP4 blocks along K: :class:`RaggedRhs` (:func:`ragged_rhs`) or a qwix
        NVFP4 ``QArray`` (converted on each call: convert once with :func:`ragged_rhs`). With
        ``ragged_dot_dimension_numbers`` = :data:`TRANSPOSED_RHS_DIMENSION_NUMBERS`: ``[G, N, K]``,
        an ``NVFP4Tensor`` or a QArray tiled along its last axis.
      group_sizes: int ``[G]`` (or a tokamax ``GroupSizes``: its ``value``).
      precision: accepted for the signature; no effect (every product is exact in float32, which
        accumulates).
      preferred_element_type: None (lhs's dtype, as ``jax.lax.ragged_dot``), bfloat16 or float32.
      group_offset: None only.
      ragged_dot_dimension_numbers: None, :data:`DEFAULT_DIMENSION_NUMBERS` or
        :data:`TRANSPOSED_RHS_DIMENSION_NUMBERS`.
      activation: optional function applied to the float32 result before the cast to the output
        type (tokamax's fused activation), to every row.
      backend: as for :func:`jax_nvfp4.grouped_gemm`.

    Returns:
      ``[M, N]`` in ``preferred_element_type``: :func:`jax_nvfp4.grouped_gemm` of lhs and the
      weights (equal to ``jax.lax.ragged_dot`` of lhs and the dequantized weights up to float32
      summation order).
    """
    dims = DEFAULT_DIMENSION_NUMBERS if ragged_dot_dimension_numbers is None \
        else ragged_dot_dimension_numbers
    if group_offset is not None:
        raise Unsupported("group_offset: only None is supported")
    w = _rhs_tensor(rhs, dims)
    if isinstance(lhs, NVFP4Tensor):
        lhs_dtype = jnp.dtype(jnp.bfloat16)
    else:
        lhs = jnp.asarray(lhs)
        lhs_dtype = jnp.dtype(lhs.dtype)
        if lhs_dtype != jnp.bfloat16:
            raise Unsupported(f"lhs: expected bfloat16 [M, K] (or an NVFP4Tensor), got "
                              f"{lhs_dtype} {list(lhs.shape)}; cast it to bfloat16")
    out = jnp.dtype(lhs_dtype if preferred_element_type is None else preferred_element_type)
    if out not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise Unsupported(f"preferred_element_type: expected None, bfloat16 or float32, got {out}")
    gs = getattr(group_sizes, "value", group_sizes)                 # tokamax GroupSizes
    if activation is None:
        return grouped_gemm(lhs, w, gs, out_dtype=out, backend=backend)
    y = grouped_gemm(lhs, w, gs, out_dtype=jnp.float32, backend=backend)
    return activation(y).astype(out)
