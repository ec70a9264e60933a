"""The replay state's layout and contents: what one sequence holds per layer.

The memory target: the resident state is the fp32 boundary state plus ``chunk_size`` tokens of
x, RAW dt and B in the model dtype (plus the Mamba2 layer's conv window, which the baseline keeps
too). The
buffered dt is the in_proj output as it came (before dt_bias and softplus), bit for bit;
``pack_chunks`` recomputes softplus for it, giving the bits a single pass computes.
"""

from __future__ import annotations

import math

import pytest
import torch

from aligned_mamba.contract import Contract
from aligned_mamba.layers.mamba2 import Mamba2MixerConfig, state_spec
from aligned_mamba.ops.backend import resolve
from aligned_mamba.ops.configs import TorchKernelConfigs, TritonKernelConfigs
from aligned_mamba.ops.ssd import SSDState, SSMParams
from aligned_mamba.ops.ssd.chunk import pack_chunks
from aligned_mamba.ops.step import Step

TORCH = resolve(Contract(16))  # the torch backend: its replay form takes the chunk size from the state

H, P, G, N, K, CD, L = 4, 8, 2, 16, 4, 40, 16


def _params(seed: int = 0) -> SSMParams:
    g = torch.Generator().manual_seed(seed)
    dt0 = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(H, generator=g))
    return SSMParams(A=-(1 + 15 * torch.rand(H, generator=g)), D=1 + 0.1 * torch.randn(H, generator=g),
                     dt_bias=dt0 + torch.log(-torch.expm1(-dt0)))


def _inputs(T: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, P, generator=g).to(dtype), (0.5 * torch.randn(T, H, generator=g)).to(dtype),
            torch.randn(T, G, N, generator=g).to(dtype), torch.randn(T, G, N, generator=g).to(dtype))


def _allocate(slots: int, dtype: torch.dtype) -> SSDState:
    return SSDState.allocate(slots, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layout_is_the_memory_budget(dtype):
    layout = SSDState.layout(heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype)
    assert layout["ssm_state"] == ((H, P, N), torch.float32)
    assert layout["buf_dt"] == ((H, L), dtype)
    assert layout["buf_x"][1] == layout["buf_B"][1] == dtype
    state = _allocate(3, dtype)
    for name, (shape, dt) in layout.items():
        t = getattr(state, name)
        assert t.shape == (3, *shape) and t.dtype == dt
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert state.bytes_per_slot() == H * P * N * 4 + L * (H * P + H + G * N) * itemsize
    # the Mamba2 layer keeps the scan's state and its conv window, nothing else
    mixer = Mamba2MixerConfig(hidden_size=H * P // 2, num_heads=H, head_dim=P, state_size=N, n_groups=G,
                              conv_kernel=K)
    spec = state_spec(mixer, L, dtype)
    assert [f[0] for f in spec.fields] == [*layout, "conv_window"]
    assert spec.bytes_per_slot() == state.bytes_per_slot() + (K - 1) * mixer.conv_dim * itemsize


def test_bf16_copy_only_where_the_dots_round_the_state():
    """The boundary state's bf16 copy is kept where the Triton decode's dots round that state to bf16 anyway
    ("round" on a bf16 model): in the layout and the layer's spec, half the fp32 state's bytes again; a copy
    of another dtype or shape is refused."""
    assert TritonKernelConfigs().bf16_state_copy(torch.bfloat16)
    assert not TritonKernelConfigs().bf16_state_copy(torch.float32)
    assert not TritonKernelConfigs(bf16_dots="split2").bf16_state_copy(torch.bfloat16)  # it reads the fp32 state
    assert not TorchKernelConfigs().bf16_state_copy(torch.bfloat16)
    layout = SSDState.layout(heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=torch.bfloat16,
                             bf16_copy=True)
    assert list(layout)[-1] == "ssm_state_bf16" and layout["ssm_state_bf16"] == ((H, P, N), torch.bfloat16)
    with_copy = SSDState.allocate(2, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L,
                                  dtype=torch.bfloat16, bf16_copy=True)
    assert with_copy.bytes_per_slot() == _allocate(2, torch.bfloat16).bytes_per_slot() + H * P * N * 2
    assert SSDState(*with_copy.tensors()).ssm_state_bf16 is with_copy.ssm_state_bf16
    mixer = Mamba2MixerConfig(hidden_size=H * P // 2, num_heads=H, head_dim=P, state_size=N, n_groups=G,
                              conv_kernel=K)
    names = [f[0] for f in state_spec(mixer, L, torch.bfloat16, bf16_copy=True).fields]
    assert names == [*layout, "conv_window"]
    for bad in (with_copy.ssm_state.clone(), with_copy.ssm_state_bf16[:, :, :-1].clone()):
        with pytest.raises(ValueError, match="ssm_state_bf16 must be bf16"):
            SSDState(with_copy.ssm_state, with_copy.buf_x, with_copy.buf_dt, with_copy.buf_B, bad)


def test_torch_forms_keep_a_bf16_copy_rounded():
    """A state with the bf16 copy advanced by the torch forms (prefills crossing boundaries, decodes completing
    chunks) ends with its copy the boundary state rounded to nearest-even, though every boundary state moved
    (so a copy left as it was would be caught)."""
    dtype = torch.bfloat16
    state = SSDState.allocate(5, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype,
                              bf16_copy=True)
    g = torch.Generator().manual_seed(3)
    state.ssm_state.copy_(torch.randn(state.ssm_state.shape, generator=g))
    state.refresh_copy(torch.arange(5))
    before = state.ssm_state_bf16.clone()
    schedule = [[21, 16, 5], [1, 1, 1], [9, 14, 9], [1, 1, 1], [1, 1, 1]]  # the 4th completes every chunk
    x, dt, B, C = _inputs(sum(sum(s) for s in schedule), dtype)
    slots, pos, r = [3, 0, 4], [0, 0, 0], 0
    for step in schedule:
        rows = slice(r, r + sum(step))
        TORCH.ssd_advance(state, Step.make(slots, pos, step), x[rows], dt[rows], B[rows], C[rows], _params())
        r += sum(step)
        pos = [p + n for p, n in zip(pos, step)]
    assert torch.equal(state.ssm_state_bf16, state.ssm_state.to(torch.bfloat16))
    for s in slots:
        assert not torch.equal(state.ssm_state_bf16[s], before[s])
    for s in (1, 2):  # slots no sequence owns keep their copy
        assert torch.equal(state.ssm_state_bf16[s], before[s])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_buffered_dt_is_the_raw_input(dtype):
    """After each advance a slot's dt buffer holds the raw dt of the rows since its last chunk
    boundary (torch.equal), and zeros from its fill level on; x and B likewise."""
    lens = [21, 16, 5]  # fills 5, 0 (a full chunk), 5
    schedule = [lens, [1, 1, 1], [12, 3, 11], [1, 1, 1]]  # prefill, decode, cross a boundary, decode
    T = sum(sum(s) for s in schedule)
    x, dt, B, C = _inputs(T, dtype)
    state = _allocate(5, dtype)
    slots = [3, 0, 4]
    pos, r = [0, 0, 0], 0
    hist = [[] for _ in slots]  # each sequence's rows, in order
    for step in schedule:
        batch = Step.make(slots, pos, step)
        rows = slice(r, r + sum(step))
        TORCH.ssd_advance(state, batch, x[rows], dt[rows], B[rows], C[rows], _params())
        i = r
        for k, n in enumerate(step):
            hist[k].extend(range(i, i + n))
            i += n
        r += sum(step)
        pos = [p + n for p, n in zip(pos, step)]
        for k, s in enumerate(slots):
            fill = pos[k] % L
            buffered = hist[k][len(hist[k]) - fill:] if fill else []
            assert torch.equal(state.buf_dt[s, :, :fill], dt[buffered].T)
            assert torch.equal(state.buf_x[s, :, :fill], x[buffered].transpose(0, 1))
            assert torch.equal(state.buf_B[s, :, :fill], B[buffered].transpose(0, 1))
            for buf in (state.buf_dt, state.buf_x, state.buf_B):
                assert not buf[s, :, fill:].any()
    for s in (1, 2):  # slots no sequence owns are untouched
        assert not state.buf_dt[s].any()


@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.01, 0.05)])
def test_packed_dt_from_a_raw_prefix_is_the_single_pass(dt_limit):
    """Chunks.dt built from a raw dt prefix equals the one packed from the whole stream: softplus'd
    fp32 (clamped to dt_limit) in the filled rows and exactly +0.0 on padding rows."""
    dtype = torch.bfloat16
    p = _params()
    offs, news = [5, 0, 15, 9], [3, 4, 1, 30]
    S = len(offs)
    x, dt, B, _ = _inputs(sum(offs) + sum(news), dtype)
    # the prefix buffers: each sequence's first off rows, head-major, zero past off
    xb, db, bb = (torch.zeros(S, H, L, P, dtype=dtype), torch.zeros(S, H, L, dtype=dtype),
                  torch.zeros(S, G, L, N, dtype=dtype))
    whole, new, r = [], [], 0
    for k, (o, n) in enumerate(zip(offs, news)):
        xb[k, :, :o], db[k, :, :o], bb[k, :, :o] = x[r:r + o].transpose(0, 1), dt[r:r + o].T, B[r:r + o].transpose(0, 1)
        whole.extend(range(r, r + o + n))
        new.extend(range(r + o, r + o + n))
        r += o + n
    cu = lambda v: torch.tensor([0, *torch.tensor(v).cumsum(0).tolist()])  # noqa: E731
    got = pack_chunks(x[new], dt[new], B[new], cu(news), L, p.dt_bias, dt_limit,
                      prefix=(xb, db, bb, torch.tensor(offs)))
    ref = pack_chunks(x[whole], dt[whole], B[whole], cu([o + n for o, n in zip(offs, news)]), L, p.dt_bias,
                      dt_limit)
    assert torch.equal(got.length, ref.length)
    for name in ("x", "dt", "B"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.dt.dtype == torch.float32 and got.dt.is_contiguous()
    pad = torch.arange(L)[None, None, :] >= got.length[:, None, None]
    assert not got.dt[pad.expand_as(got.dt)].any()
    assert not torch.signbit(got.dt).any()  # padding is +0.0, softplus is positive
    assert (got.dt[~pad.expand_as(got.dt)] > 0).all()
    # decode (every sequence in its first chunk, NC == S, the fast path): the same bits
    starts = [0, *torch.tensor([o + n for o, n in zip(offs, news)]).cumsum(0).tolist()]
    new1 = [starts[k] + offs[k] for k in range(S)]
    whole1 = [i for k in range(S) for i in range(starts[k], starts[k] + offs[k] + 1)]
    got = pack_chunks(x[new1], dt[new1], B[new1], cu([1] * S), L, p.dt_bias, dt_limit,
                      prefix=(xb, db, bb, torch.tensor(offs)))
    ref = pack_chunks(x[whole1], dt[whole1], B[whole1], cu([o + 1 for o in offs]), L, p.dt_bias, dt_limit)
    assert got.dt.shape[0] == S
    for name in ("x", "dt", "B"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name

def test_advance_refuses_inputs_the_buffers_would_round():
    state = _allocate(1, torch.bfloat16)
    x, dt, B, C = _inputs(3, torch.bfloat16)
    with pytest.raises(ValueError, match="dt is torch.float32"):
        TORCH.ssd_advance(state, Step.make([0], [0], [3]), x, dt.float(), B, C, _params())
