"""Where each gradient sits in the packed output of RLX's ``GatedDeltaNetBackward``.

This mirrors ``GdnBackwardLayout`` in rlx-ir's ``src/gdn.rs``: the same fields, the same
quantities under the same names, computed with Python integers so that they are exact at any
size. The Rust side computes in ``usize``; a configuration whose arithmetic would overflow it
(where a debug build of rlx-ir panics) is refused here rather than given a number Rust cannot
agree with.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from ._dtypes import resolve

if TYPE_CHECKING:
    from ._picture import Picture

__all__ = ["GRADIENT_NAMES", "GdnBackwardLayout", "Segment"]

#: ``usize::MAX + 1`` on the 64-bit targets RLX runs on.
_USIZE_LIMIT = 1 << 64

_DIMS = ("batch", "seq", "heads", "state_size")
_FLAGS = ("gate_per_channel", "carry_state")
#: Every gradient's name, in packing order; ``dstate`` is packed only when the state is carried.
GRADIENT_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dstate")


class Segment(NamedTuple):
    """One gradient's place in the packed buffer: ``flat[offset : offset + length]``."""

    name: str
    offset: int
    length: int
    shape: tuple[int, ...]


def _dimension(name: str, value: object) -> int:
    # bool is an int subclass, and operator.index accepts NumPy integers: refuse the first,
    # keep the second, and reject everything that is not an integer at all.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a non-negative integer, got bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be a non-negative integer, got {type(value).__name__} {value!r}"
        ) from None
    if index < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {index}")
    if index >= _USIZE_LIMIT:
        raise ValueError(f"{name} must fit in a 64-bit usize, got {index}")
    return index


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _usize_product(*factors: int) -> int:
    """Multiply left to right as Rust does, failing where a debug build would panic."""
    product = 1
    for factor in factors:
        product *= factor
        if product >= _USIZE_LIMIT:
            raise OverflowError
    return product


def _usize_sum(*terms: int) -> int:
    total = sum(terms)
    if total >= _USIZE_LIMIT:
        raise OverflowError
    return total


@dataclass(frozen=True)
class GdnBackwardLayout:
    """The packed-gradient layout of ``GatedDeltaNetBackward``, equal to rlx-ir's.

    The packed buffer holds ``dq, dk, dv, dg, dbeta`` and, with ``carry_state``, ``dstate``,
    each flattened in C order and concatenated in that order.

    >>> layout = GdnBackwardLayout(batch=2, seq=3, heads=4, state_size=8)
    >>> layout.total_elems
    624
    >>> layout.slices()
    [(0, 192), (192, 192), (384, 192), (576, 24), (600, 24)]
    >>> layout.shape("dg")
    (2, 3, 4)
    """

    batch: int
    seq: int
    heads: int
    state_size: int
    gate_per_channel: bool = False
    carry_state: bool = False
    # Derived once, so that unpack and pack on a hot path do no arithmetic.
    _segments: tuple[Segment, ...] = field(init=False, repr=False, compare=False)
    _cuts: tuple[tuple[slice, tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)
    _total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _DIMS:
            object.__setattr__(self, name, _dimension(name, getattr(self, name)))
        for name in _FLAGS:
            object.__setattr__(self, name, _flag(name, getattr(self, name)))
        try:
            segments = self._compute_segments()
        except OverflowError:
            raise ValueError(
                f"{self!r} does not fit in a 64-bit usize: its element counts or offsets "
                "overflow, and rlx-ir's arithmetic would panic"
            ) from None
        object.__setattr__(self, "_segments", segments)
        cuts = tuple((slice(seg.offset, seg.offset + seg.length), seg.shape) for seg in segments)
        object.__setattr__(self, "_cuts", cuts)
        object.__setattr__(self, "_total", segments[-1].offset + segments[-1].length)

    def _compute_segments(self) -> tuple[Segment, ...]:
        b, s, h, n = self.batch, self.seq, self.heads, self.state_size
        # Each product in the order gdn.rs evaluates it, so intermediate overflow is caught too.
        qkv = _usize_product(b, s, h, n)
        bsh = _usize_product(b, s, h)
        gate = qkv if self.gate_per_channel else bsh
        offsets = [0, qkv, _usize_product(2, qkv), _usize_product(3, qkv)]
        offsets.append(_usize_sum(offsets[3], gate))
        offsets.append(_usize_sum(offsets[4], bsh))
        state = _usize_product(b, h, n, n) if self.carry_state else 0
        _usize_sum(offsets[5], state)
        gate_shape = (b, s, h, n) if self.gate_per_channel else (b, s, h)
        shapes = [(b, s, h, n)] * 3 + [gate_shape, (b, s, h), (b, h, n, n)]
        lengths = [qkv, qkv, qkv, gate, bsh, state]
        count = 6 if self.carry_state else 5
        return tuple(
            Segment(GRADIENT_NAMES[i], offsets[i], lengths[i], shapes[i]) for i in range(count)
        )

    # -- the Rust quantities, by their Rust names -------------------------------------------

    @property
    def qkv_elems(self) -> int:
        """Elements in one of ``q``/``k``/``v``/``dy``: ``[B, S, H, N]``."""
        return self._segments[0].length

    @property
    def beta_elems(self) -> int:
        """Elements in ``beta``: ``[B, S, H]``."""
        return self._segments[4].length

    @property
    def gate_elems(self) -> int:
        """Elements in ``g``: ``[B, S, H, N]`` per channel, else ``[B, S, H]``."""
        return self._segments[3].length

    @property
    def state_elems(self) -> int:
        """Elements in the carried state ``[B, H, N, N]``; zero when it is not carried."""
        return self._segments[5].length if self.carry_state else 0

    @property
    def dq_offset(self) -> int:
        return 0

    @property
    def dk_offset(self) -> int:
        return self._segments[1].offset

    @property
    def dv_offset(self) -> int:
        return self._segments[2].offset

    @property
    def dg_offset(self) -> int:
        return self._segments[3].offset

    @property
    def dbeta_offset(self) -> int:
        return self._segments[4].offset

    @property
    def dstate_offset(self) -> int:
        """Where ``dstate`` starts; as in Rust, defined (as the end of ``dbeta``) even when
        the state is not carried."""
        beta = self._segments[4]
        return beta.offset + beta.length

    @property
    def total_elems(self) -> int:
        """Length of the packed buffer."""
        return self._total

    def slices(self) -> list[tuple[int, int]]:
        """``(offset, length)`` for each gradient in packing order, as rlx-ir's ``slices()``."""
        return [(seg.offset, seg.length) for seg in self._segments]

    # -- beyond Rust ----------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """The gradient names in packing order: ``dq, dk, dv, dg, dbeta`` (and ``dstate``)."""
        return GRADIENT_NAMES[: len(self._segments)]

    def segments(self) -> tuple[Segment, ...]:
        """One :class:`Segment` ``(name, offset, length, shape)`` per gradient, in order."""
        return self._segments

    def segment(self, name: str) -> Segment:
        """The :class:`Segment` of the gradient called ``name``."""
        for seg in self._segments:
            if seg.name == name:
                return seg
        raise KeyError(f"no gradient {name!r} in this layout; it has {', '.join(self.names)}")

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the gradient called ``name`` (``"dq"``, ..., ``"dstate"``)."""
        return self.segment(name).shape

    def nbytes(self, dtype: DTypeLike) -> int:
        """Bytes of a packed buffer of this layout in ``dtype``.

        >>> GdnBackwardLayout(2, 3, 4, 8).nbytes("float32")
        2496
        """
        return self.total_elems * resolve(dtype, "nbytes: dtype").itemsize

    def __str__(self) -> str:
        """The layout table: name, shape, offset, length and float32 bytes of each gradient."""
        from ._render import layout_text  # deferred: _render builds on this module

        return layout_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        from ._render import layout_html

        return layout_html(self)

    def to_dict(self) -> dict[str, int | bool]:
        """The six fields as a JSON-safe dict; :meth:`from_dict` reads it back."""
        return {name: getattr(self, name) for name in _DIMS + _FLAGS}

    @classmethod
    def from_dict(cls, data: Any) -> GdnBackwardLayout:
        """A layout from :meth:`to_dict`'s output, validated like the constructor.

        >>> layout = GdnBackwardLayout(2, 3, 4, 8, carry_state=True)
        >>> GdnBackwardLayout.from_dict(layout.to_dict()) == layout
        True
        """
        if not isinstance(data, dict):
            raise TypeError(f"layout data must be a dict, got {type(data).__name__}")
        expected = set(_DIMS + _FLAGS)
        missing = [key for key in _DIMS if key not in data]
        unknown = sorted(str(key) for key in data if key not in expected)
        if missing or unknown:
            raise ValueError(
                f"layout data must have the keys {', '.join(_DIMS)} (and optionally "
                f"{', '.join(_FLAGS)}); missing {missing}, unknown {unknown}"
            )
        return cls(**data)

    @classmethod
    def from_inputs(cls, q: Any, g: Any, state: Any = None) -> GdnBackwardLayout:
        """The layout of the backward of a forward called with ``q``, ``g`` and ``state``.

        ``q`` gives ``[B, S, H, N]``; ``g``'s rank gives the gate mode; a ``state`` that is
        not None means it is carried. Arrays or plain shapes are accepted.

        >>> layout = GdnBackwardLayout.from_inputs(q=(1, 16, 2, 4), g=(1, 16, 2), state=None)
        >>> layout.gate_per_channel, layout.carry_state, layout.total_elems
        (False, False, 448)
        """
        return cls._infer(("q", q), ("g", g), ("state", state))

    @classmethod
    def from_grads(
        cls, dq: Any, dk: Any, dv: Any, dg: Any, dbeta: Any, dstate: Any = None
    ) -> GdnBackwardLayout:
        """The layout that packs these gradients (arrays or shapes); every shape is checked."""
        layout = cls._infer(("dq", dq), ("dg", dg), ("dstate", dstate))
        for name, grad in zip(("dk", "dv", "dbeta"), (dk, dv, dbeta), strict=True):
            _check_shape(name, _shape_of(name, grad), layout.shape(name), layout)
        return layout

    @classmethod
    def _infer(
        cls, first: tuple[str, Any], gate: tuple[str, Any], state: tuple[str, Any]
    ) -> GdnBackwardLayout:
        first_shape = _shape_of(*first)
        if len(first_shape) != 4:
            raise ValueError(
                f"{first[0]} must have 4 dimensions [B, S, H, N], got shape {first_shape}"
            )
        gate_shape = _shape_of(*gate)
        if len(gate_shape) not in (3, 4):
            raise ValueError(
                f"{gate[0]} must have shape [B, S, H] or [B, S, H, N], got {gate_shape}"
            )
        layout = cls(
            *first_shape, gate_per_channel=len(gate_shape) == 4, carry_state=state[1] is not None
        )
        _check_shape(gate[0], gate_shape, layout.shape("dg"), layout)
        if state[1] is not None:
            _check_shape(state[0], _shape_of(*state), layout.shape("dstate"), layout)
        return layout

    def plot(
        self, *, dtype: DTypeLike = np.float32, path: str | os.PathLike[str] | None = None
    ) -> Picture:
        """:func:`gdn_layout.plot.plot_layout` of this layout: the packed buffer as a bar.

        Needs ``gdn-layout[plot]``; a notebook displays the returned picture.
        """
        from .plot import plot_layout  # deferred: plot builds on this module

        return plot_layout(self, dtype=dtype, path=path)


def _not_a_layout(value: object, where: str = "") -> TypeError:
    """The error for a ``layout`` argument that is not a :class:`GdnBackwardLayout`."""
    prefix = f"{where}: " if where else ""
    return TypeError(f"{prefix}layout must be a GdnBackwardLayout, got {type(value).__name__}")


def _shape_of(name: str, value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    try:
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"{name} must be an array or a shape, got {type(value).__name__}") from None


def _check_shape(
    name: str, received: tuple[int, ...], expected: tuple[int, ...], layout: GdnBackwardLayout
) -> None:
    if received != expected:
        raise ValueError(f"{name} has shape {received}, expected {expected} for {layout!r}")
