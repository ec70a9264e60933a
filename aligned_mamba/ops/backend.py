"""The one backend resolver: which implementation of every op a contract runs, with which configs.

Layers call ops only through a ``Backend`` (``resolve(contract, device)``), never by testing the
backend's name: the linear layers, the norms, the causal conv, the SSD advance and log-softmax of
one model all come from here, launched with the contract's kernel configs. Trainer and sampler
resolve the same contract, so they run the same kernels with the same configs.

- ``TorchBackend``: torch ops (the CPU path, and the readable statement of each op's arithmetic):
  fixed-tile GEMMs, fixed-tree reductions, IEEE-only transcendentals (``ops.elementwise``).
- ``TritonBackend``: Triton kernels with the contract's ``TritonKernelConfigs``. On a CUDA device
  every op is a Triton kernel where one exists. Under the Triton interpreter (``TRITON_INTERPRET=1``,
  the CPU tests) the scan runs its Triton kernels and the other ops their torch forms: the
  interpreter is a logic check (it runs one program in ~15 ms and computes bf16 arithmetic in
  fp32), not the GPU's bits.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch

from ..errors import AlignedMambaError
from . import conv1d as _conv
from . import linear as _linear
from . import logprobs as _logprobs
from . import norm as _norm
from .configs import TorchKernelConfigs, TritonKernelConfigs
from .ssd.chunk import replay_chunk
from .ssd.state import SSDState, SSMParams, Step

if TYPE_CHECKING:
    from ..contract import Contract


class Backend:
    """The ops of one contract on one device. Shapes and dtypes are those of the torch ops in
    ``ops/`` (each method names its module); every method is row-invariant: a row's bits depend
    on that row's inputs only, never on how many rows share the call."""

    name: str
    configs: TorchKernelConfigs | TritonKernelConfigs

    def __init__(self, configs: TorchKernelConfigs | TritonKernelConfigs, device: torch.device) -> None:
        self.configs = configs
        self.device = device

    # -- weights ------------------------------------------------------------------------------------
    def linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A linear layer's weight [N, K] as this backend's ``linear`` takes it (differentiable)."""
        raise NotImplementedError

    # -- ops ----------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w [N, K]^T (+ b [N]) -> [M, N] in x's dtype (``ops.linear``); w from ``linear_weight``."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """[M, d] -> [M, d] in ``out_dtype`` (``ops.norm.rms_norm``)."""
        return _norm.rms_norm(x, w, eps, out_dtype)

    def gated_rms_norm(self, y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                       n_groups: int) -> torch.Tensor:
        """norm_g(y * silu(z)) * w, [M, d] -> [M, d] in y's dtype (``ops.norm.gated_rms_norm``)."""
        return _norm.gated_rms_norm(y, z, w, eps, n_groups)

    def conv_advance(self, windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor | None) -> torch.Tensor:
        """Causal conv1d + SiLU of the step's new rows x [T, Cd] from each slot's window
        (windows [slots, K-1, Cd], updated in place); [T, Cd] in x's dtype (``ops.conv1d``)."""
        slots = step.slots.to(windows.device)
        out, window = _conv.causal_conv1d(x, step.cu_seqlens, windows[slots], w, b)
        windows[slots] = window
        return out

    def ssd_advance(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The replay advance (``ops.ssd`` replay forms): y [T, H, P] in x's dtype; updates ``state``."""
        raise NotImplementedError

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] -> [..., V] float32 (``ops.logprobs``)."""
        return _logprobs.log_softmax(logits)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.configs}, device={self.device})"


class TorchBackend(Backend):
    name = "torch"
    configs: TorchKernelConfigs

    def linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        # fp32 once, not per call: the GEMM takes fp32 operands (exact for bf16 values)
        return w.to(torch.float32)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return _linear.linear(x, w, b, self.configs.linear_row_tile)

    def ssd_advance(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        return replay_chunk(state, step, x, dt, B, C, params, rows=rows, cfg=self.configs)


class TritonBackend(Backend):
    name = "triton"
    configs: TritonKernelConfigs

    def __init__(self, configs: TritonKernelConfigs, device: torch.device) -> None:
        super().__init__(configs, device)
        self.compiled = device.type == "cuda"
        if not self.compiled and os.environ.get("TRITON_INTERPRET") != "1":
            raise AlignedMambaError("backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for a slow CPU run)")
        try:
            from .ssd import triton_chunk, triton_decode
        except ImportError as e:
            raise AlignedMambaError(f"backend 'triton' needs the triton package ({e}): pip install triton") from None
        self._chunk, self._decode = triton_chunk, triton_decode
        self._torch_ops = TorchBackend(TorchKernelConfigs(), device)  # the interpreter's stand-ins

    def linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w.to(torch.float32) if not self.compiled else w

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if not self.compiled:
            return self._torch_ops.linear(x, w, b)
        from .linear_triton import linear_triton

        return linear_triton(x, w, b, self.configs)

    def ssd_advance(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.compiled and bool((step.lengths == 1).all()):
            # a decode-only step: the fused kernels compute just the new rows with the prefill's
            # arithmetic and touch the boundary state only when a chunk completes
            return self._decode.replay_decode_triton(state, step, x, dt, B, C, params, rows=rows, cfg=self.configs)
        return self._chunk.replay_chunk_triton(state, step, x, dt, B, C, params, rows=rows, cfg=self.configs)


_BACKENDS = {"torch": TorchBackend, "triton": TritonBackend}


def resolve(contract: Contract, device: torch.device | str | None = None) -> Backend:
    """The backend of ``contract`` on ``device`` (default: CUDA for the triton backend when there is
    one, else the CPU). One object per (contract, device): every model and hook shares it."""
    if device is None:
        device = "cuda" if contract.backend == "triton" and torch.cuda.is_available() else "cpu"
    return _resolve(contract, torch.device(device))


@functools.cache
def _resolve(contract: Contract, device: torch.device) -> Backend:
    return _BACKENDS[contract.backend](contract.kernel_configs, device)


def choose_backend(requested: str = "auto") -> str:
    """A backend name for a run: "auto" is triton where a CUDA device and Triton are present, else
    torch; "triton" is refused (one line) without a CUDA device (or TRITON_INTERPRET=1) or triton."""
    if requested not in ("auto", *_BACKENDS):
        raise AlignedMambaError(f"backend {requested!r} refused: expected auto, {', '.join(_BACKENDS)}")
    if requested == "auto":
        return "triton" if torch.cuda.is_available() and _has_triton() else "torch"
    if requested == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise AlignedMambaError("backend 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1 for a slow CPU run)")
    if requested == "triton" and not _has_triton():
        raise AlignedMambaError("backend 'triton' needs the triton package: pip install triton")
    return requested


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["Backend", "TorchBackend", "TritonBackend", "choose_backend", "resolve"]
