"""Triton SSD scan on the CPU through the Triton interpreter: logic, schedule invariance, accuracy.

The interpreter runs each program instance in numpy (~15 ms each) and computes bf16 wrongly, so
everything here is fp32 and tiny. Bit-identity is checked with torch.equal on raw rows.
"""

from __future__ import annotations

import math

import interpreted  # before triton: it switches the Triton interpreter on
import pytest
import torch

interpreted.require()
pytestmark = pytest.mark.interpreter
from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.ssd import SSDState, SSMParams  # noqa: E402
from aligned_mamba.ops.ssd.chunk import pack_chunks, scan_chunks  # noqa: E402
from aligned_mamba.ops.ssd.naive import ssd_naive  # noqa: E402
from aligned_mamba.ops.ssd.triton_chunk import replay_chunk_triton, scan_chunks_triton  # noqa: E402
from aligned_mamba.ops.step import Step  # noqa: E402

CFG = TritonKernelConfigs()

H, P, N, L, R = 2, 16, 16, 32, 16
NO_LIMIT = (0.0, math.inf)
# Few examples and no shrinking: every example costs seconds in the interpreter.
FEW = settings(max_examples=5, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])


def _params(seed: int, d_per_channel: bool = True) -> dict[str, torch.Tensor]:
    """Per-layer parameters A [H], D [H, P] or [H], dt_bias [H] (fp32)."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(H, P, generator=g) if d_per_channel else torch.randn(H, generator=g)
    return dict(A=-(0.5 + torch.rand(H, generator=g)), D=D, dt_bias=torch.rand(H, generator=g) - 0.5)


def _tokens(T: int, G: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [T, H, P], raw dt [T, H], B and C [T, G, N], fp32."""
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g) - 1.0,
            torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g))


def _state(G: int, slots: int = 1) -> SSDState:
    return SSDState.allocate(slots, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=torch.float32)


def _advance(st_: SSDState, batch: Step, x, dt, B, C, prm: dict, rows=None, cfg: TritonKernelConfigs = CFG):
    """The Triton replay form (the prefill kernels, as the triton backend runs them off a GPU)."""
    return replay_chunk_triton(st_, batch, x, dt, B, C, SSMParams(**prm), rows=rows, cfg=cfg)


def _replay(G: int, seed: int, schedule: list[int], rows_mask: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, SSDState]:
    """One sequence advanced through the Triton replay form in steps of ``schedule``."""
    T = sum(schedule)
    x, dt, B, C = _tokens(T, G, seed)
    prm = _params(seed)
    st_ = _state(G)
    ys, pos = [], 0
    for n in schedule:
        sl = slice(pos, pos + n)
        rows = None if rows_mask is None else rows_mask[sl]
        ys.append(_advance(st_, Step.make([0], [pos], [n]), x[sl], dt[sl], B[sl], C[sl], prm, rows=rows))
        pos += n
    return torch.cat(ys), st_


def _assert_same_state(s1: SSDState, s2: SSDState) -> None:
    for name in ("ssm_state", "buf_x", "buf_dt", "buf_B"):
        assert torch.equal(getattr(s1, name), getattr(s2, name)), name


def test_decode_token_by_token_matches_prefill_bitwise() -> None:
    """Each decode step replays its partial chunk from the boundary and asks for one row."""
    T, G = 70, 2
    y_pre, s_pre = _replay(G, 0, [T])
    y_dec, s_dec = _replay(G, 0, [1] * T)
    assert y_pre.abs().sum() > 0
    assert torch.equal(y_pre, y_dec)
    _assert_same_state(s_pre, s_dec)


@FEW
@given(data=st.data())
def test_chunked_prefill_any_split_matches_prefill_bitwise(data: st.DataObject) -> None:
    T = data.draw(st.integers(33, 80), label="T")
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), min_size=1, max_size=3), label="cuts"))
    schedule = [b - a for a, b in zip([0, *cuts], [*cuts, T], strict=True)]
    G = data.draw(st.sampled_from([1, 2]), label="G")
    y_pre, s_pre = _replay(G, 1, [T])
    y_chk, s_chk = _replay(G, 1, schedule)
    assert torch.equal(y_pre, y_chk)
    _assert_same_state(s_pre, s_chk)


@FEW
@given(lens=st.lists(st.integers(1, 70), min_size=2, max_size=3), seed=st.integers(0, 3))
def test_packed_batch_matches_each_sequence_alone(lens: list[int], seed: int) -> None:
    """Sequences of different lengths and histories in one call vs each alone; some rows unwanted."""
    G, S = 2, len(lens)
    g = torch.Generator().manual_seed(seed)
    x, dt, B, C = _tokens(sum(lens), G, seed)
    prm = _params(seed)
    rows = torch.rand(sum(lens), generator=g) < 0.7
    start = [int(v) for v in torch.randint(0, 3 * L, (S,), generator=g)]
    # Give every slot a history (its own random boundary state and buffered partial chunk).
    hist = _state(G, S)
    hist.ssm_state.copy_(torch.randn(hist.ssm_state.shape, generator=g))
    for i, p0 in enumerate(start):  # buffers are head-major [slot, head or group, L, ...]; dt is softplus'd
        for buf in (hist.buf_x, hist.buf_dt, hist.buf_B):
            buf[i, :, : p0 % L] = torch.rand(buf[i, :, : p0 % L].shape, generator=g)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    packed = SSDState(*(t.clone() for t in hist.tensors()))
    y_packed = _advance(packed, Step.make(list(range(S)), start, lens), x, dt, B, C, prm, rows=rows)
    for i in range(S):
        alone = SSDState(*(t[i : i + 1].clone() for t in hist.tensors()))
        sl = slice(cu[i], cu[i + 1])
        y_alone = _advance(alone, Step.make([0], [start[i]], [lens[i]]), x[sl], dt[sl], B[sl], C[sl], prm,
                           rows=rows[sl])
        assert torch.equal(y_packed[sl], y_alone), i
        for name, t in vars(alone).items():
            if t is not None:  # (no bf16 copy: fp32)
                assert torch.equal(getattr(packed, name)[i : i + 1], t), name
    assert torch.all(y_packed[~rows] == 0)


def test_x_B_C_read_in_place_at_a_row_stride_give_the_contiguous_bits() -> None:
    """x, B and C as the mixer passes them (column slices of the conv's output: rows xBC-wide apart, heads or
    groups and features adjacent) are read where they lie by the pack, buffer, chunk-state, C.B and row-tile
    kernels, and the raw dt (a column slice of in_proj's output) by the dt and buffer kernels: the same outputs,
    states and buffers as contiguous copies, for slots with a history (buffered rows, read and rewritten),
    whole chunks and a partial one. The slices' other columns are NaN, so a kernel reading any of them as
    contiguous rows would take them and differ."""
    from aligned_mamba.ops.ssd.triton_chunk import rows_in_place

    G, lens, start = 2, [70, 5, 33], [7, 0, 40]
    x, dt, B, C = _tokens(sum(lens), G, 11)
    prm = _params(11)
    # NaN gaps around each block: [3 | x | 2 | B | 1 | C | 4]
    cols = [3, H * P, 2, G * N, 1, G * N, 4]
    at = [sum(cols[:i]) for i in range(len(cols))]
    wide = torch.full((x.shape[0], sum(cols)), math.nan)
    views = []
    for i, t in zip((1, 3, 5), (x, B, C)):
        wide[:, at[i]:at[i] + cols[i]] = t.reshape(t.shape[0], -1)
        views.append(wide[:, at[i]:at[i] + cols[i]].view(t.shape))
    xs, Bs, Cs = views
    for v in views:
        assert not v.is_contiguous() and rows_in_place(v).data_ptr() == v.data_ptr()
    wide_dt = torch.full((dt.shape[0], 2 * H + 3), math.nan)
    wide_dt[:, 3:3 + H] = dt
    dts = wide_dt[:, 3:3 + H]
    assert not dts.is_contiguous() and dts.stride(1) == 1
    g = torch.Generator().manual_seed(5)
    hist = _state(G, 3)
    hist.ssm_state.copy_(torch.randn(hist.ssm_state.shape, generator=g))
    for i, p0 in enumerate(start):
        for buf in (hist.buf_x, hist.buf_dt, hist.buf_B):
            buf[i, :, : p0 % L] = torch.rand(buf[i, :, : p0 % L].shape, generator=g)
    step = Step.make([0, 1, 2], start, lens)
    a, b = (SSDState(*(t.clone() for t in hist.tensors())) for _ in range(2))
    y_slice = _advance(a, step, xs, dts, Bs, Cs, prm)
    y_copy = _advance(b, step, x.clone(), dt.clone(), B.clone(), C.clone(), prm)
    assert torch.equal(y_slice, y_copy) and not y_copy.isnan().any()
    _assert_same_state(a, b)


@pytest.mark.parametrize("G,d_per_channel", [(1, False), (2, True)])
def test_accuracy_against_fp64_reference(G: int, d_per_channel: bool) -> None:
    lens = [45, 80]
    T = sum(lens)
    x, dt, B, C = _tokens(T, G, 7)
    prm = _params(7, d_per_channel)
    cu = torch.tensor([0, lens[0], T])
    h0 = torch.randn(2, H, P, N, generator=torch.Generator().manual_seed(7))
    ch = pack_chunks(x, dt, B, cu, L, prm["dt_bias"], NO_LIMIT)
    y, h_end, moved = scan_chunks_triton(ch, C, prm["A"], prm["D"], h0, final="end", cfg=CFG)
    y_ref, h_ref = ssd_naive(x, dt, B, C, SSMParams(**prm), cu, h0)
    assert ((y.double() - y_ref).abs().mean() / y_ref.abs().mean()).item() < 1e-5
    assert torch.allclose(h_end.double(), h_ref, rtol=1e-4, atol=1e-4)
    # final="boundary": the state after each sequence's last full chunk (32 and 64 tokens).
    _, h_bd, _ = scan_chunks_triton(ch, C, prm["A"], prm["D"], h0, final="boundary", cfg=CFG)
    cut = [L, 2 * L]
    idx = torch.cat([torch.arange(0, cut[0]), torch.arange(lens[0], lens[0] + cut[1])])
    _, h_bd_ref = ssd_naive(x[idx], dt[idx], B[idx], C[idx], SSMParams(**prm), torch.tensor([0, cut[0], sum(cut)]),
                            h0)
    assert torch.allclose(h_bd.double(), h_bd_ref, rtol=1e-4, atol=1e-4)
    # And close to (not bitwise equal to: a different backend) the torch scan.
    y_t, h_t, moved_t = scan_chunks(ch, C, prm["A"], prm["D"], h0, final="end")
    assert torch.allclose(y, y_t, rtol=1e-4, atol=1e-4) and torch.allclose(h_end, h_t, rtol=1e-4, atol=1e-4)
    assert torch.equal(moved, moved_t) and bool(moved.all())


def test_state_untouched_without_a_full_chunk() -> None:
    """A call whose sequences complete no chunk reports them unmoved and returns their states as they were."""
    G = 1
    x, dt, B, C = _tokens(20, G, 5)
    prm = _params(5)
    ch = pack_chunks(x, dt, B, torch.tensor([0, 5, 20]), L, prm["dt_bias"], NO_LIMIT)
    h0 = torch.randn(2, H, P, N)
    _, h, moved = scan_chunks_triton(ch, C, prm["A"], prm["D"], h0, cfg=CFG)
    assert not bool(moved.any()) and torch.equal(h, h0)


@FEW
@given(split=st.integers(1, 79).filter(lambda u: u % L != 0))
def test_unaligned_split_without_replay_changes_bits(split: int) -> None:
    """The baseline: resume mid-chunk from the running state, chunk grid anchored at the split."""
    T, G = 80, 1
    x, dt, B, C = _tokens(T, G, 3)
    prm = _params(3)
    A, D, bias = prm["A"], prm["D"], prm["dt_bias"]
    h0 = torch.zeros(1, H, P, N)
    whole = pack_chunks(x, dt, B, torch.tensor([0, T]), L, bias, NO_LIMIT)
    y_one, _, _ = scan_chunks_triton(whole, C, A, D, h0, cfg=CFG)
    a, b = slice(0, split), slice(split, T)
    first = pack_chunks(x[a], dt[a], B[a], torch.tensor([0, split]), L, bias, NO_LIMIT)
    y_a, h_run, _ = scan_chunks_triton(first, C[a], A, D, h0, final="end", cfg=CFG)
    second = pack_chunks(x[b], dt[b], B[b], torch.tensor([0, T - split]), L, bias, NO_LIMIT)
    y_b, _, _ = scan_chunks_triton(second, C[b], A, D, h_run, cfg=CFG)
    y_split = torch.cat([y_a, y_b])
    assert torch.equal(y_split[a], y_one[a])  # the part before the split is the same prefix
    assert not torch.equal(y_split[b], y_one[b])  # rows after it are rounded differently ...
    assert torch.allclose(y_split, y_one, rtol=1e-4, atol=1e-4)  # ... but are the same values


def test_one_batch_shared_by_layers_of_other_shapes() -> None:
    """An engine step hands one ``Step`` to every layer: the plan kept on it (``StepPlan.ssd_chunk``)
    is keyed by chunk size and row tile, so layers of another chunk size or row tile get their
    own plan and every layer's rows are those of a fresh batch."""
    G, lens, start = 1, [40, 9], [5, 30]
    x, dt, B, C = _tokens(sum(lens), G, 11)
    prm = _params(11)
    layers = [(L, CFG), (L // 2, CFG), (L, TritonKernelConfigs(row_tile=16))]  # (chunk size, configs)

    def states(chunk: int) -> SSDState:
        st_ = SSDState.allocate(2, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=chunk, dtype=torch.float32)
        g = torch.Generator().manual_seed(chunk)
        st_.ssm_state.copy_(torch.randn(st_.ssm_state.shape, generator=g))
        for i, p0 in enumerate(start):
            for buf in (st_.buf_x, st_.buf_dt, st_.buf_B):
                buf[i, :, : p0 % chunk] = torch.rand(buf[i, :, : p0 % chunk].shape, generator=g)
        return st_

    shared = Step.make([0, 1], start, lens)
    ys_shared, ys_fresh = [], []
    for chunk, cfg in layers:
        a, b = states(chunk), states(chunk)
        ys_shared.append(_advance(a, shared, x, dt, B, C, prm, cfg=cfg))
        ys_fresh.append(_advance(b, Step.make([0, 1], start, lens), x, dt, B, C, prm, cfg=cfg))
        _assert_same_state(a, b)
    assert len(shared.plans[torch.device("cpu")].ssd_chunk) == 3  # one plan per (chunk size, row tile), each built once
    for y_s, y_f in zip(ys_shared, ys_fresh, strict=True):
        assert torch.equal(y_s, y_f)
