"""The fused replay-decode kernel (``triton_decode``) against the single-pass Triton prefill.

Two groups:

- CPU, Triton interpreter (run when TRITON_INTERPRET=1, which conftest sets on a machine without
  nvidia-smi): tiny fp32 shapes. The interpreter computes ``tl.dot`` as a numpy matmul and
  ``tl.fma`` with two roundings, so it checks the logic everywhere, and the bits where the decode
  and the prefill run the same kind of operation: the "tile" mode, the state update, the buffers
  and the dt softplus. The "row" mode is checked bitwise for batch invariance and against the
  prefill to a tolerance here, bitwise on the GPU.
- GPU (marked gpu, skipped without CUDA): real shapes, every row torch.equal to the prefill's,
  across batch sizes, offsets and chunk boundaries, and across processes: bf16 (tensor-core dots,
  "tile" mode, what a bf16 model runs) and fp32 ("row" mode, and "tile").
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as hst

pytest.importorskip("triton")

# Import every Triton module now, while the mode (compiled or interpreted) is the session's:
# triton.jit picks it when a kernel is defined, and another test module switches the interpreter on.
from sm90_offline import run_sm90_script  # noqa: E402

import aligned_mamba.ops.ssd.triton_decode as td  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.ssd import SSDState, SSMParams  # noqa: E402
from aligned_mamba.ops.ssd.chunk import dt_softplus  # noqa: E402
from aligned_mamba.ops.ssd.triton_chunk import replay_chunk_triton  # noqa: E402
from aligned_mamba.ops.ssd.triton_decode import _rows, decode_step_triton  # noqa: E402
from aligned_mamba.ops.step import Step  # noqa: E402
from aligned_mamba.ops.triton_math import dt_softplus_triton  # noqa: E402

CFG = TritonKernelConfigs()  # the pinned configs, as every launch here takes them

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="CPU checks through the Triton interpreter (TRITON_INTERPRET=1)")
gpu_only = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")

NO_LIMIT = (0.0, math.inf)


@pytest.fixture(autouse=True)
def _keep_compiled_mode(monkeypatch):
    """tests/ops/ssd/test_triton_chunk.py sets TRITON_INTERPRET=1 in os.environ when it is collected; Triton
    reads that knob while compiling too, so the GPU tests here run without it."""
    if not INTERPRET:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ------------------------------------------------------------------------------------------
# helpers shared by both groups
# ------------------------------------------------------------------------------------------


def make_params(H: int, P: int, seed: int, dev: str = "cpu", realistic: bool = False) -> dict[str, torch.Tensor]:
    """A [H], D [H, P], dt_bias [H] in fp32. realistic: Mamba2 init (A in [-16, -1], softplus(bias)
    in [1e-3, 1e-1]) as in the RFC's measurements."""
    g = torch.Generator().manual_seed(seed)
    if realistic:
        A = -torch.empty(H).uniform_(1.0, 16.0, generator=g)
        dt0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
        bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    else:
        A = -(0.5 + torch.rand(H, generator=g))
        bias = torch.rand(H, generator=g) - 0.5
    D = torch.randn(H, P, generator=g)
    return {k: v.to(dev) for k, v in dict(A=A, D=D, dt_bias=bias).items()}


def make_tokens(T: int, H: int, P: int, G: int, N: int, seed: int, dtype: torch.dtype = torch.float32,
                dev: str = "cpu") -> tuple[torch.Tensor, ...]:
    """x [T, H, P], raw dt [T, H], B and C [T, G, N]."""
    g = torch.Generator(device=dev).manual_seed(1000 + seed)
    kw = dict(generator=g, device=dev)
    out = (torch.randn(T, H, P, **kw), torch.randn(T, H, **kw) - 1.0, torch.randn(T, G, N, **kw),
           torch.randn(T, G, N, **kw))
    return tuple(t.to(dtype) for t in out)


def make_state(slots: int, H: int, P: int, G: int, N: int, L: int, dtype: torch.dtype, dev: str,
               seed: int | None = None, scale: float = 1.0, bf16_copy: bool | None = None) -> SSDState:
    """A replay state; bf16_copy (default: as a model's cache under ``CFG``) keeps the boundary state's bf16 copy."""
    copy = CFG.bf16_state_copy(dtype) if bf16_copy is None else bf16_copy
    st = SSDState.allocate(slots, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype, device=dev,
                           bf16_copy=copy)
    if seed is not None:  # a nonzero boundary state, as after earlier chunks
        g = torch.Generator(device=dev).manual_seed(2000 + seed)
        st.ssm_state.copy_(scale * torch.randn(st.ssm_state.shape, generator=g, device=dev))
        st.refresh_copy(torch.arange(slots, device=dev))
    return st


def clone_state(st: SSDState) -> SSDState:
    return SSDState(*(t.clone() for t in st.tensors()))


def params_of(prm: dict, dt_limit=NO_LIMIT) -> SSMParams:
    return SSMParams(A=prm["A"], D=prm["D"], dt_bias=prm["dt_bias"], dt_limit=dt_limit)


def assert_same_state(s1: SSDState, s2: SSDState, slots=None) -> None:
    """Every field torch.equal (the bf16 copy where both keep one), and each copy its state rounded."""
    for name in ("ssm_state", "buf_x", "buf_dt", "buf_B", "ssm_state_bf16"):
        a, b = getattr(s1, name), getattr(s2, name)
        if a is None or b is None:
            continue
        if slots is not None:
            a, b = a[slots], b[slots]
        assert torch.equal(a, b), name
    for st in (s1, s2):
        if st.ssm_state_bf16 is not None:
            assert torch.equal(st.ssm_state_bf16, st.ssm_state.to(torch.bfloat16)), "the bf16 copy is stale"


def decode_steps(st: SSDState, slots: list[int], start: list[int], toks: list[tuple[torch.Tensor, ...]],
                 prm: dict, steps: int, mode: str, hint: bool = True, dt_limit=NO_LIMIT,
                 row_tile: int | None = None, cfg: TritonKernelConfigs = CFG,
                 side: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
    """Decode ``steps`` tokens for every slot (slot i takes its token k from toks[i][*][k]); returns
    y [S, H, P] per step. hint: pass the indices of the sequences completing a chunk (False if none).
    side: each step inside ``completions_on(side)``."""
    L = st.chunk_size
    dev = st.buf_x.device
    if row_tile is None and INTERPRET:
        # The interpreter's tl.dot is a numpy matmul, whose bits can change with the tile's shape:
        # the CPU checks decode with the prefill's own tile. On the GPU the default (16) is used and
        # test_gpu_decode_row_tile_does_not_touch_bits checks that the height does not matter.
        row_tile = cfg.scan_row_tile(L)
    sl = torch.tensor(slots, dtype=torch.int64, device=dev)
    ys = []
    for k in range(steps):
        pos = [p + k for p in start]
        x, dt, B, C = (torch.stack([t[j][k] for t in toks]) for j in range(4))
        done = [i for i, p in enumerate(pos) if p % L == L - 1]
        completes = (torch.tensor(done, dtype=torch.int64, device=dev) if done else False) if hint else None
        with contextlib.nullcontext() if side is None else td.completions_on(side):
            ys.append(decode_step_triton(st, sl, torch.tensor(pos, dtype=torch.int64, device=dev), x, dt, B, C,
                                         params_of(prm, dt_limit), cfg=cfg, mode=mode, completes=completes,
                                         row_tile=row_tile))
    return ys


def prefill(st: SSDState, slots: list[int], start: list[int], toks: list[tuple[torch.Tensor, ...]],
            prm: dict, dt_limit=NO_LIMIT, cfg: TritonKernelConfigs = CFG) -> list[torch.Tensor]:
    """One advance through the prefill kernels over every slot's tokens; returns each slot's rows [n_i, H, P]."""
    lens = [t[0].shape[0] for t in toks]
    cat = [torch.cat([t[j] for t in toks]) for j in range(4)]
    y = replay_chunk_triton(st, Step.make(slots, start, lens), *cat, params_of(prm, dt_limit), cfg=cfg)
    return list(torch.split(y, lens))


# ------------------------------------------------------------------------------------------
# CPU: Triton interpreter, tiny fp32
# ------------------------------------------------------------------------------------------

H, P, N, L = 2, 16, 16, 32


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (1e-3, 0.5)])
def test_dt_softplus_bits(dt_limit):
    """The Triton softplus is elementwise.softplus bit for bit, edges included."""
    g = torch.Generator().manual_seed(0)
    raw = torch.cat([
        torch.randn(1501, generator=g) * 8.0,
        torch.linspace(-100.0, 40.0, 300),
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, 19.999998, 20.0, 20.000002, 88.0, -87.0, -87.5, -88.0,
                      -88.1, -90.0, -200.0, 1e30, -1e30, float("inf"), float("-inf")]),
    ]).view(-1, 4)
    bias = torch.tensor([0.0, -0.3, 0.7, 1e-4])
    got = dt_softplus_triton(raw, bias, dt_limit)
    ref = dt_softplus(raw, bias, dt_limit)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "step"])
@pytest.mark.parametrize("G", [1, 2])
def test_tile_mode_token_by_token_equals_prefill(G, mode):
    """Decode 40 tokens one by one from a boundary (crossing the next one) == one prefill over them."""
    T, start = 40, L  # start at the second chunk's boundary, with a nonzero boundary state
    prm = make_params(H, P, seed=G)
    toks = make_tokens(T, H, P, G, N, seed=G)
    st = make_state(1, H, P, G, N, L, torch.float32, "cpu", seed=G)
    ref = clone_state(st)
    ys = decode_steps(st, [0], [start], [toks], prm, T, mode)
    yp = prefill(ref, [0], [start], [toks], prm)[0]
    assert torch.equal(torch.cat(ys), yp)
    assert_same_state(st, ref)


def _copy_case(mode: str, copy: bool, refresh: bool = True, dev: str = "cpu", dims: tuple | None = None,
               seed: int = 5) -> tuple[list[torch.Tensor], SSDState]:
    """bf16, 3 sequences in slots 4, 0, 2 of 5: a prefill from nonzero boundary states crossing a chunk boundary
    (two of them), then L + 3 decode steps (a completion each); rows per step and the state. copy: the state keeps
    the boundary state's bf16 copy; refresh False: the prefill leaves the copy as it was (a writer that forgets)."""
    H_, P_, G_, N_, L_ = dims or (H, P, 1, N, L)
    dtype = torch.bfloat16
    prm = make_params(H_, P_, seed=seed, dev=dev, realistic=dev != "cpu")
    slots, pre_len = [4, 0, 2], [L_ + 5, L_ - 3, 2 * L_ + 1]
    steps = L_ + 3
    st = make_state(5, H_, P_, G_, N_, L_, dtype, dev, seed=seed, scale=0.3, bf16_copy=copy)
    pre = [make_tokens(n, H_, P_, G_, N_, seed * 10 + i, dtype, dev) for i, n in enumerate(pre_len)]
    new = [make_tokens(steps, H_, P_, G_, N_, seed * 10 + 5 + i, dtype, dev) for i in range(3)]
    keep = SSDState.refresh_copy
    try:
        if not refresh:
            SSDState.refresh_copy = lambda self, slots: None
        prefill(st, slots, [0, 0, 0], pre, prm)
    finally:
        SSDState.refresh_copy = keep
    ys = decode_steps(st, slots, pre_len, new, prm, steps, mode,
                      row_tile=None if dev == "cpu" else td.DECODE_ROW_TILE)
    return ys, st


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "step"])
def test_bf16_state_copy_keeps_rows_and_states(mode):
    """bf16 under "round": a state keeping the boundary state's bf16 copy, which the decode's dots then read, gives
    the rows, boundary states and buffers of a state without one, bit for bit, through prefills and completions,
    and its copy stays the state rounded. Baseline: a prefill that leaves the copy stale gives other rows."""
    _check_copy(mode, "cpu")


def _check_copy(mode: str, dev: str, dims: tuple | None = None) -> None:
    assert CFG.bf16_dots == "round" and CFG.bf16_state_copy(torch.bfloat16)
    ys, st = _copy_case(mode, copy=True, dev=dev, dims=dims)
    ys0, st0 = _copy_case(mode, copy=False, dev=dev, dims=dims)
    assert st.ssm_state_bf16 is not None and st0.ssm_state_bf16 is None
    assert all(torch.equal(a, b) for a, b in zip(ys, ys0, strict=True))
    assert_same_state(st, st0)
    ys_stale, _ = _copy_case(mode, copy=True, refresh=False, dev=dev, dims=dims)
    assert not all(torch.equal(a, b) for a, b in zip(ys_stale, ys0, strict=True))


@pytest.mark.interpreter
@interp
def test_row_mode_token_by_token_close_to_prefill():
    """Row mode: same state and buffers bit for bit (shared code), rows close (the interpreter's
    tl.fma and tl.dot round differently; the GPU test checks the bits)."""
    T, start, G = 36, L, 1
    prm = make_params(H, P, seed=3)
    toks = make_tokens(T, H, P, G, N, seed=3)
    st = make_state(1, H, P, G, N, L, torch.float32, "cpu", seed=3)
    ref = clone_state(st)
    ys = decode_steps(st, [0], [start], [toks], prm, T, "row")
    yp = prefill(ref, [0], [start], [toks], prm)[0]
    torch.testing.assert_close(torch.cat(ys), yp, rtol=1e-5, atol=1e-5)
    assert_same_state(st, ref)


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "row", "step"])
def test_batch_at_mixed_offsets_equals_each_alone(mode):
    """3 sequences at offsets 5, 31 (completes its chunk) and 40 in one batch, in scattered slots,
    two steps: rows, states and buffers equal to each sequence decoded alone (and, in tile mode,
    to the prefill of each sequence's chunk prefix + tokens)."""
    G, steps = 2, 2
    prm = make_params(H, P, seed=7)
    offsets, slots = [5, 31, 40], [3, 0, 2]
    st = make_state(4, H, P, G, N, L, torch.float32, "cpu", seed=7)
    # fill each slot's partial chunk with a prefill from its boundary
    pre = [make_tokens(o % L, H, P, G, N, seed=10 + i) for i, o in enumerate(offsets)]
    prefill(st, slots, [o - o % L for o in offsets], pre, prm)
    new = [make_tokens(steps, H, P, G, N, seed=20 + i) for i in range(3)]
    alone = clone_state(st)
    full = clone_state(st)
    ys = decode_steps(st, slots, offsets, new, prm, steps, mode, hint=False)
    for i in range(3):
        ya = decode_steps(alone, [slots[i]], [offsets[i]], [new[i]], prm, steps, mode)
        for k in range(steps):
            assert torch.equal(ys[k][i], ya[k][0]), (i, k)
    assert_same_state(st, alone)
    if mode != "row":  # reference: prefill over (chunk prefix + new tokens) from the boundary state
        ref = clone_state(full)
        for b in (ref.buf_x, ref.buf_dt, ref.buf_B):
            b.zero_()
        toks = [tuple(torch.cat([a, b]) for a, b in zip(pre[i], new[i])) for i in range(3)]
        yp = prefill(ref, slots, [o - o % L for o in offsets], toks, prm)
        for i in range(3):
            assert torch.equal(torch.stack([ys[k][i] for k in range(steps)]), yp[i][-steps:]), i
        assert_same_state(st, ref, torch.tensor(slots))


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("hint", [False, True, "step"])
def test_several_completions_in_one_step(hint, monkeypatch):
    """Four sequences, three of them completing their chunk in the same step, with two batch entries
    per program of the completion kernels (a program meets two completions; the batch spans two
    programs): rows, states and buffers equal to each sequence decoded alone."""

    monkeypatch.setattr(td, "COMPLETION_BLOCK", 2)
    G = 2
    prm = make_params(H, P, seed=13)
    offsets, slots = [L - 1, 5, 2 * L - 1, 3 * L - 1], [2, 0, 3, 1]
    st = make_state(4, H, P, G, N, L, torch.float32, "cpu", seed=13)
    pre = [make_tokens(o % L, H, P, G, N, seed=30 + i) for i, o in enumerate(offsets)]
    prefill(st, slots, [o - o % L for o in offsets], pre, prm)
    new = [make_tokens(1, H, P, G, N, seed=40 + i) for i in range(4)]
    alone = clone_state(st)
    before = clone_state(st)
    mode = "step" if hint == "step" else "tile"  # step mode: one launch, the hint unused
    y = decode_steps(st, slots, offsets, new, prm, 1, mode, hint=hint is True)[0]
    for i in range(4):
        ya = decode_steps(alone, [slots[i]], [offsets[i]], [new[i]], prm, 1, "tile")[0]
        assert torch.equal(y[i], ya[0]), i
    assert_same_state(st, alone)
    for i in (0, 2, 3):  # the completing ones moved their boundary and emptied their buffers
        assert not torch.equal(st.ssm_state[slots[i]], before.ssm_state[slots[i]])
        assert not bool(st.buf_x[slots[i]].any())
    assert torch.equal(st.ssm_state[slots[1]], before.ssm_state[slots[1]])


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "row"])
def test_prep_head_blocks_keep_rows_states_and_buffers(mode, monkeypatch):
    """The prep kernel split over head blocks (2 heads a program; 3 heads a group, so the second block is half
    masked) gives every row, boundary state and buffer of one program per group, across a chunk completion.
    A split that dropped or shifted a block's heads would leave their dt rows unset."""

    Hb, G = 6, 2
    prm = make_params(Hb, P, seed=17)
    offsets, slots = [L - 3, 9, 2 * L - 2], [1, 2, 0]
    st = make_state(3, Hb, P, G, N, L, torch.float32, "cpu", seed=17)
    prefill(st, slots, [o - o % L for o in offsets], [make_tokens(o % L, Hb, P, G, N, seed=50 + i)
                                                       for i, o in enumerate(offsets)], prm)
    new = [make_tokens(4, Hb, P, G, N, seed=60 + i) for i in range(3)]
    whole = clone_state(st)
    want = decode_steps(whole, slots, offsets, new, prm, 4, mode)
    monkeypatch.setattr(td, "PREP_HEADS", 2)
    got = decode_steps(st, slots, offsets, new, prm, 4, mode)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert_same_state(st, whole)
    for bad in (0, 3):  # a program's heads are a tl.arange: a power of two
        monkeypatch.setattr(td, "PREP_HEADS", bad)
        with pytest.raises(ValueError, match=f"PREP_HEADS {bad} refused"):
            decode_steps(st, slots, offsets, new, prm, 1, mode)


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "row", "bf16-tile"])
def test_prep_blocks_past_the_token_leave_no_scratch(mode, monkeypatch):
    """The prep computes dt only in the column blocks up to the token's and stores zeros past them. With 16-column
    blocks (2 to a chunk), uninitialised scratch poisoned with NaN, a token at every offset of two chunks (block
    starts among them) gives the prefill's rows and state, in fp32 (row and tile) and bf16 (tile: tensor-core
    dots): a block skipped too early would zero the token's dt, one left unwritten would carry NaN into the rows."""
    import dataclasses

    cfg = dataclasses.replace(CFG, block_k=16)
    dtype = torch.bfloat16 if mode == "bf16-tile" else torch.float32
    mode = mode.removeprefix("bf16-")
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    T, start, G = 2 * L, L, 1
    prm = make_params(H, P, seed=19)
    toks = make_tokens(T, H, P, G, N, seed=19, dtype=dtype)
    st = make_state(1, H, P, G, N, L, dtype, "cpu", seed=19)
    ref = clone_state(st)
    ys = torch.cat(decode_steps(st, [0], [start], [toks], prm, T, mode, cfg=cfg))
    yp = prefill(ref, [0], [start], [toks], prm, cfg=cfg)[0]
    assert not ys.isnan().any()
    if mode == "tile":
        assert torch.equal(ys, yp)
    else:  # the interpreter's fma and dot round differently (test_row_mode_token_by_token_close_to_prefill)
        torch.testing.assert_close(ys, yp, rtol=1e-5, atol=1e-5)
    assert_same_state(st, ref)


@pytest.mark.interpreter
@interp
def test_chunk_completion_updates_state_like_prefill():
    """A token at position L-1 moves the boundary state as the prefill of the whole chunk does and
    empties the buffers; other slots are untouched."""
    G = 1
    prm = make_params(H, P, seed=11)
    toks = make_tokens(L, H, P, G, N, seed=11)
    st = make_state(2, H, P, G, N, L, torch.float32, "cpu", seed=11)
    ref = clone_state(st)
    head = tuple(t[: L - 1] for t in toks)
    prefill(st, [1], [0], [head], prm)
    before = clone_state(st)
    y = decode_steps(st, [1], [L - 1], [tuple(t[L - 1:] for t in toks)], prm, 1, "tile", hint=False)[0]
    yp = prefill(ref, [1], [0], [toks], prm)[0]
    assert torch.equal(y[0], yp[-1])
    assert torch.equal(st.ssm_state, ref.ssm_state)
    assert not torch.equal(st.ssm_state[1], before.ssm_state[1])
    for b in (st.buf_x, st.buf_dt, st.buf_B):
        assert not bool(b[1].any())
    assert_same_state(st, before, torch.tensor([0]))


@pytest.mark.interpreter
@interp
def test_dt_limit_and_per_head_D():
    """dt_limit clamps as in pack_chunks; D given per head ([H]) or per channel ([H, P])."""
    G, T = 1, 6
    prm = make_params(H, P, seed=5)
    prm["D"] = prm["D"][:, 0].contiguous()
    toks = make_tokens(T, H, P, G, N, seed=5)
    lim = (0.05, 0.4)
    st = make_state(1, H, P, G, N, L, torch.float32, "cpu", seed=5)
    ref = clone_state(st)
    ys = decode_steps(st, [0], [3], [toks], prm, T, "tile", dt_limit=lim)
    # reference: same start (3 rows already buffered: zeros, consistent with a zero prefix)
    yp = prefill(ref, [0], [3], [toks], prm, dt_limit=lim)[0]
    assert torch.equal(torch.cat(ys), yp)
    assert_same_state(st, ref)


def _step_against_general(mode: str, H_: int, G: int, P_: int, N_: int, L_: int, offsets: list[int],
                          seed: int) -> int:
    """One decode step (every sequence one token, at ``offsets``, with nonzero boundary states and
    partial chunks from a prefill) by ``decode_step_triton(mode=mode)`` and by the general path
    (``replay_chunk_triton``, the mixed and chunked prefill's kernels, over the same one-token step).
    Returns how many output elements differ; asserts the states (boundary and buffers) are equal."""
    S = len(offsets)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S + 2, generator=g)[:S].tolist()
    prm = make_params(H_, P_, seed)
    st = make_state(S + 2, H_, P_, G, N_, L_, torch.float32, "cpu", seed=seed)
    pre = [make_tokens(o % L_, H_, P_, G, N_, seed=seed * 10 + i) for i, o in enumerate(offsets)]
    idx = [i for i, o in enumerate(offsets) if o % L_]
    if idx:
        prefill(st, [slots[i] for i in idx], [offsets[i] - offsets[i] % L_ for i in idx], [pre[i] for i in idx], prm)
    new = [make_tokens(1, H_, P_, G, N_, seed=seed * 10 + 5 + i) for i in range(S)]
    ref = clone_state(st)
    y = decode_steps(st, slots, offsets, new, prm, 1, mode, hint=False, row_tile=CFG.scan_row_tile(L_))[0]
    yg = torch.stack([r[0] for r in prefill(ref, slots, offsets, new, prm)])
    assert_same_state(st, ref)
    return int((y != yg).sum())


@pytest.mark.interpreter
@interp
@settings(max_examples=8, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])
@given(data=hst.data())
def test_step_mode_equals_general_path_property(data):
    """The one-launch decode step ("step") gives the general path's rows, boundary states and buffers
    bit for bit, over batch mixes (offsets anywhere in the first three chunks, completions
    included), heads, groups, head dims, state sizes and chunk sizes."""
    G = data.draw(hst.sampled_from([1, 2]), label="G")
    H_ = G * data.draw(hst.sampled_from([1, 2]), label="heads per group")
    P_ = data.draw(hst.sampled_from([8, 16]), label="P")
    N_ = data.draw(hst.sampled_from([8, 16]), label="N")
    L_ = data.draw(hst.sampled_from([16, 32]), label="L")
    offsets = data.draw(hst.lists(hst.integers(0, 3 * L_ - 1) | hst.sampled_from([L_ - 1, 2 * L_ - 1]),
                                  min_size=1, max_size=4), label="offsets")
    assert _step_against_general("step", H_, G, P_, N_, L_, offsets, seed=len(offsets) + G) == 0


@pytest.mark.interpreter
@interp
def test_step_property_catches_another_order():
    """The property's baseline: the "row" form (the same step, its dots as sequential fma chains,
    which the interpreter rounds twice) gives the same states but other rows, and the check sees it."""
    assert _step_against_general("row", 2, 1, 16, 16, 32, [5, 31, 40], seed=3) > 0
    assert _step_against_general("step", 2, 1, 16, 16, 32, [5, 31, 40], seed=3) == 0


def layer_views(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, pad: int = 3) -> tuple:
    """x, dt, B, C as a Mamba2 layer passes them: x, B, C column slices of the conv's output [S, d + 2GN]
    (here with ``pad`` more columns), dt a slice of in_proj's [S, z | xBC | dt]: row-strided views, the
    two buffers with different row strides."""
    S, H_, P_ = x.shape
    G, N_ = B.shape[1:]
    d, gn = H_ * P_, G * N_
    kw = dict(dtype=x.dtype, device=x.device)
    xbc = torch.cat([x.reshape(S, -1), B.reshape(S, -1), C.reshape(S, -1), torch.zeros(S, pad, **kw)], 1)
    zxbcdt = torch.cat([torch.zeros(S, d + 1, **kw), xbc, dt], 1)
    views = (xbc[:, :d].view(S, H_, P_), zxbcdt[:, -H_:], xbc[:, d:d + gn].view(S, G, N_),
             xbc[:, d + gn:d + 2 * gn].view(S, G, N_))
    assert S == 1 or not any(v.is_contiguous() for v in views)
    return views


def _strided_against_contiguous(mode: str, S: int, H_: int, G: int, P_: int, N_: int, L_: int, seed: int,
                                baseline: bool = False, dev: str = "cpu", dt_: torch.dtype = torch.float32) -> None:
    """One decode step of S sequences (offsets anywhere in the first three chunks, completions
    included, partial chunks from a prefill) from layer_views inputs and from contiguous copies of
    them: rows, boundary states and buffers torch.equal. baseline: and (S > 1) the views read as if
    their rows were packed give other rows."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, 3 * L_, (S,), generator=g)
    offsets[: min(S, 2)] = torch.tensor([L_ - 1, 2 * L_ - 1][: min(S, 2)])  # completions
    slots = torch.randperm(S + 2, generator=g)[:S]
    prm = make_params(H_, P_, seed, dev, realistic=dev != "cpu")
    st = make_state(S + 2, H_, P_, G, N_, L_, dt_, dev, seed=seed, scale=1.0 if dev == "cpu" else 0.3)
    idx = [i for i in range(S) if int(offsets[i]) % L_]
    if idx:
        pre = [make_tokens(int(offsets[i]) % L_, H_, P_, G, N_, seed * 100 + i, dt_, dev) for i in idx]
        prefill(st, [int(slots[i]) for i in idx], [int(offsets[i]) - int(offsets[i]) % L_ for i in idx], pre, prm)
    x, dt, B, C = make_tokens(S, H_, P_, G, N_, seed + 7, dt_, dev)
    slots, offsets = slots.to(dev), offsets.to(dev)
    ref = clone_state(st)
    kw = dict(cfg=CFG, mode=mode, row_tile=CFG.scan_row_tile(L_) if dev == "cpu" else None)
    views = layer_views(x, dt, B, C)
    before = clone_state(st)
    y = decode_step_triton(st, slots, offsets, *views, params_of(prm), **kw)
    y_ref = decode_step_triton(ref, slots, offsets, x, dt, B, C, params_of(prm), **kw)
    assert torch.equal(y, y_ref)
    assert_same_state(st, ref)
    if baseline and S > 1:  # the views' memory read as packed rows (a kernel that ignores the row stride)
        flat = [v.as_strided(v.shape, torch.empty(v.shape).stride()) for v in views]
        y_bad = decode_step_triton(before, slots, offsets, *flat, params_of(prm), **kw)
        assert not torch.equal(y_bad, y_ref)


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "row", "step"])
@pytest.mark.parametrize("S", [1, 3, 16])  # the GPU test: the benchmark batches 64 and 256
def test_row_strided_inputs_give_the_bits_of_copies(mode, S):
    """In a model x, B, C (the conv's output) and dt (in_proj's) are row-strided views; every mode
    reads them where they lie and gives the rows, states and buffers of contiguous copies."""
    _strided_against_contiguous(mode, S, 2, 2, P, N, L, seed=21 + S, baseline=True)


@pytest.mark.interpreter
@interp
@settings(max_examples=6, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])
@given(data=hst.data())
def test_row_strided_inputs_property(data):
    """The same over batch sizes, heads, groups, head dims, state sizes and chunk sizes."""
    G = data.draw(hst.sampled_from([1, 2]), label="G")
    _strided_against_contiguous(data.draw(hst.sampled_from(["tile", "row", "step"]), label="mode"),
                                data.draw(hst.integers(1, 5), label="S"),
                                G * data.draw(hst.sampled_from([1, 2]), label="heads per group"), G,
                                data.draw(hst.sampled_from([8, 16]), label="P"),
                                data.draw(hst.sampled_from([8, 16]), label="N"),
                                data.draw(hst.sampled_from([16, 32]), label="L"), seed=data.draw(hst.integers(0, 99)))


def _input_copies(monkeypatch, mode: str, views: bool, old: bool = False) -> int:
    """ATen copies (clone, copy_, _to_copy) made by one decode step of 3 sequences. views: the inputs
    as layer_views gives them; old: the launcher copies every input first (``_rows`` as before)."""
    from torch.utils._python_dispatch import TorchDispatchMode


    if old:
        monkeypatch.setattr(td, "_rows", lambda t: t.contiguous())
    G, S = 1, 3
    prm = make_params(H, P, seed=4)
    st = make_state(S, H, P, G, N, L, torch.float32, "cpu", seed=4)
    toks = make_tokens(S, H, P, G, N, seed=4)
    if views:
        toks = layer_views(*toks)
    sl, pos = torch.arange(S), torch.tensor([3, 9, 40])
    params = params_of(prm)
    copies, inside = [0], [False]

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            copies[0] += not inside[0] and func.overloadpacket.__name__ in ("clone", "copy_", "_to_copy")
            return func(*args, **(kwargs or {}))

    run = type(td._prep_kernel).run

    def launch(self, *a, **k):  # the interpreter's own copies (to and from the host) are not the launcher's
        inside[0] = True
        try:
            return run(self, *a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(type(td._prep_kernel), "run", launch)
    with Copies():
        decode_step_triton(st, sl, pos, *toks, params, cfg=CFG, mode=mode, completes=False)
    return copies[0]


@pytest.mark.interpreter
@interp
@pytest.mark.parametrize("mode", ["tile", "row", "step"])
def test_row_strided_inputs_are_not_copied(mode, monkeypatch):
    """No copy of the layer's views at batch > 1; the launcher as it was (every input made contiguous,
    the baseline) made four a layer, one per input."""
    assert _input_copies(monkeypatch, mode, views=True) == 0
    assert _input_copies(monkeypatch, mode, views=False) == 0
    assert _input_copies(monkeypatch, mode, views=True, old=True) == 4


@pytest.mark.interpreter
@interp
def test_rows_copies_only_unpacked_rows():
    """_rows keeps a view whose rows are packed (any row stride, size-1 dims with any stride) and
    copies one whose rows are not."""
    wide = torch.randn(4, 40)
    v = wide[:, 3:35].view(4, 2, 16)
    assert _rows(v) is v
    dt = wide[:, 36:38]
    assert _rows(dt) is dt
    odd = wide[:, 3:35].view(4, 16, 2).transpose(1, 2)  # [4, 2, 16], elements 2 apart
    out = _rows(odd)
    assert out.is_contiguous() and torch.equal(out, odd)
    one = wide.as_strided((4, 1, 16), (40, 999, 1))  # a size-1 dim's stride is unused
    assert _rows(one) is one


def test_completions_on_holds_its_stream_for_its_own_thread_only():
    """A decode inside ``completions_on`` in one thread sends its completions to the side stream; another
    thread's decode at the same time (another model's capture) keeps them in order on its own stream. The
    context restores the outer stream on exit, and joins nothing it did not fork."""
    import threading

    outer, inner = object(), object()  # never used as streams: no decode launches here
    seen: dict[str, object] = {}
    entered, checked = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait(5)
        seen["other"] = td._COMPLETION_STREAM.get()
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with td.completions_on(outer):
        with td.completions_on(inner):
            seen["inner"] = td._COMPLETION_STREAM.get()[0]
        seen["outer"] = td._COMPLETION_STREAM.get()[0]
        entered.set()
        checked.wait(5)
    t.join(5)
    assert seen == {"inner": inner, "outer": outer, "other": None}
    assert td._COMPLETION_STREAM.get() is None


@pytest.mark.interpreter
@interp
def test_step_mode_is_one_launch_per_layer():
    """A decode step of one layer: four launches in "tile" mode (prep, tile, and the two completion
    kernels, which a captured step always runs), one in "step" mode."""
    from triton.runtime import KernelInterface


    kernels = [k for k in vars(td).values() if isinstance(k, KernelInterface)]
    launched: list[str] = []
    hooks = []
    for k in kernels:
        def hook(*args, _name=k.__name__, **kwargs):
            launched.append(_name)
        k.add_pre_run_hook(hook)
        hooks.append((k, hook))
    try:
        counts = {}
        for mode in ("tile", "step"):
            launched.clear()
            _step_against_general(mode, 2, 1, 16, 16, 32, [5, 40], seed=1)
            counts[mode] = list(launched)
    finally:
        for k, hook in hooks:
            k.pre_run_hooks.remove(hook)
    assert counts == {"tile": ["_prep_kernel", "_tile_kernel", "_update_kernel", "_zero_kernel"],
                      "step": ["_step_kernel"]}


_PTX_PROBE = r"""
import inspect, json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until
from aligned_mamba.ops.ssd import triton_chunk as tc, triton_decode as td

H, G, L, P, N = 32, 1, 256, 64, 128
D = dict(H=H, G=G, L=L, P=P, N=N)


def ptx(fn, sig, consts):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return compile_until(src, dict(num_warps=4), until="ptx").asm["ptx"]  # no ptxas: the check reads the PTX


def line_of(mod, text):
    return [i + 1 for i, ln in enumerate(open(mod.__file__).read().splitlines()) if text in ln][0]


def ops(code, fname, line, follow=("standard.py", "core.py")):
    out, on = [], False
    for ln in code.splitlines():
        m = re.search(r"\.loc\s+\d+\s+\d+\s+\d+\s+//\s+(\S+):(\d+):", ln)
        if m:
            on = (m.group(1), int(m.group(2))) == (fname, line) or (m.group(1) in follow and on)
            continue
        s = ln.strip()
        if on and re.match(r"(fma|mul|add|sub)\.(rn\.)?f32|shfl|selp|ld\.shared|st\.shared", s):
            out.append(s)
    names = {}
    def rn(m):
        return names.setdefault(m.group(0), f"v{len(names)}")
    return [re.sub(r"%r\d+|%p\d+|%rd\d+", rn, re.sub(r"\[.*?\]", "[M]", o)) for o in out]


f32 = "*fp32"
pre = ptx(tc._cumsum_kernel, {"dt_ptr": f32, "A_ptr": f32, "a_ptr": f32}, dict(H=H, L=L, BLOCK_L=L))
tile_consts = dict(D, R=16, BLOCK_K=32, BLOCK_P=64, BLOCK_N=64, PRECISION="ieee", TC=False)
ints = dict(h_row_ptr="*i64", tile_chunk_ptr="*i64", tile_pos_ptr="*i64", tile_rows_ptr="*i64", sD_h="i32",
            sD_p="i32", sx="i32", sc="i32", part_ptr="*i64", row0_ptr="*i64", length_ptr="*i64")
tile_sig = {k: ints.get(k, f32) for k in inspect.signature(tc._tile_output_kernel.fn).parameters
            if k not in tile_consts}
tile = ptx(tc._tile_output_kernel, tile_sig, tile_consts)
row_sig = {"buf_x_ptr": "*bf16", "dts_ptr": f32, "state_ptr": f32, "slots_ptr": "*i64", "pos_ptr": "*i64",
           "C_ptr": "*bf16", "A_ptr": f32, "D_ptr": f32, "y_ptr": "*bf16", "a_ptr": f32, "cb_ptr": f32,
           "sD_h": "i32", "sD_p": "i32", "sC_q": "i32"}
row = ptx(td._row_kernel, row_sig, dict(D, HPP=2, RB_P=64, BLOCK_L=L, SB=16))
a = ops(pre, "triton_chunk.py", line_of(tc, "a = tl.cumsum("))
b = ops(row, "triton_decode.py", line_of(td, "a = tl.cumsum("))
ep = lambda code, f, mod, epi: sorted({o.split()[0] for o in ops(code, f, line_of(mod, epi), follow=())
                                       if o.split()[0].startswith(("fma", "mul", "add", "sub"))})
print(json.dumps({"scan_len": len(a), "scan_same": a == b[:len(a)],
                  "epilogue_prefill": ep(tile, "triton_chunk.py", tc, "out = acc + d"),
                  "epilogue_row": ep(row, "triton_decode.py", td, "out = intra + d * x_t")}))
"""


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_row_kernel_matches_prefill_arithmetic(sm90_cache):
    """Offline sm_90 compile (no GPU needed): the decode's cumsum compiles to the prefill cumsum's
    instruction dataflow (including the dt*A contraction), and both epilogues are fused multiply-adds."""
    r = run_sm90_script(_PTX_PROBE, sm90_cache, timeout=600)
    assert r["scan_len"] > 20 and r["scan_same"], r
    assert r["epilogue_prefill"] == r["epilogue_row"] == ["fma.rn.f32"], r


@pytest.mark.interpreter
def test_bad_arguments():
    st = make_state(1, H, P, 1, N, L, torch.float32, "cpu")
    x, dt, B, C = make_tokens(1, H, P, 1, N, seed=0)
    prm = make_params(H, P, seed=0)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="mode"):
        decode_step_triton(st, one, one, x, dt, B, C, params_of(prm), cfg=CFG, mode="fast")
    with pytest.raises(ValueError, match="do not match"):
        decode_step_triton(st, one, one, x[:, :1], dt, B, C, params_of(prm), cfg=CFG)
    with pytest.raises(ValueError, match="row tile"):
        decode_step_triton(st, one, one, x, dt, B, C, params_of(prm), cfg=CFG, row_tile=24)


# ------------------------------------------------------------------------------------------
# GPU: real shapes, bf16
# ------------------------------------------------------------------------------------------

SHAPES = {"32h_1g": (32, 1), "64h_8g": (64, 8), "128h_8g": (128, 8)}
GP, GN, GL = 64, 128, 256


def _gpu_batch_case(heads: int, groups: int, batch: int, mode: str, seed: int, steps: int = 3, alone: int = 0,
                    dev: str = "cuda", dt_: torch.dtype = torch.bfloat16, dims: tuple[int, int, int] | None = None,
                    exact: bool = True, row_tile: int | None = None, side: torch.cuda.Stream | None = None):
    """batch sequences at offsets uniform in [0, L) (some at L-1, L-2, 0 forced), nonzero boundary
    states, partial chunks filled by a prefill; decode `steps` tokens; compare every row, state and
    buffer with one prefill over (chunk prefix + new tokens) from the boundary, and the first
    `alone` sequences with themselves decoded alone. (dev, dt_, dims, exact: for a dry run of this
    check through the interpreter at tiny shapes.)"""
    GP, GN, GL = dims or (globals()["GP"], globals()["GN"], globals()["GL"])
    g = torch.Generator().manual_seed(seed)
    offs = torch.randint(0, GL, (batch,), generator=g)
    forced = [GL - 1, GL - 2, 0, 1]
    offs[: min(batch, len(forced))] = torch.tensor(forced[: min(batch, len(forced))])
    chunk_k = torch.randint(0, 3, (batch,), generator=g)  # the boundary: 0, L or 2L
    start = (chunk_k * GL + offs).tolist()
    bound = (chunk_k * GL).tolist()
    nslots = batch + 7
    slots = torch.randperm(nslots, generator=g)[:batch].tolist()
    prm = make_params(heads, GP, seed, dev, realistic=True)
    st = make_state(nslots, heads, GP, groups, GN, GL, dt_, dev, seed=seed, scale=0.3)
    pre = [make_tokens(int(o), heads, GP, groups, GN, seed * 1000 + i, dt_, dev) for i, o in enumerate(offs)]
    if any(int(o) for o in offs):
        idx = [i for i in range(batch) if int(offs[i])]
        prefill(st, [slots[i] for i in idx], [bound[i] for i in idx], [pre[i] for i in idx], prm)
    new = [make_tokens(steps, heads, GP, groups, GN, seed * 1000 + 500 + i, dt_, dev) for i in range(batch)]
    ref = clone_state(st)
    solo = clone_state(st) if alone else None
    ys = decode_steps(st, slots, start, new, prm, steps, mode, hint=False, row_tile=row_tile, side=side)
    for i in range(alone):
        ya = decode_steps(solo, [slots[i]], [start[i]], [new[i]], prm, steps, mode)
        assert all(torch.equal(ys[k][i], ya[k][0]) for k in range(steps)), f"sequence {i} differs alone"
    for b in (ref.buf_x, ref.buf_dt, ref.buf_B):
        b[torch.tensor(slots)] = 0
    toks = [tuple(torch.cat([a, b]) for a, b in zip(pre[i], new[i])) for i in range(batch)]
    yp = prefill(ref, slots, bound, toks, prm)
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    bad = [i for i in range(batch) if not same(torch.stack([ys[k][i] for k in range(steps)]), yp[i][-steps:])]
    assert not bad, f"{len(bad)}/{batch} sequences differ (offsets {[int(offs[i]) for i in bad[:8]]})"
    assert_same_state(st, ref)
    return st, ys


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("batch", [4, 64])
def test_gpu_completions_on_a_side_stream_keep_the_bits(batch, monkeypatch):
    """Each step inside ``completions_on``: the completion launches go to the side stream (spied; without the
    context they go to the current one) and rows, boundary states and buffers are one prefill's (offsets
    L - 1 and L - 2 complete their chunks in the first two steps; later steps read what those wrote)."""
    side = torch.cuda.Stream()
    streams = []

    class Spy:
        def __getitem__(self, grid):
            streams.append(torch.cuda.current_stream().cuda_stream)
            return real[grid]

    real = td._update_kernel
    monkeypatch.setattr(td, "_update_kernel", Spy())
    _gpu_batch_case(64, 8, batch, "tile", seed=31 + batch, steps=4, side=side)
    assert streams and set(streams) == {side.cuda_stream}, streams
    streams.clear()
    _gpu_batch_case(64, 8, batch, "tile", seed=31 + batch, steps=4)
    assert streams and side.cuda_stream not in streams


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", ["tile", "step"])
def test_gpu_bf16_state_copy_keeps_rows_and_states(mode):
    """``test_bf16_state_copy_keeps_rows_and_states`` at mamba2-1.3b's heads and L = 256, the tensor-core dots
    reading the copy: the rows and states of a state without one; a prefill leaving the copy stale gives others."""
    _check_copy(mode, "cuda", dims=(64, GP, 1, GN, GL))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", ["tile", "step"])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_gpu_row_strided_inputs_give_the_bits_of_copies(mode, batch):
    """mamba2-1.3b's heads in bf16: the layer's column slices read in place give the rows, boundary states
    and buffers of contiguous copies, and (batch > 1) the slices read as packed rows give other rows."""
    _strided_against_contiguous(mode, batch, 64, 1, GP, GN, GL, seed=batch, baseline=True, dev="cuda",
                                dt_=torch.bfloat16)


@pytest.mark.gpu
@gpu_only
def test_gpu_dt_softplus_bits():
    g = torch.Generator().manual_seed(1)
    raw = torch.cat([torch.randn(1 << 20, generator=g) * 6.0, torch.linspace(-120.0, 60.0, 1 << 16),
                     torch.tensor([0.0, -0.0, 1e-30, 20.0, 20.000002, 19.999998, -87.3, -88.1, float("inf")])])
    raw = raw[: raw.numel() // 8 * 8].view(-1, 8).cuda()
    bias = torch.linspace(-1.0, 1.0, 8).cuda()
    for lim in (NO_LIMIT, (1e-3, 0.1)):
        for dtype in (torch.float32, torch.bfloat16):
            r = raw.to(dtype)
            assert torch.equal(dt_softplus_triton(r, bias, lim).view(torch.int32),
                               dt_softplus(r, bias, lim).view(torch.int32)), (lim, dtype)


# (model dtype, decode mode): bf16 runs tensor-core dots and "tile" only; fp32 runs fp32 dots, both modes
GPU_MODES = {"bf16-tile": (torch.bfloat16, "tile"), "bf16-step": (torch.bfloat16, "step"),
             "fp32-row": (torch.float32, "row"), "fp32-tile": (torch.float32, "tile")}


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("kind", list(GPU_MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_token_by_token_equals_prefill(shape, kind):
    """One sequence decoded token by token over 300 tokens from a mid-chunk start, crossing a chunk
    boundary, == one prefill from the boundary over the same tokens: every row and the final state."""
    heads, groups = SHAPES[shape]
    dtype, mode = GPU_MODES[kind]
    _token_by_token_case(heads, groups, mode, first=100, steps=300, dt_=dtype)


def _token_by_token_case(heads: int, groups: int, mode: str, first: int, steps: int, dev: str = "cuda",
                         dt_: torch.dtype = torch.bfloat16, dims: tuple[int, int, int] | None = None,
                         exact: bool = True, cfg: TritonKernelConfigs = CFG,
                         ref_cfg: TritonKernelConfigs | None = None):
    GP, GN, GL = dims or (globals()["GP"], globals()["GN"], globals()["GL"])
    prm = make_params(heads, GP, 3, dev, realistic=True)
    st = make_state(1, heads, GP, groups, GN, GL, dt_, dev, seed=3, scale=0.3)
    toks = make_tokens(first + steps, heads, GP, groups, GN, seed=3, dtype=dt_, dev=dev)
    ref = clone_state(st)
    prefill(st, [0], [GL], [tuple(t[:first] for t in toks)], prm, cfg=cfg)
    ys = decode_steps(st, [0], [GL + first], [tuple(t[first:] for t in toks)], prm, steps, mode, cfg=cfg)
    yp = prefill(ref, [0], [GL], [toks], prm, cfg=ref_cfg or cfg)[0][first:]
    yd = torch.cat(ys)
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    rows_equal = sum(bool(same(yd[i], yp[i])) for i in range(steps))
    assert rows_equal == steps, f"{rows_equal}/{steps} rows equal"
    assert_same_state(st, ref)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("mode", ["tile", "step"])
def test_gpu_round_dots_token_by_token_equals_prefill(mode):
    """bf16_dots "round": the prefill's tiles read boundary states the pass stored as bf16, decode the fp32
    state it rounds at the dot; the rows equal only if both round alike. The baseline, the reference prefill
    in "split2", differs."""
    heads, groups = SHAPES["64h_8g"]
    rnd = TritonKernelConfigs(bf16_dots="round")
    _token_by_token_case(heads, groups, mode, first=100, steps=300, cfg=rnd)
    with pytest.raises(AssertionError, match="rows equal"):
        _token_by_token_case(heads, groups, mode, first=100, steps=300, cfg=rnd,
                             ref_cfg=TritonKernelConfigs(bf16_dots="split2"))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_tile_loop_forms_give_the_same_bits(monkeypatch, batch):
    """``triton_decode.TILE_RT_RANGE``: the decode tile's K loop as a pipelined run-time range (the default) and as the
    while loop (the interpreter's form). Token by token (batch 1) and a batch at mixed offsets, each form's rows and
    states equal the prefill's; against a "split2" prefill they do not (the baseline)."""
    heads, groups = SHAPES["64h_8g"]
    for rt in (True, False):
        monkeypatch.setattr(td, "TILE_RT_RANGE", rt)
        if batch > 1:
            _gpu_batch_case(heads, groups, batch, "tile", seed=17 + batch, dt_=torch.bfloat16)
        else:
            _token_by_token_case(heads, groups, "tile", first=100, steps=300)
    if batch == 1:
        with pytest.raises(AssertionError, match="rows equal"):
            _token_by_token_case(heads, groups, "tile", first=100, steps=300,
                                 ref_cfg=TritonKernelConfigs(bf16_dots="split2"))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("kind", list(GPU_MODES))
@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_batch_offsets_equal_prefill(shape, batch, kind):
    heads, groups = SHAPES[shape]
    dtype, mode = GPU_MODES[kind]
    _gpu_batch_case(heads, groups, batch, mode, seed=17 + batch, dt_=dtype)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("kind", list(GPU_MODES))
def test_gpu_batch_invariance(kind):
    """A sequence's rows do not depend on the other sequences of the batch or on its slot."""
    heads, groups = SHAPES["64h_8g"]
    dtype, mode = GPU_MODES[kind]
    _gpu_batch_case(heads, groups, 256, mode, seed=5, steps=2, alone=6, dt_=dtype)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("row_tile", [16, 32, 64])
def test_gpu_decode_row_tile_does_not_touch_bits(row_tile):
    """bf16 tensor-core dots: the decode's row tile (16, the default, to 64, the prefill's) gives the
    prefill's bits: a row's result does not depend on the tile's height."""
    heads, groups = SHAPES["64h_8g"]
    g = torch.Generator().manual_seed(row_tile)
    _gpu_batch_case(heads, groups, 64, "tile", seed=int(torch.randint(0, 1000, (1,), generator=g)), steps=2,
                    row_tile=row_tile)


@pytest.mark.gpu
@gpu_only
def test_gpu_bf16_row_mode_refused():
    heads, groups = SHAPES["32h_1g"]
    st = make_state(1, heads, GP, groups, GN, GL, torch.bfloat16, "cuda")
    x, dt, B, C = make_tokens(1, heads, GP, groups, GN, seed=0, dtype=torch.bfloat16, dev="cuda")
    one = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="tensor cores"):
        decode_step_triton(st, one, one, x, dt, B, C, params_of(make_params(heads, GP, 0, "cuda")), cfg=CFG,
                           mode="row")


@pytest.mark.gpu
@gpu_only
def test_gpu_fp32_step_mode_refused():
    heads, groups = SHAPES["32h_1g"]
    st = make_state(1, heads, GP, groups, GN, GL, torch.float32, "cuda")
    x, dt, B, C = make_tokens(1, heads, GP, groups, GN, seed=0, dtype=torch.float32, dev="cuda")
    one = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="step mode runs bf16"):
        decode_step_triton(st, one, one, x, dt, B, C, params_of(make_params(heads, GP, 0, "cuda")), cfg=CFG,
                           mode="step")


def _second_process_rows(mode: str) -> torch.Tensor:
    heads, groups = SHAPES["32h_1g"]
    _, ys = _gpu_batch_case(heads, groups, 64, mode, seed=99, steps=2)
    return torch.stack(ys).cpu()


@pytest.mark.gpu
@gpu_only
def test_gpu_second_process_same_bits(tmp_path):
    """The same decode in a fresh process (fresh Triton load of the compiled kernels) gives the same bits."""
    here = _second_process_rows("tile")
    out = tmp_path / "rows.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = os.path.dirname(tests)
    env["PYTHONPATH"] = os.pathsep.join([root, tests, env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, os.path.abspath(__file__), "--dump", str(out)], check=True, env=env, cwd=root,
                   timeout=300)
    there = torch.load(out)
    assert torch.equal(here.view(torch.int16), there.view(torch.int16))


if __name__ == "__main__":  # the second process of test_gpu_second_process_same_bits
    if len(sys.argv) == 3 and sys.argv[1] == "--dump":
        torch.save(_second_process_rows("tile"), sys.argv[2])


def _decode_from_prefill(H: int, P: int, G: int, N: int, L: int, start: int) -> tuple[SSDState, SSDState, list]:
    """Prefill ``start`` tokens, decode to 3 L + 8 token by token; and one prefill of all of them.
    Returns (decoded state, prefilled state, positions whose decode row differs from the prefill's)."""
    T = 3 * L + 8
    prm = params_of(make_params(H, P, seed=5, dev="cuda"))
    x, dt, B, C = make_tokens(T, H, P, G, N, seed=5, dev="cuda")
    ref = make_state(1, H, P, G, N, L, torch.float32, "cuda")
    y_ref = replay_chunk_triton(ref, Step.make([0], [0], [T]), x, dt, B, C, prm, cfg=CFG)
    st = make_state(1, H, P, G, N, L, torch.float32, "cuda")
    replay_chunk_triton(st, Step.make([0], [0], [start]), x[:start], dt[:start], B[:start], C[:start], prm, cfg=CFG)
    slot = torch.zeros(1, dtype=torch.int64, device="cuda")
    bad = []
    for p in range(start, T):
        y = decode_step_triton(st, slot, torch.full((1,), p, device="cuda"), x[p:p + 1], dt[p:p + 1], B[p:p + 1],
                               C[p:p + 1], prm, cfg=CFG, mode="row")
        if not torch.equal(y[0], y_ref[p]):
            bad.append(p)
    return st, ref, bad


# (H, P, G, N, L): the decode's chunk completions from a prefilled, nonzero boundary state, at chunk
# sizes of one K block (32), where Triton once folded the completion's add into its dot (the
# boundary state rounded otherwise on the H200; tests/ops/ssd/test_triton_compile.py), and of several.
@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", [(4, 64, 2, 32, 32), (8, 64, 2, 64, 32), (4, 64, 1, 16, 32), (8, 64, 2, 64, 64),
                                   (8, 64, 1, 128, 256), (8, 64, 2, 32, 64)])
def test_gpu_fp32_small_state_completion(shape):
    H, P, G, N, L = shape
    st, ref, bad = _decode_from_prefill(H, P, G, N, L, start=L + L // 2 + 3)
    assert not bad and torch.equal(st.ssm_state, ref.ssm_state), (bad[:8], shape)
