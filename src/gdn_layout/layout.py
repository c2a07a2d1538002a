"""rlx-ir's ``GdnBackwardLayout`` (``src/gdn.rs``) in Python integers (README.md, *The layout*)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from ._checks import flag, integer, not_a_layout
from ._dtypes import dtype_name, itemsize
from ._tables import html_table, text_table

if TYPE_CHECKING:
    from ._picture import Picture

__all__ = [
    "GRADIENT_NAMES",
    "INPUT_NAMES",
    "GdnBackwardLayout",
    "LayoutRow",
    "Segment",
    "gradient_axes",
    "layout_caption",
    "layout_html",
    "layout_table",
    "layout_text",
]

_DIMS = ("batch", "seq", "heads", "state_size")
_FLAGS = ("gate_per_channel", "carry_state")
#: ``usize::MAX + 1`` on the 64-bit targets RLX runs on.
_USIZE_LIMIT = 1 << 64
#: Every gradient's name, in packing order; ``dstate`` is packed only when the state is carried.
GRADIENT_NAMES: Final = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
#: The op's inputs, the cotangent ``dy`` and the output ``y``, each with its gradient's shape.
INPUT_NAMES: Final = dict(
    q="dq", k="dk", v="dv", g="dg", beta="dbeta", state="dstate", dy="dv", y="dv"
)


class Segment(NamedTuple):
    """One gradient's place in the packed buffer: ``flat[offset : offset + length]``.

    >>> GdnBackwardLayout(1, 2, 3, 4, carry_state=True).segment("dstate").axes
    ('b', 'h', 'i', 'j')
    """

    name: str
    offset: int
    length: int
    shape: tuple[int, ...]

    @property
    def axes(self) -> tuple[str, ...]:
        """Each axis's name (``i``, ``j``: key row, value column of ``dstate``)."""
        return gradient_axes(self.name, len(self.shape))


def gradient_axes(name: str, ndim: int) -> tuple[str, ...]:
    """The axis names of the gradient (or fixture state: ``h``, ``dh``, ``final_state``)
    ``name`` with ``ndim`` axes; ``c`` is the chunk."""
    if name in ("h", "dh"):
        return ("b", "c", "h", "i", "j")
    if name in ("dstate", "final_state"):
        return ("b", "h", "i", "j")
    return ("b", "s", "h", "n")[:ndim]


def gradient_shapes(
    b: int, s: int, h: int, n: int, per_channel: bool, carry: bool
) -> tuple[tuple[int, ...], ...]:
    """The gradients' shapes in packing order, ``dstate`` only when the state is carried."""
    state = ((b, h, n, n),) if carry else ()
    return ((b, s, h, n),) * 3 + ((b, s, h, n) if per_channel else (b, s, h), (b, s, h), *state)


@dataclass(frozen=True)
class GdnBackwardLayout:
    """The packed-gradient layout of ``GatedDeltaNetBackward``, equal to rlx-ir's.

    ``dq, dk, dv, dg, dbeta`` and, with ``carry_state``, ``dstate``, each flattened in C order,
    concatenated; the Rust quantities are read-only properties of the Rust names. A
    configuration whose ``usize`` arithmetic would overflow is a ValueError.

    >>> layout = GdnBackwardLayout(batch=2, seq=3, heads=4, state_size=8)
    >>> layout.total_elems, layout.slices()[3:], layout.shape("dg")
    (624, [(576, 24), (600, 24)], (2, 3, 4))
    """

    batch: int
    seq: int
    heads: int
    state_size: int
    gate_per_channel: bool = False
    carry_state: bool = False

    def __post_init__(self) -> None:
        for name in _DIMS:
            value = integer(getattr(self, name), name)
            if value >= _USIZE_LIMIT:
                raise ValueError(f"{name} must fit in a 64-bit usize, got {value}")
            object.__setattr__(self, name, value)
        for name in _FLAGS:
            object.__setattr__(self, name, flag(name, getattr(self, name)))
        # Rust's usize arithmetic panics where any partial product or sum overflows, even
        # when a later factor is 0: each is at most one of these.
        b, s, h, n = self.batch, self.seq, self.heads, self.state_size
        partials = (b * s, b * s * h, 3 * b * s * h * n, self.total_elems)
        if max(partials + ((b * h, b * h * n) if self.carry_state else ())) >= _USIZE_LIMIT:
            raise ValueError(
                f"{self!r} does not fit in a 64-bit usize: its element counts or offsets "
                "overflow, and rlx-ir's arithmetic would panic"
            )

    # The Rust quantities, as gdn.rs computes them; cached, not fields (equality, repr and
    # asdict see the six fields only).

    @cached_property
    def qkv_elems(self) -> int:
        return self.batch * self.seq * self.heads * self.state_size

    @cached_property
    def beta_elems(self) -> int:
        return self.batch * self.seq * self.heads

    @cached_property
    def gate_elems(self) -> int:
        return self.qkv_elems if self.gate_per_channel else self.beta_elems

    @cached_property
    def state_elems(self) -> int:  # 0 when the state is not carried
        return self.batch * self.heads * self.state_size**2 if self.carry_state else 0

    @cached_property
    def dq_offset(self) -> int:
        return 0

    @cached_property
    def dk_offset(self) -> int:
        return self.qkv_elems

    @cached_property
    def dv_offset(self) -> int:
        return 2 * self.qkv_elems

    @cached_property
    def dg_offset(self) -> int:
        return 3 * self.qkv_elems

    @cached_property
    def dbeta_offset(self) -> int:
        return self.dg_offset + self.gate_elems

    @cached_property
    def dstate_offset(self) -> int:  # as in Rust, the end of dbeta even when not carried
        return self.dbeta_offset + self.beta_elems

    @cached_property
    def total_elems(self) -> int:
        return self.dstate_offset + self.state_elems

    def slices(self) -> list[tuple[int, int]]:
        """``(offset, length)`` for each gradient in packing order, as rlx-ir's ``slices()``."""
        return [(seg.offset, seg.length) for seg in self._segments]

    @cached_property
    def _segments(self) -> tuple[Segment, ...]:
        dims = (self.batch, self.seq, self.heads, self.state_size)
        shapes = gradient_shapes(*dims, self.gate_per_channel, self.carry_state)
        q, gate, beta, state = self.qkv_elems, self.gate_elems, self.beta_elems, self.state_elems
        lengths = (q, q, q, gate, beta, state)
        offsets = (0, q, 2 * q, 3 * q, self.dbeta_offset, self.dstate_offset)
        # zip stops at the shapes: no dstate segment when the state is not carried
        return tuple(map(Segment, GRADIENT_NAMES, offsets, lengths, shapes))

    @cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each gradient's shape, in packing order."""
        return tuple(seg.shape for seg in self._segments)

    @property
    def names(self) -> tuple[str, ...]:
        """The gradient names, in packing order."""
        return GRADIENT_NAMES[: len(self._segments)]

    def segments(self) -> tuple[Segment, ...]:
        """One :class:`Segment` per gradient, in packing order."""
        return self._segments

    def segment(self, name: str) -> Segment:
        """The :class:`Segment` of the gradient ``name``; a KeyError names those there are."""
        for seg in self._segments:
            if seg.name == name:
                return seg
        raise KeyError(f"no gradient {name!r} in this layout; it has {', '.join(self.names)}")

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the gradient ``name``."""
        return self.segment(name).shape

    def input_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the op's input ``name``, of the cotangent ``"dy"`` or the output ``"y"``.

        >>> GdnBackwardLayout(2, 3, 4, 8).input_shape("beta")
        (2, 3, 4)
        """
        if name not in INPUT_NAMES:
            raise KeyError(f"no input {name!r}; the inputs are {', '.join(INPUT_NAMES)}")
        return self.shape(INPUT_NAMES[name])

    def nbytes(self, dtype: DTypeLike) -> int:
        """Bytes of a packed buffer in ``dtype`` (a name needs no ml_dtypes for bfloat16).

        >>> GdnBackwardLayout(2, 3, 4, 8).nbytes("float32")
        2496
        """
        return self.total_elems * itemsize(dtype, "nbytes: dtype")

    def __str__(self) -> str:
        """:func:`layout_text`."""
        return layout_text(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return layout_html(self)

    def to_dict(self) -> dict[str, int | bool]:
        """The six fields as a JSON-safe dict; :meth:`from_dict` reads it back."""
        return {name: getattr(self, name) for name in _DIMS + _FLAGS}

    @classmethod
    def from_dict(cls, data: Any) -> GdnBackwardLayout:
        """A layout from :meth:`to_dict`'s output: a TypeError for what is not a dict, a
        ValueError for a key missing or unknown.

        >>> layout = GdnBackwardLayout(2, 3, 4, 8, carry_state=True)
        >>> GdnBackwardLayout.from_dict(layout.to_dict()) == layout
        True
        """
        if not isinstance(data, dict):
            raise TypeError(f"layout data must be a dict, got {type(data).__name__}")
        missing = [key for key in _DIMS if key not in data]
        unknown = sorted(str(key) for key in data if key not in _DIMS + _FLAGS)
        if missing or unknown:
            raise ValueError(
                f"layout data must have the keys {', '.join(_DIMS)} (and optionally "
                f"{', '.join(_FLAGS)}); missing {missing}, unknown {unknown}"
            )
        return cls(**data)

    @classmethod
    def from_inputs(cls, q: Any, g: Any, state: Any = None) -> GdnBackwardLayout:
        """The layout of a forward called with ``q`` ``[B, S, H, N]``, ``g`` ``[B, S, H]`` (or
        ``[B, S, H, N]``) and ``state`` ``[B, H, N, N]`` or None, arrays or shapes; a shape
        that does not fit is a ValueError.

        >>> layout = GdnBackwardLayout.from_inputs(q=(1, 16, 2, 4), g=(1, 16, 2), state=None)
        >>> layout.gate_per_channel, layout.carry_state, layout.total_elems
        (False, False, 448)
        """
        return cls._infer(("q", q), ("g", g), ("state", state))

    @classmethod
    def from_grads(
        cls, dq: Any, dk: Any, dv: Any, dg: Any, dbeta: Any, dstate: Any = None
    ) -> GdnBackwardLayout:
        """The layout that packs these gradients (arrays or shapes), every shape checked."""
        layout = cls._infer(("dq", dq), ("dg", dg), ("dstate", dstate))
        for name, grad in zip(("dk", "dv", "dbeta"), (dk, dv, dbeta), strict=True):
            if (shape := _shape_of(name, grad)) != layout.shape(name):
                raise ValueError(
                    f"{name} has shape {shape}, expected {layout.shape(name)} for {layout!r}"
                )
        return layout

    @classmethod
    def _infer(
        cls, first: tuple[str, Any], gate: tuple[str, Any], state: tuple[str, Any]
    ) -> GdnBackwardLayout:
        shape = _shape_of(*first)
        if len(shape) != 4:
            raise ValueError(f"{first[0]} must have 4 dimensions [B, S, H, N], got shape {shape}")
        b, s, h, n = shape
        gate_shape = _shape_of(*gate)
        if gate_shape not in ((b, s, h), (b, s, h, n)):
            raise ValueError(
                f"{gate[0]} must have shape [B, S, H] = {(b, s, h)} or [B, S, H, N] = "
                f"{(b, s, h, n)} of {first[0]}, got {gate_shape}"
            )
        if state[1] is not None and (state_shape := _shape_of(*state)) != (b, h, n, n):
            raise ValueError(
                f"{state[0]} must have shape [B, H, N, N] = {(b, h, n, n)} of {first[0]}, "
                f"got {state_shape}"
            )
        return cls(b, s, h, n, len(gate_shape) == 4, state[1] is not None)

    def plot(self, **options: Any) -> Picture:
        """:func:`gdn_layout.plot.plot_layout` of this layout."""
        from .plot import plot_layout  # deferred: plot builds on this module

        picture: Picture = plot_layout(self, **options)
        return picture


def _shape_of(name: str, value: Any) -> tuple[int, ...]:
    try:
        return tuple(map(operator.index, getattr(value, "shape", value)))
    except TypeError:
        raise TypeError(f"{name} must be an array or a shape, got {type(value).__name__}") from None


class LayoutRow(NamedTuple):
    """One gradient's place in a packed buffer, with its size in bytes."""

    name: str
    shape: tuple[int, ...]
    offset: int
    length: int
    nbytes: int


def layout_table(layout: GdnBackwardLayout, dtype: DTypeLike = np.float32) -> list[LayoutRow]:
    """One :class:`LayoutRow` per gradient.

    >>> layout_table(GdnBackwardLayout(1, 2, 1, 2), dtype=np.float64)[3]
    LayoutRow(name='dg', shape=(1, 2, 1), offset=12, length=2, nbytes=16)
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout)
    size = itemsize(dtype, "dtype")
    return [
        LayoutRow(s.name, s.shape, s.offset, s.length, s.length * size) for s in layout.segments()
    ]


def layout_text(layout: GdnBackwardLayout, dtype: DTypeLike = np.float32) -> str:
    """The layout as a fixed-width table with a total line, headed by its caption.

    >>> print(layout_text(GdnBackwardLayout(batch=1, seq=2, heads=1, state_size=2)))
    B=1 S=2 H=1 N=2, per-head gate, no state; float32
    grad   shape         offset  length  bytes
    -----  ------------  ------  ------  -----
    dq     (1, 2, 1, 2)       0       4     16
    dk     (1, 2, 1, 2)       4       4     16
    dv     (1, 2, 1, 2)       8       4     16
    dg     (1, 2, 1)         12       2      8
    dbeta  (1, 2, 1)         14       2      8
    total                            16     64
    """
    body, caption = _layout_cells(layout, dtype)
    return f"{caption}\n{text_table(_LAYOUT_HEADERS, body, align='llrrr')}"


def layout_html(layout: GdnBackwardLayout, dtype: DTypeLike = np.float32) -> str:
    """:func:`layout_text` as HTML."""
    body, caption = _layout_cells(layout, dtype)
    styles = [""] * (len(body) - 1) + ["font-weight:bold"]
    return html_table(_LAYOUT_HEADERS, body, align="llrrr", caption=caption, row_styles=styles)


_LAYOUT_HEADERS = ["grad", "shape", "offset", "length", "bytes"]


def _layout_cells(layout: GdnBackwardLayout, dtype: DTypeLike) -> tuple[list[list[str]], str]:
    rows = layout_table(layout, dtype)
    body = [[r.name, str(r.shape), str(r.offset), str(r.length), str(r.nbytes)] for r in rows]
    body.append(["total", "", "", str(layout.total_elems), str(layout.nbytes(dtype))])
    return body, f"{layout_caption(layout)}; {dtype_name(dtype, 'dtype')}"


def layout_caption(layout: GdnBackwardLayout) -> str:
    """A one-line description of a layout.

    >>> layout_caption(GdnBackwardLayout(2, 5, 3, 8, gate_per_channel=True, carry_state=True))
    'B=2 S=5 H=3 N=8, per-channel gate, carried state'
    """
    gate = "per-channel gate" if layout.gate_per_channel else "per-head gate"
    state = "carried state" if layout.carry_state else "no state"
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    return f"B={b} S={s} H={h} N={n}, {gate}, {state}"
