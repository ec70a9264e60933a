"""The one backend resolver: which form of every op a contract runs, with which configs.

Layers call ops only through a ``Backend`` (``resolve``): one table (``Ops``) from op to form, bound to the
contract's kernel configs. The three backends: docs/design.md, "Backends".
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AlignedMambaError
from . import conv1d, elementwise, linear, logprobs, native, norm
from .attention import blocked as attention_blocked
from .configs import TorchKernelConfigs, TritonKernelConfigs
from .moe import grouped as moe_grouped
from .ssd import decode
from .step import Step

if TYPE_CHECKING:
    from ..contract import Contract

Tensor = torch.Tensor


@dataclass(frozen=True)
class Ops:
    """One backend's form of every op, each row-invariant; shapes and dtypes as the torch forms' (the
    op's folder in parentheses)."""

    #: w [N, K] -> the weight as this backend's ``linear`` takes it (differentiable)
    linear_weight: Callable[[Tensor], Tensor]
    #: x [M, K] @ w [N, K]^T (+ b [N]) -> [M, N] in x's dtype (``linear``); w from ``linear_weight``
    linear: Callable[..., Tensor]
    #: (x [M, d], w, eps, out_dtype) -> [M, d] in out_dtype (``norm``)
    rms_norm: Callable[[Tensor, Tensor, float, torch.dtype], Tensor]
    #: (token_ids [T], embedding, w, eps, dtype, residual_dtype) -> (normed [T, d], residual [T, d]) (``norm``)
    embed_norm: Callable[..., tuple[Tensor, Tensor]]
    #: (x, residual [M, d], w, eps, dtype) -> (normed [M, d] in dtype, residual + x) (``norm``)
    add_norm: Callable[..., tuple[Tensor, Tensor]]
    #: (y, z [M, d], w, eps, n_groups) -> norm_g(y * silu(z)) * w [M, d] in y's dtype (``norm``)
    gated_rms_norm: Callable[[Tensor, Tensor, Tensor, float, int], Tensor]
    #: (windows [slots, K-1, Cd], step, x [T, Cd], w, b) -> [T, Cd]; windows updated in place (``conv1d``)
    conv_advance: Callable[[Tensor, Step, Tensor, Tensor, Tensor | None], Tensor]
    #: (state, step, x, dt, B, C, params, rows=None) -> y [T, H, P] in x's dtype; advances state (``ssd``)
    ssd_advance: Callable[..., Tensor]
    #: (logits [..., V], temperature=1.0) -> [..., V] float32 logprobs of logits / temperature (``logprobs``)
    log_softmax: Callable[..., Tensor]
    #: (logits [..., V], token_ids [...], temperature=1.0) -> [...] float32: ``log_softmax``'s entries (``logprobs``)
    token_logprobs: Callable[..., Tensor]
    #: (local logits [..., V / S], token_ids [...] global, shard_index, shard_count, all_gather, temperature=1.0) ->
    #: [...] float32, ``token_logprobs``'s bits on every shard; each shard's gradient its own columns (``logprobs``)
    token_logprobs_sharded: Callable[..., Tensor]
    #: relu(x)^2 in x's dtype, any shape (``elementwise``)
    relu2: Callable[[Tensor], Tensor]
    #: (q [T, H, D], k, v [T, G, D], k_cache, v_cache [slots, max_len, G, D], step, *, scale, block_table=None)
    #: -> [T, H, D]: stores k, v, then attends over the slot's keys 0..t (``attention``; paged with block_table)
    attention: Callable[..., Tensor]
    #: (q [Tq, H, D], k, v [Tk, G, D], cu_seqlens_q, cu_seqlens_k [S+1] host ints, plan, *, scale) -> [Tq, H, D]:
    #: ``attention`` over packed keys (an engine's pages gathered); plan: the torch form's tables (others ignore it)
    attention_packed: Callable[..., Tensor]
    #: (h [T, d], experts [T, k] int64 ascending, weights [T, k] fp32, up_w, down_w, up_b=None, down_b=None) ->
    #: [T, d] in h's dtype (``moe``); up_w[e] [f, d], down_w[e] [d, f] as ``linear_weight`` gives, fp32 biases
    moe_experts: Callable[..., Tensor]
    #: whether ``moe_experts`` takes every expert's weights stacked ([E, f, d], [E, d, f]); it also takes lists
    #: (a trainer's parameters, read in place)
    stacked_experts: bool = False
    #: (x [M, d], up_w [f, d], up_b, down_w [d, f], down_b) -> [M, d]: the composed MLP's bits, fused; or None
    mlp_relu2: Callable[..., Tensor] | None = None
    #: (y, z [M, d], norm_w, eps, n_groups, w [N, d], b) -> [M, N]: linear(gated_rms_norm(...))'s bits; or None
    gated_norm_linear: Callable[..., Tensor] | None = None
    #: x [M, k] @ w [N, k]^T -> [M, N] fp32, unrounded, no bias: a row-parallel slice; None: TP slices refused
    linear_partial: Callable[[Tensor, Tensor], Tensor] | None = None
    #: (x [M, k], w [N, k], b [N] | None, slices, out_dtype) -> [M, N]: a rank's subtree in one call, ``slices``
    #: K slices in fp32 joined by adjacent pairs, + b, rounded once (``linear.sliced.tree``); None: the layers do it
    linear_tree: Callable[..., Tensor] | None = None
    #: (y, z [M, d / k], w, eps, n_groups, *, slices, group) -> [M, d / k]: ``gated_rms_norm`` over TP slices
    gated_rms_norm_sliced: Callable[..., Tensor] | None = None


def torch_ops(c: TorchKernelConfigs) -> Ops:
    """The torch forms, bound to configs ``c``."""
    gemm = functools.partial(linear.linear, row_tile=c.linear_row_tile, form=c.gemm_form)
    return Ops(
        linear_partial=functools.partial(linear.partial, row_tile=c.linear_row_tile, form=c.gemm_form),
        # padded once, not per call (and fp32 for the tiles' GEMM)
        linear_weight=functools.partial(linear.gemm_weight, form=c.gemm_form),
        linear=gemm,
        rms_norm=norm.rms_norm, embed_norm=norm.embed_norm, add_norm=norm.add_norm,
        gated_rms_norm=norm.gated_rms_norm, gated_rms_norm_sliced=norm.gated_rms_norm_sliced,
        conv_advance=conv1d.conv_advance,
        ssd_advance=functools.partial(decode.replay, cfg=c),
        log_softmax=logprobs.log_softmax, token_logprobs=logprobs.token_logprobs,
        token_logprobs_sharded=logprobs.token_logprobs_sharded, relu2=elementwise.relu2,
        attention=attention_blocked.attention, attention_packed=attention_blocked.attention_packed,
        moe_experts=functools.partial(moe_grouped.experts_grouped, linear=gemm, relu2=elementwise.relu2),
    )


def cpu_ops(c: TorchKernelConfigs) -> Ops:
    """The torch forms with the CPU forms (``native_cpu.c``'s loops, the same bits) where an op has one."""
    from .conv1d import cpu as conv_cpu
    from .linear import cpu as linear_cpu
    from .norm import cpu as norm_cpu
    from .ssd import cpu_decode

    gemm = functools.partial(linear_cpu.linear, row_tile=c.linear_row_tile, form=c.gemm_form)
    return dataclasses.replace(
        torch_ops(c),
        linear=gemm,
        moe_experts=functools.partial(moe_grouped.experts_grouped, linear=gemm, relu2=elementwise.relu2),
        rms_norm=norm_cpu.rms_norm, embed_norm=norm_cpu.embed_norm, add_norm=norm_cpu.add_norm,
        gated_rms_norm=norm_cpu.gated_rms_norm,
        conv_advance=conv_cpu.conv_advance,
        ssd_advance=functools.partial(cpu_decode.replay, cfg=c),
    )


def triton_ops(c: TritonKernelConfigs, kernels: bool) -> Ops:
    """The Triton forms bound to configs ``c``: every op's kernel where ``kernels`` (a CUDA device),
    else the scan's alone and the CPU backend's forms for the others (the interpreter)."""
    from .ssd import triton_backward

    ssd_advance = functools.partial(triton_backward.ssd_advance, cfg=c)
    if not kernels:
        cpu = cpu_ops(TorchKernelConfigs())  # the interpreter's stand-ins
        # the stand-in GEMM takes fp32 weights (the tensor-core GEMM takes the model dtype's as they are)
        return dataclasses.replace(cpu, linear_weight=lambda w: w.to(torch.float32), ssd_advance=ssd_advance)
    from .attention import triton as attention_triton
    from .conv1d import triton as conv_triton
    from .elementwise import triton as elementwise_triton
    from .linear import triton as linear_triton
    from .linear import triton_relu2 as linear_relu2
    from .linear import triton_tree
    from .logprobs import triton as logprobs_triton
    from .moe import triton as moe_triton
    from .norm import triton as norm_triton
    from .norm import triton_sliced as norm_triton_sliced

    return Ops(
        linear_weight=lambda w: w.contiguous(),
        linear=functools.partial(linear_triton.linear, cfg=c),
        linear_partial=functools.partial(triton_tree.linear_partial, cfg=c),
        linear_tree=functools.partial(triton_tree.linear_tree, cfg=c),
        gated_rms_norm_sliced=functools.partial(norm_triton_sliced.gated_rms_norm_sliced, cfg=c),
        rms_norm=functools.partial(norm_triton.rms_norm, cfg=c),
        embed_norm=functools.partial(norm_triton.embed_norm, cfg=c),
        add_norm=functools.partial(norm_triton.add_norm, cfg=c),
        gated_rms_norm=functools.partial(norm_triton.gated_rms_norm, cfg=c),
        # a decode step's conv in one launch (conv_step_triton), any other step's in two
        conv_advance=functools.partial(conv_triton.conv_advance_decode, cfg=c),
        ssd_advance=ssd_advance,
        log_softmax=functools.partial(logprobs_triton.log_softmax, cfg=c),
        token_logprobs=functools.partial(logprobs_triton.token_logprobs, cfg=c),
        token_logprobs_sharded=functools.partial(logprobs_triton.token_logprobs_sharded, cfg=c),
        relu2=functools.partial(elementwise_triton.relu2, cfg=c),
        attention=functools.partial(attention_triton.attention, cfg=c),
        attention_packed=functools.partial(attention_triton.attention_packed, cfg=c),
        moe_experts=functools.partial(moe_triton.moe_experts, cfg=c), stacked_experts=True,
        mlp_relu2=functools.partial(linear_relu2.mlp_relu2, cfg=c),
        gated_norm_linear=functools.partial(norm_triton.gated_norm_linear, cfg=c),
    )


class Backend:
    """The ops of one contract on one device: the table ``ops``, its entries also attributes (``backend.linear``)."""

    name: str
    configs: TorchKernelConfigs | TritonKernelConfigs
    ops: Ops

    def __init__(self, configs: TorchKernelConfigs | TritonKernelConfigs, device: torch.device, ops: Ops) -> None:
        self.configs = configs
        self.device = device
        self.ops = ops
        self.__dict__.update((f.name, getattr(ops, f.name)) for f in dataclasses.fields(ops))

    def replace(self, **forms: Callable[..., Any]) -> Backend:
        """This backend with the named ops' forms replaced (the baseline's scan, say); a new ``linear`` reaches
        the experts' form, and a fused form that would bypass a new one is dropped."""
        experts = self.ops.moe_experts
        if ("linear" in forms and "moe_experts" not in forms and isinstance(experts, functools.partial)
                and experts.keywords.get("linear") is self.ops.linear):
            forms["moe_experts"] = functools.partial(experts, linear=forms["linear"])
        if ("linear" in forms or "relu2" in forms) and "mlp_relu2" not in forms:
            forms["mlp_relu2"] = None  # the fused MLP would bypass the new form: the MLP composes them
        if ("linear" in forms or "gated_rms_norm" in forms) and "gated_norm_linear" not in forms:
            forms["gated_norm_linear"] = None  # likewise the mixer's norm and out_proj
        new = copy.copy(self)
        Backend.__init__(new, self.configs, self.device, dataclasses.replace(self.ops, **forms))
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.configs}, device={self.device})"


class TorchBackend(Backend):
    """The torch forms (any device the torch ops run on; ``resolve`` gives the CPU the C loops)."""

    name = "torch"
    configs: TorchKernelConfigs

    def __init__(self, configs: TorchKernelConfigs, device: torch.device) -> None:
        super().__init__(configs, device, torch_ops(configs))


class CPUBackend(Backend):
    """The torch backend on the CPU with the ops' CPU forms (the same bits as ``TorchBackend``)."""

    name = "torch"
    configs: TorchKernelConfigs

    def __init__(self, configs: TorchKernelConfigs, device: torch.device) -> None:
        super().__init__(configs, device, cpu_ops(configs))


class TritonBackend(Backend):
    """Triton kernels with the contract's configs; ``kernels``: every op's (default: on CUDA, else the scan's)."""

    name = "triton"
    configs: TritonKernelConfigs

    def __init__(self, configs: TritonKernelConfigs, device: torch.device, *, kernels: bool | None = None) -> None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise AlignedMambaError("backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for a slow CPU run)")
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise AlignedMambaError(f"backend 'triton' needs the triton package ({e}): pip install triton") from None
        super().__init__(configs, device, triton_ops(configs, device.type == "cuda" if kernels is None else kernels))


_BACKENDS: dict[str, Callable[[Any, torch.device], Backend]] = {"torch": TorchBackend, "triton": TritonBackend}


def resolve(contract: Contract, device: torch.device | str | None = None) -> Backend:
    """The backend of ``contract`` on ``device`` (default: CUDA for triton where there is one, else the CPU),
    one object per (contract, device); the torch backend on the CPU is ``CPUBackend`` where the loops load."""
    if device is None:
        device = "cuda" if contract.backend == "triton" and torch.cuda.is_available() else "cpu"
    return _resolve(contract, torch.device(device))


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0,
                   contract: Contract | None = None) -> Tensor:
    """The contract's logprob of ``token_ids`` [...] under ``logits`` [..., V] / temperature -> [...] fp32: its
    backend's log-softmax entries on the logits' device (no contract: triton on a CUDA tensor, else torch). Trainers,
    engines, vLLM's plugin and ``check`` all read it (docs/design.md, "How the bits are kept", Logprobs)."""
    return resolve(_or_default(contract, logits), logits.device).token_logprobs(logits, token_ids, temperature)


def token_logprobs_sharded(local_logits: Tensor, token_ids: Tensor, shard_index: int, shard_count: int,
                           all_gather: Callable[[Tensor], Any], temperature: float = 1.0,
                           contract: Contract | None = None) -> Tensor:
    """``token_logprobs`` from a vocabulary shard [..., V / S] (``Ops.token_logprobs_sharded``): the unsharded bits on
    every shard, differentiable; the backend as ``token_logprobs`` picks it."""
    return resolve(_or_default(contract, local_logits), local_logits.device).token_logprobs_sharded(
        local_logits, token_ids, shard_index, shard_count, all_gather, temperature)


def _or_default(contract: Contract | None, logits: Tensor) -> Contract:
    """``contract``, or without one: triton on a CUDA tensor, else torch."""
    if contract is not None:
        return contract
    from ..contract import Contract

    return Contract(chunk_size=256, backend="triton" if logits.is_cuda else "torch")


@functools.cache
def _resolve(contract: Contract, device: torch.device) -> Backend:
    if contract.backend == "torch" and device.type == "cpu" and native.library() is not None:
        return CPUBackend(contract.kernel_configs, device)
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


__all__ = ["Backend", "CPUBackend", "Ops", "TorchBackend", "TritonBackend", "choose_backend", "resolve"]
