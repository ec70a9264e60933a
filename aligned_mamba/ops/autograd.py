"""What the ops' autograd Functions share (each op's ``triton.py`` holds its own Function).

Why each kernel runs in a Function, and the limits of the gradients' determinism: docs/design.md, "Backends".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch


def grad_needed(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must be recorded for autograd: grad mode on and some input requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms for the block (warn-only), then the caller's setting back."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def wanted(ctx: torch.autograd.function.FunctionCtx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """One gradient per forward input: ``grads`` for the first inputs (None where an input needs none),
    None for the rest (configs and other non-tensor arguments)."""
    needs = ctx.needs_input_grad
    return (*(gr if n else None for gr, n in zip(grads, needs)), *([None] * (len(needs) - len(grads))))


def saved_tensors_hooked() -> bool:
    """Whether a ``saved_tensors_hooks`` block (activation checkpointing or offloading) is active."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class _Rebuilt(NamedTuple):
    """A saved view of a recomputed tensor: its geometry in that tensor's storage."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Outer(NamedTuple):
    """A saved tensor as an enclosing block's hooks packed it."""

    packed: object


@contextlib.contextmanager
def recomputed_in_backward(out: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Saved tensors in ``out``'s storage are kept as geometry only and rebuilt in the backward from ``recompute()``
    (``out``'s values in its layout: the same kernel on the same inputs, the same bits), run once per backward
    without grad: ``out`` is freed with the forward, for one more run of its op."""
    # nothing here may hold out itself (the closures outlive the block)
    storage, device = out.untyped_storage().data_ptr(), out.device
    layout = (tuple(out.shape), tuple(out.stride()), out.storage_offset(), out.dtype, device)
    # held from the first view's unpacking to the last of this backward
    live: list[torch.Tensor] = []
    views = [0, 0]  # views packed; views unpacked in this backward

    # hooks of an enclosing block (activation offloading, say) still get every other saved tensor
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)(False)
    outer_pack, outer_unpack = top if top is not None else (None, None)

    def pack(t: torch.Tensor) -> object:
        if t.device != device or t.untyped_storage().data_ptr() != storage:
            return t if outer_pack is None else _Outer(outer_pack(t))
        views[0] += 1
        return _Rebuilt(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def unpack(p: object) -> torch.Tensor:
        if isinstance(p, _Outer):
            return outer_unpack(p.packed)
        if not isinstance(p, _Rebuilt):
            return p
        if not live:
            with torch.no_grad():
                full = recompute()
            got = (tuple(full.shape), tuple(full.stride()), full.storage_offset(), full.dtype, full.device)
            if got != layout:
                raise RuntimeError(f"recomputed tensor {got} does not have the saved one's layout {layout}")
            live.append(full)
        view = live[0].as_strided(p.shape, p.stride, p.offset)
        views[1] += 1
        if views[1] == views[0]:  # every view of this backward rebuilt: a second backward recomputes
            live.clear()
            views[1] = 0
        return view

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def column_blocks(parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The [rows, width] tensor whose adjacent column blocks, in order, are ``parts`` (each [rows, ...]
    with rows of that width, one dtype, one storage, no gaps), as a view of it; else None."""
    first = parts[0]
    rows, width = first.shape[0], first.stride(0)
    at = first.data_ptr()
    for p in parts:
        cols = p[0].numel() if rows else 0
        if (p.dtype != first.dtype or p.shape[0] != rows or p.stride(0) != width or p.data_ptr() != at
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or (rows and not p[0].is_contiguous())):
            return None
        at += cols * p.element_size()
    if rows == 0 or at - first.data_ptr() != width * first.element_size():
        return None
    return first.as_strided((rows, width), (width, 1))


class ColumnGrad:
    """One gradient buffer [rows, width] for the column blocks of ``split_columns(t, sizes, one_grad=True)``.

    A Function's backward may write its input block's gradient into the block's slice (``GradBlock.take``); the
    split's backward returns the buffer as t's gradient, no concatenation. A slice is handed out once a backward."""

    def __init__(self, t: torch.Tensor, sizes: tuple[int, ...]) -> None:
        self.rows, self.dtype, self.device = t.shape[0], t.dtype, t.device
        self.sizes = sizes
        self.buffer: torch.Tensor | None = None
        self.taken = [False] * len(sizes)

    def block(self, i: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.rows, sum(self.sizes), dtype=self.dtype, device=self.device)
        return self.buffer.split(self.sizes, dim=1)[i]

    def release(self) -> torch.Tensor | None:
        buf, self.buffer, self.taken = self.buffer, None, [False] * len(self.sizes)
        return buf


class GradBlock(NamedTuple):
    """A split block's place in its ``ColumnGrad`` (see there)."""

    grad: ColumnGrad
    index: int

    def take(self) -> torch.Tensor | None:
        """The block's slice of the gradient buffer [rows, size] (strided), or None once taken."""
        if self.grad.taken[self.index]:
            return None
        self.grad.taken[self.index] = True
        return self.grad.block(self.index)


def grad_block(t: torch.Tensor) -> GradBlock | None:
    """Where ``t``'s gradient may be written, if t is a block of ``split_columns(..., one_grad=True)``."""
    return getattr(t, "_aligned_grad_block", None)


class _Columns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, sizes: tuple[int, ...], grad: ColumnGrad | None) -> tuple[torch.Tensor, ...]:
        ctx.sizes, ctx.shape, ctx.dtype, ctx.grad = sizes, t.shape, t.dtype, grad
        return t.split(sizes, dim=1)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        buf = ctx.grad.release() if ctx.grad is not None else None
        if buf is not None:
            for g, blk in zip(grads, buf.split(ctx.sizes, dim=1)):
                if g is None:
                    blk.zero_()
                elif not (g.data_ptr() == blk.data_ptr() and g.stride() == blk.stride() and g.shape == blk.shape):
                    blk.copy_(g)
            return buf, None, None
        if all(g is not None for g in grads) and (whole := column_blocks(grads)) is not None \
                and whole.dtype == ctx.dtype and whole.shape == ctx.shape:
            return whole, None, None
        rows = ctx.shape[0]
        parts = [g if g is not None else torch.zeros(rows, s, dtype=ctx.dtype, device=grads[0].device)
                 for g, s in zip(grads, ctx.sizes)] if any(g is not None for g in grads) else None
        return (torch.cat(parts, 1) if parts is not None else None), None, None


def split_columns(t: torch.Tensor, sizes: tuple[int, ...], *, one_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """``t.split(sizes, dim=1)`` for t [rows, sum(sizes)]; gradients arriving as adjacent column blocks of one buffer
    (the scan's x, B, C) are t's gradient as they lie. ``one_grad``: producers may write one (``ColumnGrad``)."""
    if not grad_needed(t):
        return t.split(sizes, dim=1)
    grad = ColumnGrad(t, tuple(sizes)) if one_grad else None
    parts = _Columns.apply(t, tuple(sizes), grad)
    if grad is not None:
        for i, p in enumerate(parts):
            p._aligned_grad_block = GradBlock(grad, i)
    return parts
