"""Where each gradient sits in the packed output of RLX's ``GatedDeltaNetBackward``.

This mirrors ``GdnBackwardLayout`` in rlx-ir's ``src/gdn.rs``: the same fields, the same
quantities under the same names, computed with Python integers so that they are exact at any
size. The Rust side computes in ``usize``; a configuration whose arithmetic would overflow it
(where a debug build of rlx-ir panics) is refused here rather than given a number Rust cannot
agree with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from numpy.typing import DTypeLike

from ._checks import USIZE_LIMIT, check_shape, dimension, flag, shape_of
from ._dtypes import itemsize
from ._tables import LayoutRow, layout_caption, layout_html, layout_table, layout_text

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
#: Every gradient's name, in packing order; ``dstate`` is packed only when the state is carried.
GRADIENT_NAMES: Final = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
#: The op's inputs, the cotangent ``dy`` and the output ``y``, each with its gradient's shape.
INPUT_NAMES: Final = {
    "q": "dq",
    "k": "dk",
    "v": "dv",
    "g": "dg",
    "beta": "dbeta",
    "state": "dstate",
    "dy": "dv",
    "y": "dv",
}
#: The axes of the gradients over the sequence (``dg`` has ``n`` with a per-channel gate), and
#: of ``dstate`` ``[B, H, N, N]``: key row ``i``, value column ``j``.
_SEQUENCE_AXES: Final = ("b", "s", "h", "n")
_STATE_AXES: Final = ("b", "h", "i", "j")
_CHUNK_AXES: Final = ("b", "c", "h", "i", "j")


class Segment(NamedTuple):
    """One gradient's place in the packed buffer: ``flat[offset : offset + length]``.

    See Also
    --------
    GdnBackwardLayout : The layout whose segments these are.
    layout.gradient_axes : The names of a segment's axes.

    Examples
    --------
    >>> GdnBackwardLayout(1, 2, 3, 4, carry_state=True).segment("dstate").axes
    ('b', 'h', 'i', 'j')
    """

    name: str
    offset: int
    length: int
    shape: tuple[int, ...]

    @property
    def axes(self) -> tuple[str, ...]:
        """Each axis's name: ``("b", "s", "h", "n")`` for ``dq``, ``("b", "s", "h")`` for
        ``dbeta``, ``("b", "h", "i", "j")`` (key row, value column) for ``dstate``."""
        return gradient_axes(self.name, len(self.shape))


def gradient_axes(name: str, ndim: int) -> tuple[str, ...]:
    """The axis names of the gradient ``name`` with ``ndim`` axes (see :attr:`Segment.axes`);
    also of the states a fixture may hold: ``h`` and ``dh`` are ``("b", "c", "h", "i", "j")``
    (``c`` the chunk), ``final_state`` is as ``dstate``, ``y`` as ``dq``.

    See Also
    --------
    Segment : A gradient's place, shape and axes.
    """
    if name in ("h", "dh"):
        return _CHUNK_AXES
    return _STATE_AXES if name in ("dstate", "final_state") else _SEQUENCE_AXES[:ndim]


def _usize(*factors: int) -> int:
    """``factors`` multiplied left to right, as Rust's ``a * b * c``; a sum is one factor.

    Rust's ``usize`` arithmetic panics (in a debug build) where a partial result reaches
    ``usize::MAX + 1``, even when a later factor is 0; so each partial product is checked.
    """
    product = 1
    for factor in factors:
        product *= factor
        if product >= USIZE_LIMIT:
            raise OverflowError
    return product


@dataclass(frozen=True)
class GdnBackwardLayout:
    """The packed-gradient layout of ``GatedDeltaNetBackward``, equal to rlx-ir's.

    The packed buffer holds ``dq, dk, dv, dg, dbeta`` and, with ``carry_state``, ``dstate``,
    each flattened in C order and concatenated in that order.

    See Also
    --------
    unpack : A packed buffer as shaped views of its gradients.
    pack : Gradients into one packed buffer.
    layout.layout_text : The layout as a table.

    Examples
    --------
    >>> layout = GdnBackwardLayout(batch=2, seq=3, heads=4, state_size=8)
    >>> layout.total_elems
    624
    >>> layout.dbeta_offset == layout.dg_offset + layout.gate_elems
    True
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

    def __post_init__(self) -> None:
        for name in _DIMS:
            object.__setattr__(self, name, dimension(name, getattr(self, name)))
        for name in _FLAGS:
            object.__setattr__(self, name, flag(name, getattr(self, name)))
        try:
            # total_elems adds up every other quantity (dv_offset = 2 * qkv_elems is at most
            # dg_offset), so all of Rust's arithmetic is done, and an overflow refused, here.
            self.total_elems  # noqa: B018
        except OverflowError:
            raise ValueError(
                f"{self!r} does not fit in a 64-bit usize: its element counts or offsets "
                "overflow, and rlx-ir's arithmetic would panic"
            ) from None

    # -- the Rust quantities, by their Rust names, computed as gdn.rs computes them ----------
    # Cached in the instance (not dataclass fields, so that equality, repr and
    # dataclasses.asdict see the six fields only): unpack and pack do no arithmetic.

    @cached_property
    def qkv_elems(self) -> int:
        """Elements in one of ``q``/``k``/``v``/``dy``: ``[B, S, H, N]``."""
        return _usize(self.batch, self.seq, self.heads, self.state_size)

    @cached_property
    def beta_elems(self) -> int:
        """Elements in ``beta``: ``[B, S, H]``."""
        return _usize(self.batch, self.seq, self.heads)

    @property
    def gate_elems(self) -> int:
        """Elements in ``g``: ``[B, S, H, N]`` per channel, else ``[B, S, H]``."""
        return self.qkv_elems if self.gate_per_channel else self.beta_elems

    @cached_property
    def state_elems(self) -> int:
        """Elements in the carried state ``[B, H, N, N]``; zero when it is not carried."""
        if not self.carry_state:
            return 0
        return _usize(self.batch, self.heads, self.state_size, self.state_size)

    @property
    def dq_offset(self) -> int:
        return 0

    @property
    def dk_offset(self) -> int:
        return self.qkv_elems

    @cached_property
    def dv_offset(self) -> int:
        return _usize(2, self.qkv_elems)

    @cached_property
    def dg_offset(self) -> int:
        return _usize(3, self.qkv_elems)

    @cached_property
    def dbeta_offset(self) -> int:
        return _usize(self.dg_offset + self.gate_elems)

    @cached_property
    def dstate_offset(self) -> int:
        """Where ``dstate`` starts; as in Rust, defined (as the end of ``dbeta``) even when
        the state is not carried."""
        return _usize(self.dbeta_offset + self.beta_elems)

    @cached_property
    def total_elems(self) -> int:
        """Length of the packed buffer."""
        return _usize(self.dstate_offset + self.state_elems)

    def slices(self) -> list[tuple[int, int]]:
        """``(offset, length)`` for each gradient in packing order, as rlx-ir's ``slices()``."""
        return [(seg.offset, seg.length) for seg in self._segments]

    # -- beyond Rust ----------------------------------------------------------------------

    @cached_property
    def _segments(self) -> tuple[Segment, ...]:
        # gdn.rs's slices(), each with its name and shape.
        b, s, h, n = self.batch, self.seq, self.heads, self.state_size
        gate_shape = (b, s, h, n) if self.gate_per_channel else (b, s, h)
        segments: tuple[Segment, ...] = (
            Segment("dq", self.dq_offset, self.qkv_elems, (b, s, h, n)),
            Segment("dk", self.dk_offset, self.qkv_elems, (b, s, h, n)),
            Segment("dv", self.dv_offset, self.qkv_elems, (b, s, h, n)),
            Segment("dg", self.dg_offset, self.gate_elems, gate_shape),
            Segment("dbeta", self.dbeta_offset, self.beta_elems, (b, s, h)),
        )
        if self.carry_state:
            segments += (Segment("dstate", self.dstate_offset, self.state_elems, (b, h, n, n)),)
        return segments

    @cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each gradient, in packing order.

        >>> GdnBackwardLayout(1, 2, 3, 4).shapes[3:]
        ((1, 2, 3), (1, 2, 3))
        """
        return tuple(seg.shape for seg in self._segments)

    @cached_property
    def cuts(self) -> tuple[tuple[slice, tuple[int, ...]], ...]:
        """``(slice, shape)`` of each gradient in packing order: ``flat[cut].reshape(shape)``
        is its view of a 1-D packed buffer ``flat``.

        >>> GdnBackwardLayout(1, 2, 1, 2).cuts[3]
        (slice(12, 14, None), (1, 2, 1))
        """
        return tuple((slice(s.offset, s.offset + s.length), s.shape) for s in self._segments)

    @property
    def names(self) -> tuple[str, ...]:
        """The gradient names in packing order: ``dq, dk, dv, dg, dbeta`` (and ``dstate``)."""
        return GRADIENT_NAMES[: len(self._segments)]

    def segments(self) -> tuple[Segment, ...]:
        """One :class:`Segment` ``(name, offset, length, shape)`` per gradient, in order."""
        return self._segments

    def segment(self, name: str) -> Segment:
        """The :class:`Segment` of the gradient called ``name``.

        Raises
        ------
        KeyError
            No gradient of that name in this layout (``dstate`` without ``carry_state``).
        """
        for seg in self._segments:
            if seg.name == name:
                return seg
        raise KeyError(f"no gradient {name!r} in this layout; it has {', '.join(self.names)}")

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the gradient called ``name`` (``"dq"``, ..., ``"dstate"``)."""
        return self.segment(name).shape

    def input_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the op's input ``name`` (``"q"``, ``"k"``, ``"v"``, ``"g"``,
        ``"beta"``, ``"state"``), of the cotangent ``"dy"`` or of the output ``"y"``.

        >>> GdnBackwardLayout(2, 3, 4, 8).input_shape("beta")
        (2, 3, 4)
        """
        gradient = INPUT_NAMES.get(name)
        if gradient is None:
            raise KeyError(f"no input {name!r}; the inputs are {', '.join(INPUT_NAMES)}")
        return self.shape(gradient)

    def nbytes(self, dtype: DTypeLike) -> int:
        """Bytes of a packed buffer of this layout in ``dtype``.

        Parameters
        ----------
        dtype : dtype_like
            Any NumPy dtype; ``"bfloat16"`` works as a name (it needs ml_dtypes).

        Returns
        -------
        int
            ``total_elems`` times the dtype's item size.

        Raises
        ------
        TypeError
            ``dtype`` is not a dtype.

        Examples
        --------
        >>> GdnBackwardLayout(2, 3, 4, 8).nbytes("float32")
        2496
        """
        return self.total_elems * itemsize(dtype, "nbytes: dtype")

    # The views: the layout table of gdn_layout._tables.

    def __str__(self) -> str:
        """The layout table: name, shape, offset, length and float32 bytes of each gradient."""
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
        """A layout from :meth:`to_dict`'s output, validated like the constructor.

        Parameters
        ----------
        data : dict
            The keys ``batch``, ``seq``, ``heads``, ``state_size`` and optionally
            ``gate_per_channel`` and ``carry_state``.

        Returns
        -------
        GdnBackwardLayout

        Raises
        ------
        TypeError
            ``data`` is not a dict, or a value has the wrong type.
        ValueError
            A key is missing or unknown, or a value is out of range.

        Examples
        --------
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

        Parameters
        ----------
        q : array or shape
            ``[B, S, H, N]``.
        g : array or shape
            ``[B, S, H]``, or ``[B, S, H, N]`` for a per-channel gate.
        state : array or shape, optional
            ``[B, H, N, N]`` when the state is carried.

        Returns
        -------
        GdnBackwardLayout

        Raises
        ------
        TypeError
            An argument is neither an array nor a shape.
        ValueError
            A shape does not fit the others (``g``'s rank gives the gate mode).

        Examples
        --------
        >>> layout = GdnBackwardLayout.from_inputs(q=(1, 16, 2, 4), g=(1, 16, 2), state=None)
        >>> layout.gate_per_channel, layout.carry_state, layout.total_elems
        (False, False, 448)
        """
        return cls._infer(("q", q), ("g", g), ("state", state))

    @classmethod
    def from_grads(
        cls, dq: Any, dk: Any, dv: Any, dg: Any, dbeta: Any, dstate: Any = None
    ) -> GdnBackwardLayout:
        """The layout that packs these gradients (arrays or shapes); every shape is checked.

        Parameters
        ----------
        dq, dk, dv, dg, dbeta, dstate : array or shape
            The gradients, ``dstate`` None when the state is not carried.

        Returns
        -------
        GdnBackwardLayout

        Raises
        ------
        TypeError, ValueError
            As :meth:`from_inputs`.
        """
        layout = cls._infer(("dq", dq), ("dg", dg), ("dstate", dstate))
        for name, grad in zip(("dk", "dv", "dbeta"), (dk, dv, dbeta), strict=True):
            check_shape(name, shape_of(name, grad), layout.shape(name), layout)
        return layout

    @classmethod
    def _infer(
        cls, first: tuple[str, Any], gate: tuple[str, Any], state: tuple[str, Any]
    ) -> GdnBackwardLayout:
        first_shape = shape_of(*first)
        if len(first_shape) != 4:
            raise ValueError(
                f"{first[0]} must have 4 dimensions [B, S, H, N], got shape {first_shape}"
            )
        b, s, h, n = first_shape
        gate_shape = shape_of(*gate)
        if gate_shape not in ((b, s, h), (b, s, h, n)):
            raise ValueError(
                f"{gate[0]} must have shape [B, S, H] = {(b, s, h)} or [B, S, H, N] = "
                f"{(b, s, h, n)} of {first[0]}, got {gate_shape}"
            )
        if state[1] is not None and (state_shape := shape_of(*state)) != (b, h, n, n):
            raise ValueError(
                f"{state[0]} must have shape [B, H, N, N] = {(b, h, n, n)} of {first[0]}, "
                f"got {state_shape}"
            )
        return cls(
            b, s, h, n, gate_per_channel=len(gate_shape) == 4, carry_state=state[1] is not None
        )

    def plot(self, **options: Any) -> Picture:
        """:func:`gdn_layout.plot.plot_layout` of this layout, with the same options."""
        from .plot import plot_layout  # deferred: plot builds on this module

        picture: Picture = plot_layout(self, **options)
        return picture
