"""The gate regimes, which fixtures, suites, the command line and the plugin draw from
(README.md). A new regime is one entry at the end of ``_TABLE`` with the suite's next revision
as its ``since``: the suite then gains a file of it for every shape, after every file it had.

>>> import numpy as np
>>> g = draw_gate(np.random.default_rng(0), (1, 4, 2), "strong")
>>> bool(((-8 <= g) & (g <= -3)).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = ["REGIMES", "REGIME_SUMMARIES", "draw_gate"]


_Draw = Callable[[np.random.Generator, tuple[int, ...]], NDArray[np.float64]]


def _uniform(low: float, high: float) -> _Draw:
    return lambda rng, shape: rng.uniform(low, high, shape)


def _mild_strong(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[NDArray[Any], ...]:
    """A mild and a strong draw, which each of the first four regimes makes (keeping ``rng``'s
    stream after it); mild never rounds to 0, even in bfloat16."""
    return rng.uniform(-0.1, -0.001, shape), rng.uniform(-8.0, -3.0, shape)


def _mixed(rng: np.random.Generator, shape: tuple[int, ...]) -> NDArray[np.float64]:
    mild, strong = _mild_strong(rng, shape)
    pick = rng.integers(0, 3, shape)
    return np.select([pick == 1, pick == 2], [mild, strong], 0.0)


def _qwen(rng: np.random.Generator, shape: tuple[int, ...]) -> NDArray[np.float64]:
    # Per head, broadcast over the batch, the steps and (per channel) the key channels.
    per_head = shape[2:3] + (1,) * (len(shape) - 3)
    decay = rng.uniform(1.0, 16.0, per_head)  # exp(A_log)
    dt_bias = rng.uniform(-1.0, 1.0, per_head)
    a = rng.standard_normal(shape)
    return -decay * np.logaddexp(0.0, a + dt_bias)  # softplus(x) = log(1 + exp(x))


class _Regime(NamedTuple):
    #: The regime in a phrase, for help texts.
    summary: str
    #: The revision of the standard suite it joined (its shapes count in the same revisions).
    since: int
    draw: _Draw


#: Every gate regime, in the standard suite's order.
_TABLE: Final = {
    "zero": _Regime(
        "no decay, where state-path bugs show most",
        0,
        lambda r, s: np.zeros_like(_mild_strong(r, s)[0]),
    ),
    "mild": _Regime("exp(g) near 1", 0, lambda r, s: _mild_strong(r, s)[0]),
    "strong": _Regime("exp(g) near 0", 0, lambda r, s: _mild_strong(r, s)[1]),
    "mixed": _Regime("each element one of the three above", 0, _mixed),
    "qwen": _Regime("Qwen3-Next's gates, -exp(A_log)*softplus(a+dt_bias)", 1, _qwen),
    "extreme": _Regime("g in [-30, -10], exp(g) down to 1e-13", 1, _uniform(-30.0, -10.0)),
}
#: Each gate regime in a phrase (for help texts), in the standard suite's order.
REGIME_SUMMARIES: Final = {name: regime.summary for name, regime in _TABLE.items()}
#: The revision of the standard suite each gate regime joined, in the suite's order.
REGIME_SINCE: Final = {name: regime.since for name, regime in _TABLE.items()}
#: Every gate regime, in the standard suite's order.
REGIMES: Final = tuple(_TABLE)


def draw_gate(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> NDArray[np.float64]:
    """Log-gates of ``shape`` (``[B, S, H]``, or ``[B, S, H, N]`` per channel) in ``regime``,
    one of :data:`REGIMES` (else ValueError), drawn from ``rng``."""
    if regime not in REGIMES:
        raise ValueError(f"draw_gate: regime must be one of {REGIMES}, got {regime!r}")
    return _TABLE[regime].draw(rng, shape)
