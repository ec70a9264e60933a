"""The one backend resolver: which implementation of every op a contract runs, with which configs.

Layers call ops only through a ``Backend`` (``resolve(contract, device)``), never by testing the
backend's name: the linear layers, the norms, the causal conv, the SSD advance and log-softmax of
one model all come from here, launched with the contract's kernel configs. Trainer and sampler
resolve the same contract, so they run the same kernels with the same configs.

- ``TorchBackend``: torch ops (the CPU path, and the readable statement of each op's arithmetic):
  fixed-tile GEMMs, fixed-tree reductions, IEEE-only transcendentals (``ops.elementwise``).
- ``TritonBackend``: Triton kernels with the contract's ``TritonKernelConfigs``. On a CUDA device
  every op is a Triton kernel: the tensor-core GEMM, the fused norms (the residual add and the
  embedding gather folded in), the causal conv, the scan, log-softmax. Under the Triton
  interpreter (``TRITON_INTERPRET=1``, the CPU tests) the scan runs its Triton kernels and the
  other ops their torch forms: the interpreter is a logic check (it runs one program in ~15 ms
  and computes bf16 arithmetic in fp32), not the GPU's bits.
"""

from __future__ import annotations

import abc
import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AlignedMambaError
from . import conv1d as _conv
from . import linear as _linear
from . import logprobs as _logprobs
from . import native as _native
from . import norm as _norm
from .attention import blocked as _attn
from .configs import TorchKernelConfigs, TritonKernelConfigs
from .mlp import relu2 as _relu2
from .moe import grouped as _moe
from .ssd.chunk import replay_chunk
from .ssd.decode import replay_decode
from .ssd.plan import step_tables
from .ssd.state import SSDState, SSMParams, Step

if TYPE_CHECKING:
    from ..contract import Contract


class Backend(abc.ABC):
    """The ops of one contract on one device. Shapes and dtypes are those of the torch ops in
    ``ops/`` (each method names its module); every method is row-invariant: a row's bits depend
    on that row's inputs only, never on how many rows share the call."""

    name: str
    configs: TorchKernelConfigs | TritonKernelConfigs

    def __init__(self, configs: TorchKernelConfigs | TritonKernelConfigs, device: torch.device) -> None:
        self.configs = configs
        self.device = device

    # -- weights ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A linear layer's weight [N, K] as this backend's ``linear`` takes it (differentiable)."""

    # -- ops ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ w [N, K]^T (+ b [N]) -> [M, N] in x's dtype (``ops.linear``); w from ``linear_weight``."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        """[M, d] -> [M, d] in ``out_dtype`` (``ops.norm.rms_norm``)."""
        return _norm.rms_norm(x, w, eps, out_dtype)

    def embed_norm(self, token_ids: torch.Tensor, embedding: torch.Tensor, w: torch.Tensor, eps: float,
                   dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first block's input: residual = embedding[token_ids] in ``residual_dtype`` [T, d];
        normed = rms_norm(residual rounded to ``dtype``) [T, d] in ``dtype``. Returns (normed, residual)."""
        residual = embedding[token_ids].to(residual_dtype)
        return self.rms_norm(residual.to(dtype), w, eps, dtype), residual

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's residual add and the next norm: residual += x (in residual's dtype), normed =
        rms_norm(residual rounded to ``dtype``). x, residual [M, d]. Returns (normed, residual)."""
        residual = residual + x
        return self.rms_norm(residual.to(dtype), w, eps, dtype), residual

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

    @abc.abstractmethod
    def ssd_advance(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The replay advance (``ops.ssd`` replay forms): y [T, H, P] in x's dtype; updates ``state``."""

    def log_softmax(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """[..., V] -> [..., V] float32 logprobs of logits / temperature (``ops.logprobs``)."""
        return _logprobs.log_softmax(logits, temperature)

    def relu2(self, x: torch.Tensor) -> torch.Tensor:
        """relu(x)^2 in x's dtype, any shape (``ops.mlp.relu2``)."""
        return _relu2(x)

    #: whether ``moe_experts`` takes every expert's weights stacked ([E, f, d] / [E, d, f] tensors)
    #: rather than one ``linear_weight`` per expert
    stacked_experts: bool = False

    def moe_experts(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Any, down_w: Any,
                    up_b: Any = None, down_b: Any = None) -> torch.Tensor:
        """The routed experts of a MoE layer (``ops.moe``): h [T, d] (model dtype), experts [T, k] int64
        ascending, weights [T, k] fp32; up_w[e] [f, d], down_w[e] [d, f] in ``linear_weight``'s form
        (stacked tensors where ``stacked_experts``), per-expert fp32 biases or None. [T, d] in h's dtype."""
        return _moe.experts_grouped(h, experts, weights, up_w, down_w, up_b, down_b, linear=self.linear,
                                    relu2=self.relu2)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, batch: Any, *, scale: float) -> torch.Tensor:
        """One step of causal GQA attention over a slot cache (``ops.attention``): the new keys and
        values k, v [T, G, D] are written at each token's slot and position in k_cache, v_cache
        [slots, max_len, G, D] (model dtype, in place), then the new rows q [T, H, D] attend over
        their slot's keys 0 .. position. ``batch``: the step's ``replay.Batch`` (its tables are built
        once for every attention layer of the step). Returns [T, H, D] in q's dtype."""
        rep = q.shape[1] // k.shape[1]
        t = batch.derived(("attention", rep, q.device), lambda: _attn.cache_tables(batch, rep, q.device))
        return _attn.attention_cached(q, k, v, k_cache, v_cache, t, batch.cu_seqlens, scale=scale)

    def attention_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, plan: _attn.BlockedPlan | None, *, scale: float) -> torch.Tensor:
        """``ops.attention``'s signature over packed keys (an engine's paged cache gathered):
        q [Tq, H, D], k, v [Tk, G, D], cu_seqlens [S+1] host ints; ``plan`` the blocked form's tables
        (the torch form's; others ignore it). [Tq, H, D] in q's dtype."""
        return _attn.attention_blocked(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, plan=plan)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.configs}, device={self.device})"


class TorchBackend(Backend):
    name = "torch"
    configs: TorchKernelConfigs

    def linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        # padded once, not per call (and fp32 for the tiles' GEMM)
        return _linear.gemm_weight(w, self.configs.gemm_form)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        c = self.configs
        return _linear.linear(x, w, b, c.linear_row_tile, c.gemm_form)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # the add and the norm in one native loop where it applies: the base's bits
        fused = _native.rms_norm(x, w, eps, dtype, residual=residual)
        return super().add_norm(x, residual, w, eps, dtype) if fused is None else (fused[0], fused[1])

    def conv_advance(self, windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor | None) -> torch.Tensor:
        if not self._decode_only(step):
            return super().conv_advance(windows, step, x, w, b)
        slots = step.derived(("slots", windows.device), lambda: step.slots.to(windows.device))
        if (out := _native.conv_step(windows, slots, x, w, b)) is not None:  # the same bits, windows in place
            return out
        out, window = _conv.causal_conv1d_step(x, windows.index_select(0, slots), w, b)
        windows.index_copy_(0, slots, window)
        return out

    def ssd_advance(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self._decode_only(step):
            # the row tile holding each token, with the prefill's arithmetic (``ops.ssd.decode``)
            return replay_decode(state, step, x, dt, B, C, params, rows=rows, cfg=self.configs)
        return replay_chunk(state, step, x, dt, B, C, params, rows=rows, cfg=self.configs)

    @staticmethod
    def _decode_only(step: Step) -> bool:
        """Whether every sequence of the step brings exactly one token (worked out once per step)."""
        return step.derived(("one-token-each",), lambda: step.slots.numel() > 0 and bool((step.lengths == 1).all()))


class TritonBackend(Backend):
    name = "triton"
    configs: TritonKernelConfigs

    def __init__(self, configs: TritonKernelConfigs, device: torch.device) -> None:
        super().__init__(configs, device)
        self.compiled = device.type == "cuda"
        if not self.compiled and os.environ.get("TRITON_INTERPRET") != "1":
            raise AlignedMambaError("backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for a slow CPU run)")
        try:
            from . import triton_autograd
            from .ssd import triton_chunk, triton_decode
        except ImportError as e:
            raise AlignedMambaError(f"backend 'triton' needs the triton package ({e}): pip install triton") from None
        self._chunk, self._decode = triton_chunk, triton_decode
        # under autograd the kernels run inside Functions whose backward is the torch form's (only then:
        # the inference path calls the kernels directly)
        self._ag, self._grad = triton_autograd, triton_autograd.grad_needed
        self._torch_ops = TorchBackend(TorchKernelConfigs(), device)  # the interpreter's stand-ins
        if self.compiled:
            from . import elementwise_triton, logprobs_triton, norm_triton
            from .attention import triton as attention_triton
            from .attention import triton_backward as attention_backward
            from .conv1d_triton import causal_conv1d_triton
            from .linear_triton import linear_triton
            from .moe.triton import experts_triton

            self._linear, self._conv = linear_triton, causal_conv1d_triton
            self._norm, self._logprobs = norm_triton, logprobs_triton
            self._attn, self._attn_ag, self._elementwise = attention_triton, attention_backward, elementwise_triton
            self._experts, self.stacked_experts = experts_triton, True

    def linear_weight(self, w: torch.Tensor) -> torch.Tensor:
        # the tensor-core GEMM takes the model dtype's weights as they are (no fp32 copies)
        return w.to(torch.float32) if not self.compiled else w.contiguous()

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if not self.compiled:
            return self._torch_ops.linear(x, w, b)
        if self._grad(x, w, b):
            return self._ag.linear(x, w, b, self.configs)
        return self._linear(x, w, b, self.configs)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        if not self.compiled:
            return super().rms_norm(x, w, eps, out_dtype)
        if self._grad(x, w):
            return self._ag.rms_norm(x, w, eps, out_dtype, self.configs)
        return self._norm.rms_norm_triton(x, w, eps, out_dtype, self.configs)

    def embed_norm(self, token_ids: torch.Tensor, embedding: torch.Tensor, w: torch.Tensor, eps: float,
                   dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.compiled:
            return super().embed_norm(token_ids, embedding, w, eps, dtype, residual_dtype)
        if self._grad(embedding, w):
            return self._ag.embed_norm(token_ids, embedding, w, eps, dtype, residual_dtype, self.configs)
        return self._norm.embed_rms_norm_triton(token_ids, embedding, w, eps, dtype, residual_dtype, self.configs,
                                                norm_input_dtype=dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.compiled:
            return super().add_norm(x, residual, w, eps, dtype)
        if self._grad(x, residual, w):
            return self._ag.add_norm(x, residual, w, eps, dtype, self.configs)
        return self._norm.add_rms_norm_triton(x, residual, w, eps, dtype, self.configs, norm_input_dtype=dtype)

    def gated_rms_norm(self, y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float,
                       n_groups: int) -> torch.Tensor:
        if not self.compiled:
            return super().gated_rms_norm(y, z, w, eps, n_groups)
        if self._grad(y, z, w):
            return self._ag.gated_rms_norm(y, z, w, eps, n_groups, self.configs)
        return self._norm.gated_rms_norm_triton(y, z, w, eps, n_groups, self.configs)

    def conv_advance(self, windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor | None) -> torch.Tensor:
        if not self.compiled:
            return super().conv_advance(windows, step, x, w, b)
        dev = windows.device
        cu, slots = step_tables(step, dev)
        if self._grad(x, w, b, windows):
            return self._ag.conv(x, cu, slots, windows, w, b, self.configs)
        return self._conv(x, cu, slots, windows, w, b, self.configs)

    def log_softmax(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        if not self.compiled or not logits.is_cuda:
            return super().log_softmax(logits, temperature)
        if temperature != 1.0:
            logits = _logprobs.scale(logits, temperature)
        if self._grad(logits):
            return self._ag.log_softmax(logits.reshape(-1, logits.shape[-1]), self.configs).reshape(logits.shape)
        return self._logprobs.log_softmax_triton(logits.reshape(-1, logits.shape[-1]), self.configs).reshape(
            logits.shape)

    def relu2(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return super().relu2(x)  # the same bits (one rounding of one IEEE multiply), differentiable
        if self._grad(x):  # the kernel, and a one-pass backward that saves only x
            return self._elementwise.relu2(x, self.configs)
        return self._elementwise.relu2_triton(x, self.configs)

    def moe_experts(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Any, down_w: Any,
                    up_b: Any = None, down_b: Any = None) -> torch.Tensor:
        if not self.compiled:
            return super().moe_experts(h, experts, weights, up_w, down_w, up_b, down_b)
        if up_b is not None or down_b is not None:
            raise AlignedMambaError("MoE expert biases on a CUDA device are refused: the grouped expert kernels have "
                                    "no bias term (mlp_bias MoE checkpoints run on the torch backend)")
        return self._experts(h, experts, weights, up_w, down_w, self.configs)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, batch: Any, *, scale: float) -> torch.Tensor:
        if not self.compiled:
            return super().attention(q, k, v, k_cache, v_cache, batch, scale=scale)
        grad = self._grad(q, k, v)
        if grad and bool((batch.start_pos != 0).any()):
            # the keys of earlier calls sit in the cache outside the autograd graph: their gradient would be lost
            raise AlignedMambaError("training attention over keys cached by an earlier call is refused on the GPU: "
                                    "the backward covers one pass from empty (every start_pos 0)")
        dev, rep = q.device, q.shape[1] // k.shape[1]
        if bool((batch.lengths == 1).all()):
            # a decode step: tables straight from the step's device slots and positions (a captured
            # step's are its static buffers, see decode_graph), one tile per sequence
            t = batch.derived(("attention-decode", dev), lambda: self._attn.decode_step_tables(
                batch.slots.to(dev), batch.start_pos.to(dev)))
        else:
            t = batch.derived(("attention-tiles", rep, dev), lambda: self._attn.step_tables(
                batch.slots, batch.start_pos, batch.cu_seqlens, rep, self.configs, dev))
        if grad:  # the same writes and launch, with the saved log-sum-exp and a Triton backward
            return self._attn_ag.attention_cached(q, k, v, k_cache, v_cache, t, batch.cu_seqlens, scale=scale,
                                                  cfg=self.configs)
        k_cache[t.write_slot, t.write_pos] = k
        v_cache[t.write_slot, t.write_pos] = v
        return self._attn.attention_triton(q, k_cache, v_cache, t.tiles, scale=scale, cfg=self.configs)

    def attention_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, plan: _attn.BlockedPlan | None, *, scale: float) -> torch.Tensor:
        if not self.compiled:
            return super().attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, plan, scale=scale)
        if self._grad(q, k, v):
            return self._attn_ag.attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, cfg=self.configs)
        return self._attn.attention_triton_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, cfg=self.configs)

    def ssd_advance(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self._grad(x, dt, B, C, params.A, params.D, params.dt_bias, state.ssm_state):
            return self._ag.ssd_advance(self._ssd_kernels, state, step, x, dt, B, C, params, rows, self.configs)
        return self._ssd_kernels(state, step, x, dt, B, C, params, rows)

    def _ssd_kernels(self, state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
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
