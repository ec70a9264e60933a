"""The Mamba2 mixer: in_proj, causal conv1d + SiLU, the SSD scan, gated RMSNorm, out_proj.

Per-slot state: the scan's ``SSDState`` (docs/design.md, "The one idea") and the conv's last K - 1
inputs. Weight names as Hugging Face's ``Mamba2Mixer``, mamba_ssm's ``Mamba2`` and Megatron's
``MambaMixer``: in_proj.weight [(z | xBC | dt), hidden], conv1d.weight [conv_dim, 1, K], dt_bias,
A_log, D [H], norm.weight [intermediate], out_proj.weight [hidden, intermediate], optional biases.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError
from ..ops.autograd import grad_needed, recomputed_in_backward, saved_tensors_hooked, split_columns
from ..ops.backend import Backend
from ..ops.linear.sliced import row_parallel_linear, row_parallel_weight
from ..ops.ssd.state import SSDState, SSMParams
from ..ops.step import Step
from ..parallel import TPGroup, shared
from .base import StateSpec, take, take_optional


@dataclass(frozen=True)
class Mamba2MixerConfig:
    """One Mamba2 mixer: num_heads x head_dim the SSM width; state_size N; n_groups share B and C;
    conv_kernel K; use_bias: in/out_proj biases; norm_eps: the gated norm's; dt_limit: (lo, hi) clamp
    of dt after softplus."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    norm_eps: float = 1e-5
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv over xBC: intermediate_size + 2 * n_groups * state_size."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """Output rows of in_proj, laid out as [z: intermediate_size | xBC: conv_dim | dt: num_heads]."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight under the layer's prefix with its shape, in a fixed order."""
        d, h = self.intermediate_size, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"in_proj.weight": (self.in_proj_size, h)}
        if self.use_bias:
            shapes["in_proj.bias"] = (self.in_proj_size,)
        shapes["conv1d.weight"] = (self.conv_dim, 1, self.conv_kernel)
        if self.use_conv_bias:
            shapes["conv1d.bias"] = (self.conv_dim,)
        shapes.update({"dt_bias": (self.num_heads,), "A_log": (self.num_heads,), "D": (self.num_heads,),
                       "norm.weight": (d,), "out_proj.weight": (h, d)})
        if self.use_bias:
            shapes["out_proj.bias"] = (h,)
        return shapes


@dataclass
class Mamba2State:
    """One layer's slot-indexed state: the scan's replay state and conv_window [slots, K-1, conv_dim]
    (model dtype). ``tensors()`` gives the fields in ``Mamba2Mixer.state_spec`` order."""

    ssd: SSDState
    conv_window: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.ssd.named(), "conv_window": self.conv_window}

    def reset(self, slots: torch.Tensor) -> None:
        """Empty the given slots (one fill per field on the device, no host sync)."""
        self.ssd.reset(slots)
        self.conv_window.index_fill_(0, slots.to(self.conv_window.device), 0)


def state_spec(config: Mamba2MixerConfig, chunk_size: int, dtype: torch.dtype, *,
               bf16_copy: bool = False) -> StateSpec:
    """One slot's ssm_state, buf_x, buf_dt, buf_B, (``bf16_copy``) ssm_state_bf16, conv_window (no weights needed:
    engines size memory). ``bf16_copy``: the contract's ``kernel_configs.bf16_state_copy(dtype)``."""
    c = config
    ssd = SSDState.layout(heads=c.num_heads, head_dim=c.head_dim, groups=c.n_groups, state_size=c.state_size,
                          chunk_size=chunk_size, dtype=dtype, bf16_copy=bf16_copy)
    fields = [(name, shape, dt) for name, (shape, dt) in ssd.items()]
    fields.append(("conv_window", (c.conv_kernel - 1, c.conv_dim), dtype))
    return StateSpec(tuple(fields))


def _conv_again(be: Backend, windows: torch.Tensor, batch: Step, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None) -> torch.Tensor:
    """The conv's output [T, conv_dim] once more, from a copy of the windows as they were before it."""
    return be.conv_advance(windows.clone(), batch, x, w, b)


# bytes still free for held conv outputs in this context's forwards (None: no budget open)
_CONV_HOLD_BUDGET: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("conv_hold_budget",
                                                                                     default=None)


@contextlib.contextmanager
def hold_conv_outputs(budget_bytes: int) -> Iterator[list[int]]:
    """Inside the block, each Mamba2 layer that would recompute its conv in the backward holds the conv's
    output instead (``Mamba2Mixer.recompute_conv`` off for that layer) while it fits in what is left of
    ``budget_bytes`` (T x conv_dim x the model dtype's size a layer), in forward order: a trainer spends the
    memory it has below a peak on the conv's second launch, layer by layer. Bits are the same either way.
    Yields a one-element list: the bytes still free. ValueError for a negative budget."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"hold_conv_outputs: budget_bytes must be an int >= 0, got {budget_bytes!r}")
    left = [budget_bytes]
    token = _CONV_HOLD_BUDGET.set(left)
    try:
        yield left
    finally:
        _CONV_HOLD_BUDGET.reset(token)


def _hold_within_budget(nbytes: int) -> bool:
    """Whether ``nbytes`` of a conv output fit in the open budget (then taken from it)."""
    left = _CONV_HOLD_BUDGET.get()
    if left is None or nbytes > left[0]:
        return False
    left[0] -= nbytes
    return True


def _groups(config: Mamba2MixerConfig, group: TPGroup) -> range:
    """The B/C groups rank ``group.rank`` holds (``parallel.shared``)."""
    return shared(config.n_groups, group, "n_groups")


def local_config(config: Mamba2MixerConfig, group: TPGroup) -> Mamba2MixerConfig:
    """The mixer one rank runs: num_heads / k heads and its groups (``shard_weights``' shapes)."""
    if group.size == 1:  # the full mixer, without a copy (models are built every training step)
        return config
    if config.num_heads % group.size:
        raise ModelLoadError(f"num_heads {config.num_heads} cannot be split across {group.size} tensor-parallel ranks")
    return dataclasses.replace(config, num_heads=config.num_heads // group.size, n_groups=len(_groups(config, group)))


def shard_weights(config: Mamba2MixerConfig, tensors: Mapping[str, torch.Tensor], prefix: str,
                  group: TPGroup) -> dict[str, torch.Tensor]:
    """Rank ``group.rank``'s cut of a full checkpoint, under the full names: in_proj's rows [z | x | B |
    C | dt] of its heads and groups (as Megatron and vLLM lay it out), their conv, per-head and norm
    channels, out_proj's columns (its bias whole)."""
    c = config
    H, P, N, d, GN = c.num_heads, c.head_dim, c.state_size, c.intermediate_size, c.n_groups * c.state_size
    heads = range(group.rank * H // group.size, (group.rank + 1) * H // group.size)
    groups = _groups(c, group)
    ch = torch.arange(heads.start * P, heads.stop * P)
    bc = torch.arange(groups.start * N, groups.stop * N)
    hd = torch.arange(heads.start, heads.stop)
    xbc = torch.cat([ch, d + bc, d + GN + bc])
    rows = {"in_proj": torch.cat([ch, d + xbc, d + c.conv_dim + hd]), "conv1d": xbc}
    out: dict[str, torch.Tensor] = {}
    for name in c.weight_shapes():
        t = take(tensors, prefix, name)
        layer = name.split(".")[0]
        if layer in rows:
            t = t[rows[layer]]
        elif name in ("dt_bias", "A_log", "D"):
            t = t[hd]
        elif name == "norm.weight":
            t = t[ch]
        elif name == "out_proj.weight":
            t = t[:, ch]
        out[prefix + name] = t
    return out


class Mamba2Mixer:
    """A Mamba2 mixer on a backend, for the contract's chunk size and a model dtype: A = -exp(A_log),
    D and dt_bias fp32, the rest in the model dtype; every cast is differentiable, so a trainer can
    build it from its parameters on each forward. With ``tp``: ``config`` the full mixer's, ``tensors``
    this rank's (``shard_weights`` or a Megatron rank's), out_proj and the gated norm sliced over
    ``slices`` (docs/design.md, "How the bits are kept", Tensor parallelism). ModelLoadError for a
    state_size not a multiple of 4, heads not split by groups, or slices the backend lacks."""

    kind = "mamba2"
    #: recompute the conv's and gated norm's outputs in the backward (docs/design.md, "Backends"); off
    #: inside saved_tensors_hooks (checkpointing, offloading), which may mean to release their inputs
    recompute = True
    #: with ``recompute``, whether the conv runs again too; off, the scan holds the conv's output (x, B, C:
    #: conv_dim x 2 bytes a token and layer more at the peak) and the backward runs one conv launch less a layer;
    #: ``hold_conv_outputs`` turns it off layer by layer under a memory budget
    recompute_conv = True
    #: the row-parallel GEMM (``baseline.stock_tp_model`` puts stock tensor parallelism's in its place)
    row_parallel = staticmethod(row_parallel_linear)

    def __init__(self, config: Mamba2MixerConfig, tensors: Mapping[str, torch.Tensor], prefix: str, *,
                 backend: Backend, dtype: torch.dtype, chunk_size: int, tp: TPGroup | None = None,
                 slices: int = 1) -> None:
        self.full_config = config
        self.tp = tp
        self.slices = slices
        self.sliced = slices > 1 or (tp is not None and tp.size > 1)
        if tp is not None:
            config = local_config(config, tp)
        c = config
        if c.state_size % 4:
            # fp32 GEMMs with K % 4 != 0 give a row other bits at another alignment (torch CPU, test_rows.py)
            raise ModelLoadError(f"state_size {c.state_size} is not a multiple of 4: row bits could depend on "
                                 "alignment in the scan's GEMMs; refused")
        if c.num_heads % c.n_groups:
            raise ModelLoadError(f"num_heads {c.num_heads} is not divisible by n_groups {c.n_groups}")
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.chunk_size = chunk_size
        dev, f32 = backend.device, torch.float32

        def get(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
            return take(tensors, prefix, name).to(device=dev, dtype=dt)

        def opt(name: str, dt: torch.dtype) -> torch.Tensor | None:
            t = take_optional(tensors, prefix, name)
            return None if t is None else t.to(device=dev, dtype=dt)

        lw = backend.linear_weight
        self.in_proj_w = lw(get("in_proj.weight"))
        self.in_proj_b = opt("in_proj.bias", f32)
        self.conv_w = get("conv1d.weight").reshape(c.conv_dim, c.conv_kernel)
        self.conv_b = opt("conv1d.bias", dtype)
        self.params = SSMParams(A=-torch.exp(get("A_log", f32)), D=get("D", f32), dt_bias=get("dt_bias", f32),
                                dt_limit=tuple(float(v) for v in c.dt_limit))
        self.norm_w = get("norm.weight")
        self.out_proj_w = lw(get("out_proj.weight"))
        self.out_proj_b = opt("out_proj.bias", f32)
        if self.sliced:
            if backend.linear_partial is None or backend.gated_rms_norm_sliced is None:
                raise ModelLoadError(f"row_parallel_slices {slices} refused on the {backend.name} backend: its "
                                     "sliced tree GEMM and norm are not implemented yet")
            self.out_proj_slices = row_parallel_weight(backend, self.out_proj_w, lambda: get("out_proj.weight"),
                                                       slices, 1 if tp is None else tp.size)

    # -- state ------------------------------------------------------------------------------------
    def state_spec(self) -> StateSpec:
        """ssm_state, buf_x, buf_dt, buf_B, ssm_state_bf16 where the backend keeps it (``SSDState.layout``), then
        conv_window."""
        return state_spec(self.config, self.chunk_size, self.dtype,
                          bf16_copy=self.backend.configs.bf16_state_copy(self.dtype))

    def state(self, tensors: Mapping[str, torch.Tensor]) -> Mamba2State:
        """The state over slot-indexed tensors named as in ``state_spec`` (views are kept, not copied)."""
        return Mamba2State(ssd=SSDState(tensors["ssm_state"], tensors["buf_x"], tensors["buf_dt"], tensors["buf_B"],
                                        tensors.get("ssm_state_bf16")),
                           conv_window=tensors["conv_window"])

    # -- the one forward ---------------------------------------------------------------------------
    def advance(self, state: Mamba2State, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] (model dtype, normed) -> [rows wanted, hidden_size]; rows [T] bool
        (default all); updates the state. ``capture``, a list, receives the scan's inputs and outputs."""
        c, be = self.config, self.backend
        T = hidden.shape[0]
        H, P, G, N, d = c.num_heads, c.head_dim, c.n_groups, c.state_size, c.intermediate_size
        zxbcdt = be.linear(hidden, self.in_proj_w, self.in_proj_b)
        # split_columns: under autograd one gradient buffer, not a zero-filled full-width one per slice
        z, xBC_in, dt = split_columns(zxbcdt, (d, c.conv_dim, zxbcdt.shape[1] - d - c.conv_dim), one_grad=True)
        recompute = None
        recompute_ok = self.recompute and not saved_tensors_hooked()
        if (recompute_ok and self.recompute_conv and grad_needed(xBC_in, self.conv_w, self.conv_b, state.conv_window)
                and not _hold_within_budget(xBC_in.shape[0] * c.conv_dim * xBC_in.element_size())):
            # the backward runs the conv again for the scan's x, B, C; xBC_in is held anyway (z, dt)
            recompute = functools.partial(_conv_again, be, state.conv_window.clone(), batch, xBC_in.detach(),
                                          self.conv_w.detach(), None if self.conv_b is None else self.conv_b.detach())
        xBC = be.conv_advance(state.conv_window, batch, xBC_in, self.conv_w, self.conv_b)
        x, B, C = split_columns(xBC, (d, G * N, G * N))  # their gradients: one buffer, as the scan writes them
        x, B, C = x.reshape(T, H, P), B.reshape(T, G, N), C.reshape(T, G, N)
        with recomputed_in_backward(xBC, recompute) if recompute is not None else contextlib.nullcontext():
            y = be.ssd_advance(state.ssd, batch, x, dt, B, C, self.params, rows)  # [T, H, P], the SSD advance
        if capture is not None:
            capture.append(dict(x=x, dt=dt, B=B, C=C, y=y, params=self.params, cu_seqlens=batch.cu_seqlens))
        y = y.reshape(T, d)
        if rows is not None:
            y, z = y[rows], z[rows]
        if not self.sliced:
            if self.recompute and be.gated_norm_linear is not None:
                # recomputes the norm's output in its own backward: safe under saved_tensors_hooks
                return be.gated_norm_linear(y, z, self.norm_w, c.norm_eps, G, self.out_proj_w, self.out_proj_b)
            yn = be.gated_rms_norm(y, z, self.norm_w, c.norm_eps, G)
            if not (recompute_ok and grad_needed(yn)):
                return be.linear(yn, self.out_proj_w, self.out_proj_b)
            # out_proj's saved input (the norm's output) is recomputed from y and z, which the norm holds
            again = functools.partial(be.gated_rms_norm, y.detach(), z.detach(), self.norm_w.detach(), c.norm_eps, G)
            with recomputed_in_backward(yn, again):
                return be.linear(yn, self.out_proj_w, self.out_proj_b)
        group = self.tp or TPGroup.single()
        y = be.gated_rms_norm_sliced(y, z, self.norm_w, c.norm_eps, self.full_config.n_groups, slices=self.slices,
                                     group=group)
        return self.row_parallel(y, self.out_proj_slices, self.out_proj_b, slices=self.slices, group=group,
                                 partial=be.linear_partial, tree=be.linear_tree)
