"""The one backend resolver: which form of every op a contract runs, with which configs.

Layers call ops only through a ``Backend`` (``resolve(contract, device)``), never by testing the
backend's name: the linear layers, the norms, the causal conv, the SSD advance and log-softmax of
one model all come from here, launched with the contract's kernel configs. Trainer and sampler
resolve the same contract, so they run the same kernels with the same configs.

A backend is one table from op to form (``Ops``), built once, each entry an op's one signature
bound to the backend's configs; a form lives in its op's folder (``ops/<op>/``):

- ``TorchBackend``: the torch forms (the readable statement of each op's arithmetic): fixed-tile
  GEMMs, fixed-tree reductions, IEEE-only transcendentals.
- ``CPUBackend``: the torch backend on the CPU (contract name "torch", the same bits): its table
  points at the ops' CPU forms (``<op>/cpu.py``, the loops of ``native_cpu.c``) where the library
  loads, chosen here once, not inside each torch form.
- ``TritonBackend``: Triton kernels with the contract's ``TritonKernelConfigs``. On a CUDA device
  every op is a Triton kernel: the tensor-core GEMM, the fused norms (the residual add and the
  embedding gather folded in), the causal conv, the scan, log-softmax. Under the Triton
  interpreter (``TRITON_INTERPRET=1``, the CPU tests) the scan runs its Triton kernels and the
  other ops the CPU backend's forms: the interpreter is a logic check (it runs one program in
  ~15 ms and computes bf16 arithmetic in fp32), not the GPU's bits.
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
    """One backend's form of every op. Shapes and dtypes are those of the torch forms (each entry
    names its op's folder); every form is row-invariant: a row's bits depend on that row's inputs
    only, never on how many rows share the call."""

    #: a linear layer's weight [N, K] as this backend's ``linear`` takes it (differentiable)
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
    #: (state, step, x, dt, B, C, params, rows=None) -> y [T, H, P] in x's dtype; updates state
    #: (``ssd``'s replay forms: the advance from the slots' boundary states)
    ssd_advance: Callable[..., Tensor]
    #: (logits [..., V], temperature=1.0) -> [..., V] float32 logprobs of logits / temperature (``logprobs``)
    log_softmax: Callable[..., Tensor]
    #: relu(x)^2 in x's dtype, any shape (``elementwise``)
    relu2: Callable[[Tensor], Tensor]
    #: (q [T, H, D], k, v [T, G, D], k_cache, v_cache [slots, max_len, G, D], step, *, scale,
    #: block_table=None) -> [T, H, D] in q's dtype: the new keys and values written at each token's slot
    #: and position, then the new rows attend over their slot's keys 0 .. position (``attention``);
    #: with block_table [slots, max_blocks] (device) the caches are pages [num_pages, page_size, G, D]
    attention: Callable[..., Tensor]
    #: (q [Tq, H, D], k, v [Tk, G, D], cu_seqlens_q, cu_seqlens_k [S+1] host ints, plan, *, scale) ->
    #: [Tq, H, D]: ``attention``'s signature over packed keys (an engine's paged cache gathered);
    #: plan: the blocked form's tables (the torch form's; others ignore it)
    attention_packed: Callable[..., Tensor]
    #: (h [T, d], experts [T, k] int64 ascending, weights [T, k] fp32, up_w, down_w, up_b=None,
    #: down_b=None) -> [T, d] in h's dtype: a MoE layer's routed experts (``moe``); up_w[e] [f, d],
    #: down_w[e] [d, f] in ``linear_weight``'s form, stacked [E, f, d] / [E, d, f] tensors where
    #: ``stacked_experts``; per-expert fp32 biases or None
    moe_experts: Callable[..., Tensor]
    #: whether ``moe_experts`` takes every expert's weights stacked rather than one list entry per expert
    stacked_experts: bool = False
    #: (x [M, d], up_w [f, d], up_b, down_w [d, f], down_b) -> [M, d]: the squared-ReLU MLP with the bits of
    #: ``linear(relu2(linear(x, up_w, up_b)), down_w, down_b)`` in fewer passes (``linear.triton_relu2``).
    #: None: the MLP composes those three ops itself
    mlp_relu2: Callable[..., Tensor] | None = None
    #: (y, z [M, d], norm_w, eps, n_groups, w [N, d], b) -> [M, N]: ``linear(gated_rms_norm(y, z, norm_w, eps,
    #: n_groups), w, b)`` with those ops' bits, whose backward forms the norm's output again in the norm's
    #: backward pass rather than hold it (``norm.triton``). None: the mixer composes the two ops
    gated_norm_linear: Callable[..., Tensor] | None = None
    #: x [M, k] @ w [N, k]^T -> [M, N] float32, not rounded: ``linear`` before its bias and rounding, a
    #: row-parallel layer's partial over one K slice (``linear.sliced``); w raw or from ``linear_weight``.
    #: None where the backend has no such form (the layers then refuse row_parallel_slices > 1)
    linear_partial: Callable[[Tensor, Tensor], Tensor] | None = None
    #: (x [M, k], w [N, k], b [N] | None, slices, out_dtype) -> [M, N] in out_dtype: a row-parallel rank's
    #: subtree in one call, ``slices`` contiguous K slices each summed from zero in fp32, joined by
    #: adjacent pairs, + b in fp32, rounded once (``linear.sliced``'s ``tree``; w from ``linear_weight``,
    #: the rank's whole K). None: the layers sum ``linear_partial``'s slices by the same tree instead
    linear_tree: Callable[..., Tensor] | None = None
    #: (y, z [M, d / k], w, eps, n_groups, *, slices, group) -> [M, d / k]: ``gated_rms_norm`` with each
    #: group's sum of squares in the contract's fixed slices, a group split across ranks joined over an
    #: all-gather (``norm``; the same bits at every TP degree dividing the slices); None as above
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
        log_softmax=logprobs.log_softmax, relu2=elementwise.relu2,
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

    return Ops(
        linear_weight=lambda w: w.contiguous(),
        linear=functools.partial(linear_triton.linear, cfg=c),
        linear_partial=functools.partial(triton_tree.linear_partial, cfg=c),
        linear_tree=functools.partial(triton_tree.linear_tree, cfg=c),
        # the torch form on the device: elementwise ops and fixed-tree adds, each element's operations
        # the same wherever it sits, so every TP degree dividing the slices gives the same bits
        # (tests/ops/linear/test_linear_tree.py, its gpu tests); no Triton kernel of the sliced norm yet
        gated_rms_norm_sliced=norm.gated_rms_norm_sliced,
        rms_norm=functools.partial(norm_triton.rms_norm, cfg=c),
        embed_norm=functools.partial(norm_triton.embed_norm, cfg=c),
        add_norm=functools.partial(norm_triton.add_norm, cfg=c),
        gated_rms_norm=functools.partial(norm_triton.gated_rms_norm, cfg=c),
        # a decode step's conv in one launch (conv_step_triton), any other step's in two
        conv_advance=functools.partial(conv_triton.conv_advance_decode, cfg=c),
        ssd_advance=ssd_advance,
        log_softmax=functools.partial(logprobs_triton.log_softmax, cfg=c),
        relu2=functools.partial(elementwise_triton.relu2, cfg=c),
        attention=functools.partial(attention_triton.attention, cfg=c),
        attention_packed=functools.partial(attention_triton.attention_packed, cfg=c),
        moe_experts=functools.partial(moe_triton.moe_experts, cfg=c), stacked_experts=True,
        mlp_relu2=functools.partial(linear_relu2.mlp_relu2, cfg=c),
        gated_norm_linear=functools.partial(norm_triton.gated_norm_linear, cfg=c),
    )


class Backend:
    """The ops of one contract on one device: ``ops``, its table, whose entries are also its
    attributes (``backend.linear(x, w, b)``), set once here."""

    name: str
    configs: TorchKernelConfigs | TritonKernelConfigs
    ops: Ops

    def __init__(self, configs: TorchKernelConfigs | TritonKernelConfigs, device: torch.device, ops: Ops) -> None:
        self.configs = configs
        self.device = device
        self.ops = ops
        self.__dict__.update((f.name, getattr(ops, f.name)) for f in dataclasses.fields(ops))

    def replace(self, **forms: Callable[..., Any]) -> Backend:
        """This backend with the named ops' forms replaced (the baseline's scan, say). A new ``linear``
        reaches the experts' form too where that form was bound to the old one, and a new ``linear`` or
        ``relu2`` the MLP (its fused form is dropped)."""
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
    """Triton kernels with the contract's configs. ``kernels``: run every op's kernel (default: on a
    CUDA device; the interpreter runs the scan's alone, and a test can ask for all)."""

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
    """The backend of ``contract`` on ``device`` (default: CUDA for the triton backend when there is
    one, else the CPU). One object per (contract, device): every model and hook shares it. The torch
    backend on the CPU is the ``CPUBackend`` where the loops' library loads."""
    if device is None:
        device = "cuda" if contract.backend == "triton" and torch.cuda.is_available() else "cpu"
    return _resolve(contract, torch.device(device))


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
