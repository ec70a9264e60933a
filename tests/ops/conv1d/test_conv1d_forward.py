"""The Triton causal conv1d + SiLU forward (``ops/conv1d/triton.py``): prefill, chunked prefill, decode.

- interpreter (the Triton interpreter on a CPU; compiled where a GPU runs them): fp32, tiny shapes,
  the logic against the torch op: the outputs and the windows bit for bit, only the call's slots
  updated; decode steps and chunked prefill give the one pass's rows; the forward's walk (each input
  row read once) gives the tile kernel's bits at every row block and width; a decode step in one
  launch (``conv_step_triton``) gives the two-launch form's; strided rows taken, a window of another
  dtype refused. Each comparison has a baseline (the taps summed in another order) that differs.
  With ``silu="device"`` (the GPU's exp and division) the same equalities hold among the Triton forms,
  the outputs differ from ``"ieee"``'s and are within fp32 rounding of the fp64 SiLU.
- gpu (skipped without CUDA; run on the H200): bf16 at the model widths: decode rows equal prefill
  rows for 64 sequences split at random points, and equal the torch op's (``"ieee"``); the one-launch
  decode step equals the two-launch form; both SiLUs.

The backward: tests/ops/conv1d/test_conv1d_backward_walk.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import CFG, DEV, gpu, rand  # noqa: E402

from aligned_mamba.ops import conv1d  # noqa: E402
from aligned_mamba.ops.conv1d import triton as ct  # noqa: E402

IEEE = dataclasses.replace(CFG, silu="ieee")  # the torch op's bits


def _conv_case(lens: list[int], Cd: int = 40, K: int = 4, slots: int = 7, seed: int = 30):
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    x, w, b = rand(T, Cd, seed=seed), rand(Cd, K, seed=seed + 1), rand(Cd, seed=seed + 2)
    win = rand(slots, K - 1, Cd, seed=seed + 3)
    return cu, x, w, b, win


@pytest.mark.interpreter
def test_conv_is_the_torch_op_bit_for_bit_and_updates_only_its_slots():
    lens = [5, 1, 0, 9, 2]
    cu, x, w, b, win = _conv_case(lens)
    slots = torch.tensor([5, 0, 2, 3, 6], device=DEV)
    ref, ref_win = conv1d.causal_conv1d(x, cu, win[slots], w, b)
    new = win.clone()
    out = ct.causal_conv1d_triton(x, cu, slots, new, w, b, IEEE)
    assert torch.equal(out, ref)
    assert torch.equal(new[slots], ref_win)
    assert torch.equal(new[[1, 4]], win[[1, 4]])
    ref_nb, _ = conv1d.causal_conv1d(x, cu, win[slots], w, None)
    assert torch.equal(ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, None, IEEE), ref_nb)
    # the default SiLU ("device") is the GPU's: another rounding than the torch op's
    assert not torch.equal(ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, b, CFG), ref)


SILUS = [IEEE, dataclasses.replace(CFG, silu="device")]


@pytest.mark.interpreter
@pytest.mark.parametrize("cfg", SILUS, ids=lambda c: c.silu)
def test_conv_decode_and_chunked_prefill_rows_equal_the_one_pass_rows(cfg):
    # two sequences of 11 tokens from fresh (zero) windows: one call, then chunks 4 + 7 side by
    # side with decode steps of the other, then token by token
    Cd, K = 40, 4
    x = rand(22, Cd, seed=40)
    w, b = rand(Cd, K, seed=41), rand(Cd, seed=42)
    xs = [x[:11], x[11:]]
    slots = torch.tensor([1, 3], device=DEV)

    def run(pieces: list[tuple[int, int]], windows: torch.Tensor) -> torch.Tensor:
        """pieces: (rows of seq 0, rows of seq 1) per call; returns each sequence's rows."""
        done, outs = [0, 0], [[], []]
        for n0, n1 in pieces:
            cu = torch.tensor([0, n0, n0 + n1], dtype=torch.int64, device=DEV)
            xin = torch.cat([xs[0][done[0]:done[0] + n0], xs[1][done[1]:done[1] + n1]])
            o = ct.causal_conv1d_triton(xin, cu, slots, windows, w, b, cfg)
            outs[0].append(o[:n0])
            outs[1].append(o[n0:])
            done = [done[0] + n0, done[1] + n1]
        return torch.cat([torch.cat(outs[0]), torch.cat(outs[1])])

    zeros = lambda: torch.zeros(4, K - 1, Cd, device=DEV)  # noqa: E731
    one = run([(11, 11)], zeros())
    assert torch.equal(run([(4, 1), (7, 1)] + [(0, 1)] * 9, zeros()), one)
    assert torch.equal(run([(1, 1)] * 11, zeros()), one)
    # the comparison can fail: the same sum in another order gives other bits for some elements
    wf = w.float()
    stream = torch.cat([torch.zeros(K - 1, Cd, device=DEV), xs[0]])
    rev = b.float().expand(11, Cd).clone()
    for k in reversed(range(K)):
        rev = rev + wf[:, k] * stream[k:k + 11]
    assert not torch.equal(torch.nn.functional.silu(rev), one[:11])


@pytest.mark.interpreter
@pytest.mark.parametrize("K,rows,silu,ahead", [(K, rows, "ieee", 2) for K in (4, 3, 2, 1) for rows in (1, 4, 16)]
                         + [(4, 4, "device", 2), (2, 16, "device", 2), (4, 1, "ieee", 4), (4, 4, "ieee", 4),
                            (3, 16, "device", 4)])
def test_conv_walk_is_the_tile_kernel_bit_for_bit(K, rows, silu, ahead, monkeypatch):
    """The forward's walk (each input row read once, the last K - 1 carried, ``WALK_AHEAD`` rows loaded
    ahead) against the tile kernel (``conv_walk=False``): the same outputs and windows bit for bit for
    sequences of every length (empty ones, ones shorter than the window, ones crossing row blocks of 1, 4
    and 16 rows), with and without a bias, at a row stride and over two channel blocks; the tile kernel's
    blocks inside one sequence past its window (rows 24, 40 and 48 at 8 rows a block) read x alone, the
    others the window. The same sum in reverse tap order differs, so the comparison can fail."""
    monkeypatch.setattr(ct, "WALK_AHEAD", ahead)
    lens = [5, 1, 0, 9, 2, 0, 17, 3, 26]
    Cd = 40
    cu, x, w, b, win = _conv_case(lens, Cd=Cd, K=K, slots=11, seed=70 + K)
    wide = torch.cat([x, x[:, :5]], dim=1)[:, :Cd]
    slots = torch.tensor([5, 0, 2, 3, 6, 10, 1, 8, 4], device=DEV)
    walk = dataclasses.replace(CFG, conv_walk=True, conv_walk_block_t=rows, conv_walk_block_c=32, silu=silu)
    tile = dataclasses.replace(CFG, conv_walk=False, conv_block_t=8, conv_block_c=32, silu=silu)
    for bias in (b, None):
        got_win, ref_win = win.clone(), win.clone()
        got = ct.causal_conv1d_triton(wide, cu, slots, got_win, w, bias, walk)
        ref = ct.causal_conv1d_triton(x, cu, slots, ref_win, w, bias, tile)
        assert torch.equal(got, ref) and torch.equal(got_win, ref_win)
    stream = [torch.cat([win[s], x[int(cu[i]):int(cu[i + 1])]]) for i, s in enumerate(slots.tolist())]
    rev = torch.cat([sum((w[:, k] * st[k:k + len(st) - K + 1] for k in reversed(range(K))),
                         torch.zeros(len(st) - K + 1, Cd, device=DEV)) for st in stream])
    assert not torch.equal(torch.nn.functional.silu(rev), got)


@pytest.mark.interpreter
@pytest.mark.parametrize("K,with_bias,silu", [(4, True, "ieee"), (4, False, "ieee"), (2, True, "ieee"),
                                              (4, True, "device")])
def test_conv_decode_step_in_one_launch_is_the_two_launch_form(K, with_bias, silu):
    """A decode step (one row per sequence, scattered slots, row-strided x): ``conv_step_triton``'s
    outputs and windows are ``causal_conv1d_triton``'s bit for bit, in one launch instead of two."""
    from triton.runtime import KernelInterface


    S, Cd = 5, 300  # two channel blocks, the second partial
    _, x, w, b, win = _conv_case([1] * S, Cd=Cd, K=K, slots=9, seed=60)
    b = b if with_bias else None
    cfg = dataclasses.replace(CFG, silu=silu)
    wide = torch.cat([x[:, :7], x, x], dim=1)[:, 7:7 + Cd]  # x at a row stride of 2 Cd + 7, as xBC in in_proj's output
    assert torch.equal(wide, x) and wide.stride(0) != Cd
    slots = torch.tensor([5, 0, 8, 3, 6], device=DEV)
    cu = torch.arange(S + 1, device=DEV)
    launched = []
    kernels = [k for k in vars(ct).values() if isinstance(k, KernelInterface)]
    hooks = [(k, lambda *a, _n=k.__name__, **kw: launched.append(_n)) for k in kernels]
    for k, h in hooks:
        k.add_pre_run_hook(h)
    try:
        ref_win = win.clone()
        ref = ct.causal_conv1d_triton(x, cu, slots, ref_win, w, b, cfg)
        two = list(launched)
        launched.clear()
        got_win = win.clone()
        got = ct.conv_step_triton(wide, slots, got_win, w, b, cfg)
    finally:
        for k, h in hooks:
            k.pre_run_hooks.remove(h)
    assert two == ["_conv_walk_kernel", "_window_kernel"] and launched == ["_conv_step_kernel"]
    assert torch.equal(got, ref)
    assert torch.equal(got_win, ref_win)
    assert not torch.equal(got_win[slots], win[slots])
    # the comparison can fail: the taps summed in another order give other bits for some element
    stream = torch.cat([win[slots], x[:, None]], dim=1).float()  # [S, K, Cd]
    rev = (b.float() if b is not None else torch.zeros(Cd, device=DEV)).expand(S, Cd).clone()
    for k in reversed(range(K)):
        rev = rev + w.float()[:, k] * stream[:, k]
    assert not torch.equal(torch.nn.functional.silu(rev).to(x.dtype), ref)


@pytest.mark.interpreter
def test_conv_device_silu_is_another_rounding_of_the_same_function():
    """``silu="device"`` reaches every forward form (tile kernel, walk, one-launch step): their outputs
    differ from ``"ieee"``'s in some elements and stay within a few fp32 roundings of the fp64 SiLU of
    the same pre-activation (the conv without its SiLU)."""
    lens = [9, 1, 17]
    Cd = 40
    cu, x, w, b, win = _conv_case(lens, Cd=Cd, slots=4, seed=90)
    slots = torch.tensor([3, 0, 1], device=DEV)
    pre = ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, b, CFG, activation=False).double()
    ref = torch.nn.functional.silu(pre)
    for form in (dict(conv_walk=True), dict(conv_walk=False)):
        ieee, dev = (ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, b, dataclasses.replace(CFG, silu=s, **form))
                     for s in ("ieee", "device"))
        assert not torch.equal(ieee, dev)
        for out in (ieee, dev):
            assert ((out.double() - ref).abs() <= 4 * 2.0 ** -24 * ref.abs() + 1e-30).all()
    steps = [ct.conv_step_triton(x[:4], torch.arange(4, device=DEV), win.clone(), w, b,
                                 dataclasses.replace(CFG, silu=s)) for s in ("ieee", "device")]
    assert not torch.equal(*steps)


@pytest.mark.interpreter
def test_conv_takes_strided_rows_and_refuses_a_window_of_another_dtype():
    cu, x, w, b, win = _conv_case([3, 2], Cd=16)
    wide = torch.cat([x, x], dim=1)[:, 16:]
    slots = torch.tensor([0, 1], device=DEV)
    assert torch.equal(ct.causal_conv1d_triton(wide, cu, slots, win.clone(), w, b, CFG),
                       ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, b, CFG))
    with pytest.raises(ValueError, match="round"):
        ct.causal_conv1d_triton(x, cu, slots, win.double(), w, b, CFG)


# -- gpu ------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("cfg", SILUS, ids=lambda c: c.silu)
def test_gpu_conv_decode_rows_equal_prefill_rows(cfg):
    # 64 sequences of 1 .. 300 tokens at the 8B mixer's conv width, bf16: one prefill call against
    # a split at a random point followed by decode steps; and against the torch op
    Cd, K, S = 10240, 4, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = torch.randint(1, 301, (S,), generator=g, device="cuda")
    T = int(lens.sum())
    x = torch.randn(T, Cd, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(Cd, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(Cd, device="cuda", generator=g).to(torch.bfloat16)
    cu = torch.zeros(S + 1, dtype=torch.int64, device="cuda")
    cu[1:] = lens.cumsum(0)
    slots = torch.randperm(S + 8, generator=g, device="cuda")[:S]
    one = ct.causal_conv1d_triton(x, cu, slots, torch.zeros(S + 8, K - 1, Cd, device="cuda", dtype=torch.bfloat16),
                                  w, b, cfg)
    ref, _ = conv1d.causal_conv1d(x, cu, torch.zeros(S, K - 1, Cd, device="cuda", dtype=torch.bfloat16), w, b)
    assert torch.equal(one, ref) == (cfg.silu == "ieee")  # "device": the hardware's exp, not the torch op's
    # prefill the first split_s tokens of each sequence, then decode the rest one token per step
    split = (lens.float() * torch.rand(S, generator=g, device="cuda")).long()
    win = torch.zeros(S + 8, K - 1, Cd, device="cuda", dtype=torch.bfloat16)
    got = torch.empty_like(one)
    cu_p = torch.zeros(S + 1, dtype=torch.int64, device="cuda")
    cu_p[1:] = split.cumsum(0)
    rows_p = torch.cat([torch.arange(int(cu[i]), int(cu[i] + split[i]), device="cuda") for i in range(S)])
    got[rows_p] = ct.causal_conv1d_triton(x[rows_p], cu_p, slots, win, w, b, cfg)
    pos = split.clone()
    while bool((pos < lens).any()):
        live = (pos < lens).nonzero().squeeze(1)
        rows = cu[live] + pos[live]
        cu_d = torch.arange(live.numel() + 1, device="cuda")
        got[rows] = ct.causal_conv1d_triton(x[rows], cu_d, slots[live], win, w, b, cfg)
        pos[live] += 1
    assert torch.equal(got, one)


@gpu
@pytest.mark.parametrize("cfg", SILUS, ids=lambda c: c.silu)
def test_gpu_conv_decode_step_in_one_launch_equals_two(cfg):
    # the 1.3b mixer's conv width, bf16, 64 sequences in scattered slots with random windows, x a
    # row-strided view as in the model: outputs and windows equal to the two-launch form's

    Cd, K, S = 4352, 4, 64
    g = torch.Generator(device="cuda").manual_seed(3)
    wide = torch.randn(S, 2 * Cd + 64, device="cuda", generator=g).to(torch.bfloat16)
    x = wide[:, 32:32 + Cd]
    w = torch.randn(Cd, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(Cd, device="cuda", generator=g).to(torch.bfloat16)
    win = torch.randn(S + 8, K - 1, Cd, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(S + 8, generator=g, device="cuda")[:S]
    cu = torch.arange(S + 1, device="cuda")
    ref_win, got_win = win.clone(), win.clone()
    ref = ct.causal_conv1d_triton(x.contiguous(), cu, slots, ref_win, w, b, cfg)
    got = ct.conv_step_triton(x, slots, got_win, w, b, cfg)
    assert torch.equal(got, ref) and torch.equal(got_win, ref_win)
