"""What the ops' autograd Functions share (each op's ``triton.py`` holds its own Function).

The triton backend runs each op with its kernel inside a ``torch.autograd.Function`` whose forward
is the kernel unchanged (the sampler's bits) and whose backward is the gradient of the op's torch
form at the saved inputs. Without one, autograd cannot see through a Triton launch: its outputs are
fresh tensors written by raw pointers, with no ``grad_fn``, so every parameter upstream of one
silently gets no gradient. Gradients are deterministic (no atomics; the embedding's repeated ids
take torch's sorting accumulation) but not row-invariant (nothing asks them to be). Not covered:
``torch.cumsum`` on CUDA, which torch does not promise deterministic (its row scans along the
chunk measured repeatable on the H200, ``benchmarks/bench_train_h200.py``), and cuBLAS,
deterministic run to run only for one stream and a fixed workspace
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``). On the CPU: bit-identical run to run with one intra-op
thread; with several, on a loaded machine, two backwards of the interpreted triton backend have
given different gradients for the first layer's in_proj and norm and the embedding (the torch op
whose threading does it is not isolated yet; benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
