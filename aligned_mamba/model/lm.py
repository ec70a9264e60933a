"""A reference Mamba2 language model on the shared ops.

Everything from token to logit goes through row-invariant ops (embedding lookup, ``rms_norm``,
``linear``, ``causal_conv1d``, the chunked scan, ``gated_rms_norm``), and every forward is an
``advance`` of some slots: the trainer's whole-sequence forward is one advance from empty slots,
the sampler's prefill, decode and recompute are advances of its own slots. So the logits row of a
token is the same function of the same inputs on both sides.

Weights use the parameter names of Hugging Face's Mamba2ForCausalLM (see ``checkpoint``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..contract import Contract
from ..errors import ModelLoadError
from ..ops.linear import linear
from ..ops.norm import gated_rms_norm, rms_norm
from ..ops.ssd import chunk_scan, recurrent_step
from ..replay import Batch, LayerReplayState, LayerRunningState, conv_advance, ssd_advance
from .config import Mamba2Config


@dataclass
class MixerWeights:
    """One Mamba2 block's weights as the shared ops take them (dtypes as ``Mamba2LM`` casts them:
    linear weights and biases fp32, A/D/dt_bias fp32, norms and conv in the model dtype)."""

    norm_w: torch.Tensor
    in_proj_w: torch.Tensor
    in_proj_b: torch.Tensor | None
    conv_w: torch.Tensor  # [conv_dim, K]
    conv_b: torch.Tensor | None
    A: torch.Tensor  # [H] float32, -exp(A_log)
    D: torch.Tensor  # [H] float32
    dt_bias: torch.Tensor  # [H] float32
    gnorm_w: torch.Tensor
    out_proj_w: torch.Tensor
    out_proj_b: torch.Tensor | None


@dataclass
class ModelCache:
    """Per-layer slot-indexed state for ``num_slots`` sequences.

    ``exact_replay`` True: ``LayerReplayState`` (boundary state + partial chunk + conv window).
    False: the baseline's running state, decoded with the recurrent update.
    """

    layers: list
    num_slots: int
    exact_replay: bool

    def reset(self, slots: list[int] | torch.Tensor) -> None:
        idx = torch.as_tensor(slots, dtype=torch.int64)
        for layer in self.layers:
            layer.reset(idx)

    def bytes_per_slot(self) -> int:
        return sum(sum(t[0].numel() * t.element_size() for t in vars(s).values()) for s in self.layers)


class Mamba2LM:
    """Mamba2ForCausalLM on the shared ops. ``contract`` fixes chunk size, backend and dtype."""

    def __init__(self, config: Mamba2Config, tensors: dict[str, torch.Tensor], contract: Contract,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.contract = contract
        if config.state_size % 4:
            # fp32 GEMMs whose inner dimension is not a multiple of 4 give a row other bits at
            # another alignment (torch 2.13 CPU, measured in tests/test_ops_rows.py): refuse.
            raise ModelLoadError(f"state_size {config.state_size} is not a multiple of 4: row bits could depend on "
                                 "alignment in the scan's GEMMs; refused")
        if device is None:
            device = "cuda" if contract.backend == "triton" and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = getattr(torch, contract.model_dtype)
        # a chunk shorter than the pinned row tile is one tile
        self.row_tile = min(int(contract.kernel_configs.get("row_tile", 16)), contract.chunk_size)
        self.linear_tile = int(contract.kernel_configs.get("linear_row_tile", 16))
        c = config
        dt = self.dtype
        f32 = torch.float32

        def get(name: str, dtype: torch.dtype = dt) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        def opt(name: str, dtype: torch.dtype = dt) -> torch.Tensor | None:
            return get(name, dtype) if name in tensors else None

        self.embedding = get("backbone.embeddings.weight")
        self.layers: list[MixerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"backbone.layers.{i}."
            m = p + "mixer."
            self.layers.append(
                MixerWeights(
                    norm_w=get(p + "norm.weight"),
                    in_proj_w=get(m + "in_proj.weight", f32),  # linear computes in fp32 (see ops.linear)
                    in_proj_b=opt(m + "in_proj.bias", f32),
                    conv_w=get(m + "conv1d.weight").reshape(c.conv_dim, c.conv_kernel),
                    conv_b=opt(m + "conv1d.bias"),
                    A=-torch.exp(get(m + "A_log", f32)),
                    D=get(m + "D", f32),
                    dt_bias=get(m + "dt_bias", f32),
                    gnorm_w=get(m + "norm.weight"),
                    out_proj_w=get(m + "out_proj.weight", f32),
                    out_proj_b=opt(m + "out_proj.bias", f32),
                )
            )
        self.norm_f = get("backbone.norm_f.weight")
        head = "lm_head.weight" if "lm_head.weight" in tensors else "backbone.embeddings.weight"
        self.lm_head = get(head).to(f32)
        self.dt_limit = tuple(float(v) for v in c.time_step_limit)
        # On a GPU the torch tiling does not pin cuBLAS's algorithm (it picks by batch count), so
        # the triton backend's linear layers run a fixed-tile Triton kernel there.
        self._linear = linear
        if contract.backend == "triton" and self.device.type == "cuda":
            from ..ops.linear_triton import linear_triton

            self._linear = lambda x, w, b, tile: linear_triton(x, w, b)

    # -- state ---------------------------------------------------------------------------------
    def new_cache(self, num_slots: int, *, exact_replay: bool = True) -> ModelCache:
        c = self.config
        layers: list = []
        for _ in range(c.num_hidden_layers):
            if exact_replay:
                layers.append(LayerReplayState.allocate(
                    num_slots, heads=c.num_heads, head_dim=c.head_dim, groups=c.n_groups, state_size=c.state_size,
                    conv_kernel=c.conv_kernel, conv_dim=c.conv_dim, chunk_size=self.contract.chunk_size,
                    dtype=self.dtype, device=self.device))
            else:
                layers.append(LayerRunningState(
                    ssm_state=torch.zeros(num_slots, c.num_heads, c.head_dim, c.state_size, device=self.device),
                    conv_window=torch.zeros(num_slots, c.conv_kernel - 1, c.conv_dim, dtype=self.dtype,
                                            device=self.device)))
        return ModelCache(layers=layers, num_slots=num_slots, exact_replay=exact_replay)

    # -- the one forward -------------------------------------------------------------------------
    def advance(self, cache: ModelCache, batch: Batch, token_ids: torch.Tensor,
                logit_rows: torch.Tensor | None = None, capture: list | None = None) -> torch.Tensor:
        """Advance the batch's slots by their new tokens and return logits for ``logit_rows``.

        token_ids [T] int64 packed as ``batch.cu_seqlens`` says; logit_rows [T] bool (default
        all). Returns [rows wanted, vocab] in the model dtype. ``capture``, if a list, receives
        per layer a dict of the scan's inputs and outputs (for accuracy reports).
        """
        return self.logits(self.hidden_states(cache, batch, token_ids, logit_rows, capture))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final hidden rows [R, hidden_size] -> [R, vocab] (row-invariant linear)."""
        return self._linear(hidden, self.lm_head, None, self.linear_tile)

    def hidden_states(self, cache: ModelCache, batch: Batch, token_ids: torch.Tensor,
                      logit_rows: torch.Tensor | None = None, capture: list | None = None) -> torch.Tensor:
        """``advance`` up to the final norm: the normed hidden rows [rows wanted, hidden_size]
        (model dtype) that ``logits`` maps to logits. Engines that compute logits for a subset
        of rows later (vLLM's compute_logits) call this and ``logits`` separately."""
        c = self.config
        if token_ids.numel() != batch.num_tokens:
            raise ValueError(f"{token_ids.numel()} token ids for a batch of {batch.num_tokens} tokens")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        token_ids = token_ids.to(self.device)
        if logit_rows is not None:
            logit_rows = logit_rows.to(self.device)
        hidden = self.embedding[token_ids]
        residual = hidden.to(torch.float32) if c.residual_in_fp32 else hidden
        last = len(self.layers) - 1
        for i, (layer, state) in enumerate(zip(self.layers, cache.layers, strict=False)):
            normed = rms_norm(residual.to(self.dtype), layer.norm_w, c.layer_norm_epsilon, self.dtype)
            rows = logit_rows if i == last else None
            out = self._mixer(layer, state, batch, normed, rows, capture)
            if rows is not None:
                residual = residual[rows]
            residual = residual + out
        return rms_norm(residual.to(self.dtype), self.norm_f, c.layer_norm_epsilon, self.dtype)

    def _mixer(self, p: MixerWeights, state, batch: Batch, hidden: torch.Tensor, rows: torch.Tensor | None,
               capture: list | None) -> torch.Tensor:
        return mixer_advance(self.config, p, state, batch, hidden, rows, linear=self._linear,
                             linear_tile=self.linear_tile, row_tile=self.row_tile, backend=self.contract.backend,
                             dt_limit=self.dt_limit, capture=capture,
                             baseline=lambda *a: self._baseline_ssd(*a, p))

    def _baseline_ssd(self, state: LayerRunningState, batch: Batch, x, dt, B, C, p: MixerWeights) -> torch.Tensor:
        """Exact replay off, as engines run today: one-token sequences take the recurrent update,
        longer ones a chunked scan whose grid starts wherever the call starts."""
        y = torch.zeros_like(x)
        lens = batch.lengths
        seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        one = lens == 1
        if one.any():
            r = one[seq]
            sl = batch.slots[one]
            s = state.ssm_state[sl].clone()
            y[r] = recurrent_step(s, x[r], dt[r], p.A, B[r], C[r], p.D, p.dt_bias, self.dt_limit)
            state.ssm_state[sl] = s
        if (~one).any():
            r = (~one)[seq]
            sl = batch.slots[~one]
            cu = torch.zeros(int((~one).sum()) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(lens[~one], 0)
            yp, h = chunk_scan(x[r], dt[r], p.A, B[r], C[r], p.D, p.dt_bias, cu, state.ssm_state[sl],
                               self.contract.chunk_size, dt_limit=self.dt_limit, final="end", row_tile=self.row_tile)
            y[r] = yp
            state.ssm_state[sl] = h
        return y

    # -- the trainer's side ----------------------------------------------------------------------
    def forward(self, sequences: list[torch.Tensor], capture: list | None = None) -> list[torch.Tensor]:
        """Score whole sequences in one packed varlen pass: one advance from empty slots.

        sequences: list of [len_i] int64 token ids. Returns a list of [len_i, vocab] logits.
        """
        lens = [int(s.numel()) for s in sequences]
        cache = self.new_cache(len(sequences))
        batch = Batch.make(list(range(len(sequences))), [0] * len(sequences), lens)
        logits = self.advance(cache, batch, torch.cat([s.to(torch.int64) for s in sequences]), capture=capture)
        return list(torch.split(logits, lens))



def mixer_advance(config: Mamba2Config, p: MixerWeights, state: LayerReplayState | LayerRunningState, batch: Batch,
                  hidden: torch.Tensor, rows: torch.Tensor | None, *, linear: Callable = linear, linear_tile: int = 16,
                  row_tile: int | None = None, backend: str = "torch", dt_limit: tuple[float, float] = (0.0, math.inf),
                  capture: list | None = None, baseline: Callable | None = None) -> torch.Tensor:
    """One Mamba2 mixer (in_proj, conv1d + SiLU, the scan, gated RMSNorm, out_proj) as an advance
    of ``batch``'s slots: hidden [T, hidden_size] (model dtype, already normed) -> [rows, hidden_size]
    fp32. ``rows`` [T] bool picks the output rows (default all). Exported so that engine and
    trainer integrations run the very same function as the reference model.
    """
    c = config
    T = hidden.shape[0]
    H, P, G, N, d = c.num_heads, c.head_dim, c.n_groups, c.state_size, c.intermediate_size
    zxbcdt = linear(hidden, p.in_proj_w, p.in_proj_b, linear_tile)
    z, xBC, dt = zxbcdt[:, :d], zxbcdt[:, d:d + c.conv_dim], zxbcdt[:, d + c.conv_dim:]
    xBC = conv_advance(state, batch, xBC, p.conv_w, p.conv_b)
    x = xBC[:, :d].reshape(T, H, P)
    B = xBC[:, d:d + G * N].reshape(T, G, N)
    C = xBC[:, d + G * N:].reshape(T, G, N)
    if isinstance(state, LayerReplayState):
        y = ssd_advance(state, batch, x, dt, B, C, A=p.A, D=p.D, dt_bias=p.dt_bias, dt_limit=dt_limit,
                        rows=rows, row_tile=row_tile, backend=backend)
    elif baseline is not None:
        y = baseline(state, batch, x, dt, B, C)
    else:
        raise TypeError("a running (non-replay) state needs the baseline scan")
    if capture is not None:
        capture.append(dict(x=x, dt=dt, B=B, C=C, y=y, A=p.A, D=p.D, dt_bias=p.dt_bias,
                            cu_seqlens=batch.cu_seqlens))
    y = y.reshape(T, d)
    if rows is not None:
        y, z = y[rows], z[rows]
    y = gated_rms_norm(y, z, p.gnorm_w, c.layer_norm_epsilon, G)
    return linear(y, p.out_proj_w, p.out_proj_b, linear_tile)
