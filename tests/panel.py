"""Correct kernels as the field writes them, in PyTorch with autograd: the panel the calibrated
criterion must pass. None shares code with gdn-layout's reference or its floors.

* :func:`chunked`: the chunked WY/UT form as transformers' ``torch_chunk_gated_delta_rule``
  and flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_kda`` compute it (chunk 64,
  the chunk's triangular system inverted by row recurrences, decays as ``exp`` of differences
  of cumulative log-gates), its backward by autograd; matrix products on float32, TF32 or
  bfloat16 operands (every product of the backward too).
* :func:`step_by_step`: the recurrence one step at a time, its backward by autograd: the
  spec's form, its sums in torch's order.

Each takes a fixture's inputs and returns the packed gradient in the fixture's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from gdn_layout import pack
from gdn_layout.files import Fixture

torch: Any = None


def _torch() -> Any:
    global torch
    if torch is None:
        import torch as _t

        torch = _t
    return torch


def _round(x: Any, operands: str) -> Any:
    """``x`` as a product's operand of ``operands``: ``float32`` (as it is), ``tf32`` (10
    mantissa bits, to nearest even) or ``bfloat16``."""
    t = _torch()
    if operands == "float32":
        return x
    if operands == "bfloat16":
        return x.to(t.bfloat16).to(x.dtype)
    bits = x.contiguous().view(t.int32)
    odd = (bits >> 13) & 1
    rounded = (bits + 0xFFF + odd) & ~0x1FFF
    return rounded.view(t.float32)


def _products(operands: str) -> Any:
    """``a @ b`` on rounded operands, its backward's products too."""
    t = _torch()
    function: Any = t.autograd.Function

    class Product(function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, a: Any, b: Any) -> Any:
            ctx.save_for_backward(a, b)
            return _round(a, operands) @ _round(b, operands)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            a, b = ctx.saved_tensors
            g = _round(grad, operands)
            return g @ _round(b, operands).transpose(-1, -2), _round(a, operands).transpose(
                -1, -2
            ) @ g

    return Product.apply


def _leaves(fx: Fixture) -> dict[str, Any]:
    t = _torch()
    leaves = {}
    for name, array in zip(("q", "k", "v", "g", "beta", "dy", "state"), fx.inputs, strict=True):
        if array is None:
            continue
        tensor = t.from_numpy(np.asarray(array, np.float32).copy())
        leaves[name] = tensor.requires_grad_(name != "dy")
    return leaves


def _packed(fx: Fixture, leaves: dict[str, Any], y: Any) -> NDArray[Any]:
    (y * leaves["dy"]).sum().backward()
    grads = {n: leaves[n].grad.numpy() for n in ("q", "k", "v", "g", "beta")}
    state = leaves["state"].grad.numpy() if "state" in leaves else None
    out = pack(grads["q"], grads["k"], grads["v"], grads["g"], grads["beta"], state)
    return out.astype(fx.dtype)


def chunked(fx: Fixture, operands: str = "float32", chunk: int = 64) -> NDArray[Any]:
    """The chunked WY/UT kernel in float32 with products on ``operands``."""
    t = _torch()
    mm = _products(operands)
    leaves = _leaves(fx)
    q, k, v, g, beta = (leaves[n].transpose(1, 2) for n in ("q", "k", "v", "g", "beta"))
    batch, heads, seq, size = q.shape
    per_channel = g.dim() == 4
    pad = (-seq) % chunk
    steps = seq + pad
    count = steps // chunk

    def chunks(x: Any) -> Any:
        x = t.nn.functional.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(batch, heads, count, chunk, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q * size**-0.5, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g = g.cumsum(3)
    lower = t.ones(chunk, chunk, dtype=t.bool).tril()
    strict = lower.tril(-1)
    if per_channel:
        diff = g[:, :, :, :, None, :] - g[:, :, :, None, :, :]
        decay = diff.masked_fill(~lower[..., None], 0).exp() * lower[..., None]
        couple = t.einsum("bhctn,bhcsn,bhctsn->bhcts", k_beta, k, decay)
        scores = t.einsum("bhctn,bhcsn,bhctsn->bhcts", q, k, decay)
        g_exp, last = g.exp(), g[:, :, :, -1:, :]
    else:
        decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, 0).exp() * lower
        couple = mm(k_beta, k.transpose(-1, -2)) * decay
        scores = mm(q, k.transpose(-1, -2)) * decay
        g_exp, last = g.exp()[..., None], g[..., -1:, None]
    attn = -(couple.masked_fill(~strict, 0))
    for i in range(1, chunk):  # (I + L)^-1 by row recurrences, as transformers does
        row, above = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row[..., None] * above).sum(-2)
    inv = attn + t.eye(chunk)
    values = mm(inv, v_beta)
    k_decayed = mm(inv, k_beta * g_exp)
    state = leaves.get("state", t.zeros(batch, heads, size, size))
    outputs = []
    for c in range(count):
        new = values[:, :, c] - mm(k_decayed[:, :, c], state)
        inter = mm(q[:, :, c] * g_exp[:, :, c], state)
        outputs.append(inter + mm(scores[:, :, c].masked_fill(~lower, 0), new))
        exit_decay = last[:, :, c].exp().transpose(-1, -2) if per_channel else last[:, :, c].exp()
        gap = last[:, :, c] - (g[:, :, c] if per_channel else g[:, :, c, :, None])
        keys = k[:, :, c] * gap.exp()
        state = state * exit_decay + mm(keys.transpose(-1, -2), new)
    y = t.stack(outputs, 2).reshape(batch, heads, steps, size)[:, :, :seq].transpose(1, 2)
    return _packed(fx, leaves, y)


def step_by_step(fx: Fixture) -> NDArray[Any]:
    """The recurrence step by step in float32, its backward by autograd."""
    t = _torch()
    leaves = _leaves(fx)
    q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    batch, seq, heads, size = q.shape
    per_channel = g.dim() == 4
    state = leaves.get("state", t.zeros(batch, heads, size, size))
    outputs = []
    for s in range(seq):
        decay = g[:, s].exp()
        state = state * (decay[..., None] if per_channel else decay[..., None, None])
        key = k[:, s]
        write = (v[:, s] - (key[..., None, :] @ state)[..., 0, :]) * beta[:, s, :, None]
        state = state + key[..., :, None] * write[..., None, :]
        outputs.append(size**-0.5 * (q[:, s, :, None, :] @ state)[..., 0, :])
    y = t.stack(outputs, 1) if outputs else t.zeros(batch, 0, heads, size)
    return _packed(fx, leaves, y)


def transformers_chunked(fx: Fixture, mapping: str = "") -> NDArray[Any]:
    """transformers' ``torch_chunk_gated_delta_rule`` (chunk 64) under autograd: the
    undecorated PyTorch function, as the installed package defines it. ``mapping`` is a port's
    glue inside autograd, its gradients taken back to the tensors passed: ``"qk_swapped"``,
    ``"gate_exp_twice"`` (``exp(g)`` passed as the log-gate) or ``"g_beta_swapped"``."""
    import importlib
    import inspect

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    function = inspect.unwrap(module.torch_chunk_gated_delta_rule)
    if not inspect.isfunction(function):  # a decorator that made a module: its forward's
        forward = type(function).forward
        function = inspect.unwrap(inspect.getclosurevars(forward).nonlocals["func"])
    leaves = _leaves(fx)
    q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    if mapping == "qk_swapped":
        q, k = k, q
    elif mapping == "gate_exp_twice":
        g = g.exp()
    elif mapping == "g_beta_swapped":
        g, beta = beta, g
    y, _ = function(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=64,
        initial_state=leaves.get("state"),
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
    )
    return _packed(fx, leaves, y)


def misread(
    fx: Fixture, reading: str, variant: str = "", *, attributed: bool = False
) -> NDArray[Any]:
    """A step-by-step kernel in float32 under autograd, glued to the op with the misreading
    ``reading`` (the vocabulary of ``gdn_layout.check._misreadings``) as a port has it: the
    glue passes the inputs as the kernel reads them, and the kernel's gradients, with respect
    to what it read, are packed as they come. ``variant`` picks a form of a reading:
    ``"early"`` for ``gate_shift``, ``"dv"`` for ``beta_missing``, ``"1"``, ``"1/N"`` or a
    padded size such as ``"16"`` for ``scale``.

    ``attributed``: the glue is inside autograd too (a port wrapping a function), so the
    gradients come back by the chain rule to the tensors the user passed: ``q`` and ``k``
    exchanged give ``dq`` the gradient of the ``k`` slot, ``exp(g)`` passed as the log-gate
    gives ``dg`` through that ``exp``, and a state read transposed gives ``dstate`` written
    with the same stride."""
    t = _torch()
    x = {
        n: np.asarray(a, np.float32).copy()
        for n, a in zip(("q", "k", "v", "g", "beta", "dy", "state"), fx.inputs, strict=True)
        if a is not None
    }
    user = {n: t.from_numpy(a).requires_grad_(n != "dy") for n, a in x.items()}
    read = dict(user) if attributed else {n: a.detach().clone() for n, a in user.items()}
    if reading == "state_transposed":
        read["state"] = read["state"].transpose(-1, -2)
    elif reading == "gate_exp_twice":
        read["g"] = read["g"].exp()
    elif reading == "g_beta_swapped":
        read["g"], read["beta"] = read["beta"], read["g"]
    elif reading == "qk_swapped":
        read["q"], read["k"] = read["k"], read["q"]
    batch, seq = x["q"].shape[:2]
    folded = reading == "batch_folded"
    if folded:
        for n in ("q", "k", "v", "g", "beta", "dy"):
            read[n] = read[n].reshape(1, batch * seq, *read[n].shape[2:])
        if "state" in read:
            read["state"] = read["state"][:1]
    if not attributed:  # the kernel's own leaves: its gradients of what it read
        read = {n: a.detach().clone().requires_grad_(n != "dy") for n, a in read.items()}
    leaves = user if attributed else read
    q, k, v, g, beta = (read[n] for n in ("q", "k", "v", "g", "beta"))
    _, steps, heads, size = q.shape
    if reading == "qk_normalized":
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    scale = size**-0.5
    if reading == "scale":
        scale = {"1": 1.0, "1/N": 1.0 / size}.get(variant) or int(variant) ** -0.5
    state = read.get("state", t.zeros(q.shape[0], heads, size, size))
    outputs = []
    for s in range(steps):
        if reading == "gate_shift":
            near = s - 1 if variant != "early" else s + 1
            decay = g[:, near].exp() if 0 <= near < steps else t.ones_like(g[:, s])
        elif reading == "gate_as_decay":
            decay = g[:, s]
        else:
            decay = g[:, s].exp()
        if g.dim() == 3:
            state = state * decay[..., None, None]
        elif reading == "gate_axis":
            state = state * decay[..., None, :]
        else:
            state = state * decay[..., None]
        key = k[:, s]
        write = v[:, s] - (key[..., None, :] @ state)[..., 0, :]
        if not (reading == "beta_missing" and variant != "dv"):
            write = write * beta[:, s, :, None]
        state = state + key[..., :, None] * write[..., None, :]
        outputs.append(scale * (q[:, s, :, None, :] @ state)[..., 0, :])
    y = t.stack(outputs, 1)
    loss = (y * read["dy"]).sum()
    if reading == "final_state_cotangent":
        loss = loss + state.sum()
    loss.backward()
    grads = {
        n: (leaves[n].grad if leaves[n].grad is not None else t.zeros_like(leaves[n])).numpy()
        for n in ("q", "k", "v", "g", "beta")
    }
    if reading == "beta_missing" and variant == "dv":
        grads["v"] = grads["v"] / x["beta"][..., None]
    if folded and not attributed:
        grads = {n: a.reshape(batch, seq, *a.shape[2:]) for n, a in grads.items()}
    dstate = None
    if "state" in leaves:
        dstate = leaves["state"].grad.numpy()
        if folded and not attributed:
            dstate = np.concatenate([dstate, np.zeros((batch - 1, *dstate.shape[1:]), "f4")])
    out = pack(grads["q"], grads["k"], grads["v"], grads["g"], grads["beta"], dstate)
    return out.astype(fx.dtype)
