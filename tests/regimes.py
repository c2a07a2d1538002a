"""Inputs of the gated delta-net in the regimes real models reach, for the accuracy tests: a
:class:`Case` names a shape, a gate regime (``GATES``: ``uniform<lo>,<hi>``, ``const<g>``, the
library's ``qwen`` and ``mixed``, ``spiky``: mild with 10% of the steps at -30), a norm regime
for ``q`` and ``k`` (``NORMS``: ``unit``, ``upto4`` scaled by up to 4, ``raw``, ``key<r>``), a
``beta`` regime (``BETAS``: ``uniform``, ``zero``, ``one``, ``mixed``), the gate and state mode.
:meth:`Case.draw` makes the arrays from its seed (rounded to ``dtype``, so that a float32
computation starts from exactly the values the long-double oracle sees)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from numpy.typing import DTypeLike, NDArray

from gdn_layout.regimes import draw_gate

__all__ = ["BETAS", "DTYPES", "GATES", "MODES", "NORMS", "STRONG_DECAY", "Case", "Inputs"]

Array = NDArray[Any]
Inputs = dict[str, Array]

STRONG_DECAY = ("const-5", "const-12", "const-20", "const-40", "const-80")
GATES = ("uniform-1,0", *STRONG_DECAY, "uniform-30,-10", "uniform-80,-5", "qwen", "spiky", "mixed")
NORMS = ("unit", "upto4", "raw", "key3")
BETAS = ("uniform", "zero", "one", "mixed")
#: ``(per_channel, carry)``: the gate and state modes, as test parameters.
MODES = [
    pytest.param(False, False, id="per_head-no_state"),
    pytest.param(False, True, id="per_head-state"),
    pytest.param(True, False, id="per_channel-no_state"),
    pytest.param(True, True, id="per_channel-state"),
]
#: The reference's computation dtypes, as test parameters.
DTYPES = [pytest.param(np.float64, id="float64"), pytest.param(np.float32, id="float32")]


def _gates(
    rng: np.random.Generator, regime: str, shape: tuple[int, ...], per_head: tuple[int, int, int]
) -> Array:
    """Log-gates of ``shape`` (``[B, S, H]`` or ``[B, S, H, N]``) in ``regime``."""
    if regime in ("qwen", "mixed"):  # one definition, the fixtures'
        return draw_gate(rng, shape, regime)
    if regime.startswith("const"):
        return np.full(shape, float(regime.removeprefix("const")))
    if regime.startswith("uniform"):
        low, high = (float(x) for x in regime.removeprefix("uniform").split(","))
        return rng.uniform(low, high, shape)
    if regime == "spiky":
        g = rng.uniform(-0.1, 0.0, shape)
        spikes = rng.random(per_head) < 0.1
        g[spikes] = -30.0
        return g
    raise ValueError(f"unknown gate regime {regime!r}")


def _vectors(rng: np.random.Generator, regime: str, shape: tuple[int, ...], key: bool) -> Array:
    raw = rng.standard_normal(shape)
    if regime == "raw":
        return raw
    unit: Array = raw / np.linalg.norm(raw, axis=-1, keepdims=True)
    if regime == "unit":
        return unit
    if regime.startswith("key"):  # unit queries, keys of one norm
        return unit * float(regime.removeprefix("key")) if key else unit
    if regime == "upto4":
        return unit * (4.0 * (1.0 - rng.random((*shape[:-1], 1))))  # norms in (0, 4]
    raise ValueError(f"unknown norm regime {regime!r}")


def _beta(rng: np.random.Generator, regime: str, shape: tuple[int, ...]) -> Array:
    if regime == "uniform":
        return rng.uniform(0.0, 1.0, shape)
    if regime == "zero":
        return np.zeros(shape)
    if regime == "one":
        return np.ones(shape)
    if regime == "mixed":
        return np.choose(
            rng.integers(0, 3, shape), [np.zeros(shape), np.ones(shape), rng.random(shape)]
        )
    raise ValueError(f"unknown beta regime {regime!r}")


@dataclass(frozen=True)
class Case:
    """One set of inputs: shape, regimes, gate mode, carried state and seed."""

    batch: int = 1
    seq: int = 8
    heads: int = 1
    n: int = 4
    gates: str = "uniform-1,0"
    per_channel: bool = False
    carry: bool = False
    norms: str = "unit"
    beta: str = "uniform"
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq, self.heads, self.n)

    def with_(self, **changes: Any) -> Case:
        return replace(self, **changes)

    def draw(self, dtype: DTypeLike = np.float64) -> Inputs:
        """The inputs ``q, k, v, g, beta, dy`` (and ``state`` when carried), in ``dtype``."""
        rng = np.random.default_rng(self.seed)
        b, s, h, n = self.shape
        gate_shape = (b, s, h, n) if self.per_channel else (b, s, h)
        inputs = {
            "q": _vectors(rng, self.norms, self.shape, key=False),
            "k": _vectors(rng, self.norms, self.shape, key=True),
            "v": rng.standard_normal(self.shape),
            "g": _gates(rng, self.gates, gate_shape, (b, s, h)),
            "beta": _beta(rng, self.beta, (b, s, h)),
            "dy": rng.standard_normal(self.shape),
        }
        if self.carry:
            inputs["state"] = rng.standard_normal((b, h, n, n))
        return {name: value.astype(dtype) for name, value in inputs.items()}

    def __str__(self) -> str:
        mode = "per_channel" if self.per_channel else "per_head"
        state = "state" if self.carry else "no_state"
        shape = "x".join(map(str, self.shape))
        return f"{shape}-{self.gates}-{mode}-{state}-{self.norms}-beta_{self.beta}-seed{self.seed}"
