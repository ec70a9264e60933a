"""The Triton GEMM, norms, conv1d and log-softmax (ops/*_triton.py).

Without a GPU these run through the Triton interpreter (tests/conftest.py turns it on): fp32 only
(the interpreter's bf16 arithmetic is wrong), tiny shapes (~15 ms per program), for the logic against
the torch ops. The GPU tests (marked ``gpu``, skipped without CUDA) check the bits at the model
shapes: a GEMM row is the same whatever M (where cuBLAS's is not), decode conv rows equal prefill
rows, norm and logprob rows do not depend on the other rows, and the GEMM is at the bf16 floor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

from aligned_mamba.ops import conv1d, logprobs, norm  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as ct  # noqa: E402
from aligned_mamba.ops.linear import triton as lt  # noqa: E402
from aligned_mamba.ops.logprobs import triton as lpt  # noqa: E402
from aligned_mamba.ops.norm import triton as nt  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CFG = TritonKernelConfigs()
# every regime on pointer loads (a persistent grid and split stores need TMA)
NO_TMA = dataclasses.replace(CFG, linear_tma=False, linear_persistent=False, linear_epi_split=1, linear_mid_tma=False,
                             linear_mid_persistent=False, linear_mid_programs_per_sm=1)


def gpu(f):
    """A GPU test: marked ``gpu`` and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(f))


def _rand(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


# -- configs -------------------------------------------------------------------------------------------


_REFUSED = [("linear_warps", 2), ("linear_block_k", 256), ("linear_persistent", 1), ("linear_epi_split", 4),
            ("linear_decode_stages", 9), ("linear_decode_tma", "yes"), ("linear_mid_programs_per_sm", 0),
            ("linear_fill_programs", -1), ("linear_mid_max_m", -1), ("norm_block_per_warp", 3),
            ("conv_block_c", 100), ("logprobs_block_v", 64)]


@pytest.mark.parametrize("field,value", _REFUSED)
def test_configs_refuse_values_no_kernel_implements(field, value):
    with pytest.raises(ValueError, match=field) as e:
        TritonKernelConfigs(**{field: value})
    assert "\n" not in str(e.value)


def test_the_mid_regime_cannot_end_below_the_decode_regime():
    with pytest.raises(ValueError, match="linear_mid_max_m"):
        TritonKernelConfigs(linear_decode_max_m=64, linear_mid_max_m=32)


def test_plan_takes_the_tile_of_each_m_regime_and_one_k_block():
    w = torch.empty(50280, 8, dtype=torch.bfloat16)  # enough columns that no N tile is halved
    c = CFG
    mid_m = c.linear_block_m - 1  # below the rows of the large tile: the mid tile whatever N
    tiles = {M: lt.plan(M, w, c, sms=132) for M in (1, c.linear_decode_max_m, c.linear_decode_max_m + 1, mid_m,
                                                    c.linear_mid_max_m + 1, 8192)}
    assert (tiles[1].block_m, tiles[1].block_n, tiles[1].tma) == (c.linear_decode_block_m, c.linear_decode_block_n,
                                                                  c.linear_decode_tma)
    assert tiles[c.linear_decode_max_m] == tiles[1]
    assert (tiles[mid_m].block_m, tiles[mid_m].block_n) == (c.linear_mid_block_m, c.linear_mid_block_n)
    assert (tiles[8192].block_m, tiles[8192].block_n, tiles[8192].persistent) == (c.linear_block_m, c.linear_block_n,
                                                                                  c.linear_persistent)
    assert {t.block_k for t in tiles.values()} == {c.linear_block_k}
    f32 = {lt.plan(M, w.float(), c, sms=132) for M in (1, 100, 8192)}
    assert len(f32) == 1 and next(iter(f32)).block_k == c.linear_fp32_block_k


def test_mid_calls_take_the_large_tile_and_a_persistent_grid_only_where_the_tiles_fill_the_gpu():
    c = CFG
    M = c.linear_mid_max_m
    head = lt.plan(M, torch.empty(50280, 8, dtype=torch.bfloat16), c, sms=132)  # 2 x 197 large tiles
    assert (head.block_m, head.block_n) == (c.linear_block_m, c.linear_block_n)
    proj = lt.plan(M, torch.empty(18560, 8, dtype=torch.bfloat16), c, sms=132)  # 2 x 73 large tiles: too few
    assert (proj.block_m, proj.block_n, proj.persistent) == (c.linear_mid_block_m, c.linear_mid_block_n, True)
    assert proj.programs_per_sm == c.linear_mid_programs_per_sm
    small = lt.plan(64, torch.empty(4096, 8, dtype=torch.bfloat16), c, sms=132)  # out_proj: 256 tiles after fill
    assert not small.persistent and small.programs_per_sm == 1
    never = dataclasses.replace(c, linear_mid_large_min_tiles_per_sm=0)
    assert lt.plan(M, torch.empty(50280, 8, dtype=torch.bfloat16), never, sms=132).block_m == c.linear_mid_block_m
    assert lt.plan(M, torch.empty(50280, 8, dtype=torch.bfloat16), c, sms=1024).block_m == c.linear_mid_block_m


def test_few_output_columns_halve_the_n_tile_and_keep_the_k_block():
    c = dataclasses.replace(CFG, linear_fill_programs=132)
    p = lt.plan(1, torch.empty(2048, 8, dtype=torch.bfloat16), c, sms=132)  # out_proj of a 2048-wide model
    assert p.block_n < c.linear_decode_block_n and p.block_k == c.linear_block_k
    assert 2048 // p.block_n >= 128 or p.block_n == 16
    big = lt.plan(1, torch.empty(50280, 8, dtype=torch.bfloat16), c, sms=132)
    assert big.block_n == c.linear_decode_block_n
    off = lt.plan(1, torch.empty(2048, 8, dtype=torch.bfloat16), dataclasses.replace(c, linear_fill_programs=0),
                  sms=132)
    assert off.block_n == c.linear_decode_block_n


# -- GEMM logic (fp32 through the interpreter on a CPU) ------------------------------------------------


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("M", [1, 3, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_fp32_matches_fp64(M, with_bias):
    # K = 80: the last K block is partly zero padding
    x, w = _rand(M, 80, seed=M), _rand(90, 80, seed=1)
    b = _rand(90, seed=2) if with_bias else None
    y = lt.linear_triton(x, w, b, CFG)
    assert y.dtype == torch.float32 and y.shape == (M, 90)
    ref = _ref(x, w, b)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


_SCHEDULES = [  # (block_m, block_n, block_k, warps, stages, group_m, persistent, tma, epi_split)
    (16, 32, 32, 4, 2, 1, False, True, 1),
    (32, 64, 32, 4, 2, 2, True, True, 2),
    (16, 16, 32, 4, 2, 4, True, True, 1),
    (32, 32, 32, 4, 2, 8, False, False, 1),
]


@pytest.mark.parametrize("tiles", _SCHEDULES, ids=lambda t: "x".join(map(str, t)))
def test_linear_every_schedule_computes_every_tile(tiles):
    # grouped, persistent (4 programs in the interpreter), TMA or pointer tiles over ragged edges;
    # the output is poisoned first, so a tile left out shows as NaN
    x, w, b = _rand(70, 64, seed=3), _rand(90, 64, seed=4), _rand(90, seed=5)
    p = lt.LinearPlan(*tiles, precision="ieee")
    y = lt.linear_triton(x, w, b, CFG, tiles=p)
    ref = _ref(x, w, b)
    assert not torch.isnan(y).any()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_linear_takes_strided_rows_and_refuses_mixed_dtypes():
    big = _rand(6, 100, seed=6)
    x, w = big[:, 10:74], _rand(24, 64, seed=7)
    assert torch.allclose(lt.linear_triton(x, w, None, CFG), (x.double() @ w.double().T).float(), rtol=1e-5,
                          atol=1e-5)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        lt.linear_triton(x, w.to(torch.bfloat16), None, CFG)
    assert lt.linear_triton(x[:0], w, None, CFG).shape == (0, 24)


# -- norms ---------------------------------------------------------------------------------------------


def test_rms_norm_and_residual_add_match_the_torch_ops():
    x, r, w = _rand(5, 48, seed=10), _rand(5, 48, seed=11), _rand(48, seed=12)
    torch.testing.assert_close(nt.rms_norm_triton(x, w, 1e-5, None, CFG), norm.rms_norm(x, w, 1e-5), rtol=2e-6,
                               atol=2e-6)
    out, res = nt.add_rms_norm_triton(x, r, w, 1e-5, None, CFG)
    assert torch.equal(res, r + x)
    torch.testing.assert_close(out, norm.rms_norm(r + x, w, 1e-5), rtol=2e-6, atol=2e-6)
    out, res = nt.add_rms_norm_triton(None, r, w, 1e-5, None, CFG)
    assert torch.equal(res, r) and res.data_ptr() != r.data_ptr()
    torch.testing.assert_close(out, norm.rms_norm(r, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_embedding_gather_is_the_first_residual():
    emb, w = _rand(11, 48, seed=13), _rand(48, seed=14)
    ids = torch.tensor([3, 0, 10, 3], device=DEV)
    out, res = nt.embed_rms_norm_triton(ids, emb, w, 1e-5, None, torch.float32, CFG)
    assert torch.equal(res, emb[ids])
    ref, _ = nt.add_rms_norm_triton(None, emb[ids], w, 1e-5, None, CFG)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_gated_norm_matches_the_torch_op(n_groups):
    y, w = _rand(5, 48, seed=15), _rand(48, seed=16)
    z = _rand(5, 100, seed=17)[:, 10:58]  # a column slice, as in_proj's output gives it
    torch.testing.assert_close(nt.gated_rms_norm_triton(y, z, w, 1e-5, n_groups, CFG),
                               norm.gated_rms_norm(y, z, w, 1e-5, n_groups), rtol=2e-6, atol=2e-6)


def test_a_norm_row_is_the_same_alone_and_among_others():
    x, w = _rand(6, 40, seed=18), _rand(40, seed=19)
    z = _rand(6, 40, seed=20)
    full = nt.rms_norm_triton(x, w, 1e-5, None, CFG)
    gfull = nt.gated_rms_norm_triton(x, z, w, 1e-5, 2, CFG)
    for i in (0, 3, 5):
        assert torch.equal(nt.rms_norm_triton(x[i:i + 1], w, 1e-5, None, CFG), full[i:i + 1])
        assert torch.equal(nt.gated_rms_norm_triton(x[i:i + 1], z[i:i + 1], w, 1e-5, 2, CFG), gfull[i:i + 1])


# -- conv1d --------------------------------------------------------------------------------------------


def _conv_case(lens: list[int], Cd: int = 40, K: int = 4, slots: int = 7, seed: int = 30):
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    x, w, b = _rand(T, Cd, seed=seed), _rand(Cd, K, seed=seed + 1), _rand(Cd, seed=seed + 2)
    win = _rand(slots, K - 1, Cd, seed=seed + 3)
    return cu, x, w, b, win


def test_conv_is_the_torch_op_bit_for_bit_and_updates_only_its_slots():
    lens = [5, 1, 0, 9, 2]
    cu, x, w, b, win = _conv_case(lens)
    slots = torch.tensor([5, 0, 2, 3, 6], device=DEV)
    ref, ref_win = conv1d.causal_conv1d(x, cu, win[slots], w, b)
    new = win.clone()
    out = ct.causal_conv1d_triton(x, cu, slots, new, w, b, CFG)
    assert torch.equal(out, ref)
    assert torch.equal(new[slots], ref_win)
    assert torch.equal(new[[1, 4]], win[[1, 4]])
    ref_nb, _ = conv1d.causal_conv1d(x, cu, win[slots], w, None)
    assert torch.equal(ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, None, CFG), ref_nb)


def test_conv_decode_and_chunked_prefill_rows_equal_the_one_pass_rows():
    # two sequences of 11 tokens from fresh (zero) windows: one call, then chunks 4 + 7 side by
    # side with decode steps of the other, then token by token
    Cd, K = 40, 4
    x = _rand(22, Cd, seed=40)
    w, b = _rand(Cd, K, seed=41), _rand(Cd, seed=42)
    xs = [x[:11], x[11:]]
    slots = torch.tensor([1, 3], device=DEV)

    def run(pieces: list[tuple[int, int]], windows: torch.Tensor) -> torch.Tensor:
        """pieces: (rows of seq 0, rows of seq 1) per call; returns each sequence's rows."""
        done, outs = [0, 0], [[], []]
        for n0, n1 in pieces:
            cu = torch.tensor([0, n0, n0 + n1], dtype=torch.int64, device=DEV)
            xin = torch.cat([xs[0][done[0]:done[0] + n0], xs[1][done[1]:done[1] + n1]])
            o = ct.causal_conv1d_triton(xin, cu, slots, windows, w, b, CFG)
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


@pytest.mark.parametrize("K", [4, 3, 2, 1])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_conv_walk_is_the_tile_kernel_bit_for_bit(K, rows):
    """The forward's walk (each input row read once, the last K - 1 carried) against the tile kernel
    (``conv_walk=False``): the same outputs and windows bit for bit for sequences of every length
    (empty ones, ones shorter than the window, ones crossing row blocks of 1, 4 and 16 rows), with and
    without a bias, at a row stride and over two channel blocks. The same sum in reverse tap order
    differs, so the comparison can fail."""
    lens = [5, 1, 0, 9, 2, 0, 17, 3]
    Cd = 40
    cu, x, w, b, win = _conv_case(lens, Cd=Cd, K=K, slots=11, seed=70 + K)
    wide = torch.cat([x, x[:, :5]], dim=1)[:, :Cd]
    slots = torch.tensor([5, 0, 2, 3, 6, 10, 1, 8], device=DEV)
    walk = dataclasses.replace(CFG, conv_walk=True, conv_walk_block_t=rows, conv_walk_block_c=32)
    tile = dataclasses.replace(CFG, conv_walk=False, conv_block_t=8, conv_block_c=32)
    for bias in (b, None):
        got_win, ref_win = win.clone(), win.clone()
        got = ct.causal_conv1d_triton(wide, cu, slots, got_win, w, bias, walk)
        ref = ct.causal_conv1d_triton(x, cu, slots, ref_win, w, bias, tile)
        assert torch.equal(got, ref) and torch.equal(got_win, ref_win)
    stream = [torch.cat([win[s], x[int(cu[i]):int(cu[i + 1])]]) for i, s in enumerate(slots.tolist())]
    rev = torch.cat([sum((w[:, k] * st[k:k + len(st) - K + 1] for k in reversed(range(K))),
                         torch.zeros(len(st) - K + 1, Cd, device=DEV)) for st in stream])
    assert not torch.equal(torch.nn.functional.silu(rev), got)


@pytest.mark.parametrize("K,with_bias", [(4, True), (4, False), (2, True)])
def test_conv_decode_step_in_one_launch_is_the_two_launch_form(K, with_bias):
    """A decode step (one row per sequence, scattered slots, row-strided x): ``conv_step_triton``'s
    outputs and windows are ``causal_conv1d_triton``'s bit for bit, in one launch instead of two."""
    from triton.runtime import KernelInterface


    S, Cd = 5, 300  # two channel blocks, the second partial
    _, x, w, b, win = _conv_case([1] * S, Cd=Cd, K=K, slots=9, seed=60)
    b = b if with_bias else None
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
        ref = ct.causal_conv1d_triton(x, cu, slots, ref_win, w, b, CFG)
        two = list(launched)
        launched.clear()
        got_win = win.clone()
        got = ct.conv_step_triton(wide, slots, got_win, w, b, CFG)
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


def test_conv_takes_strided_rows_and_refuses_a_window_of_another_dtype():
    cu, x, w, b, win = _conv_case([3, 2], Cd=16)
    wide = torch.cat([x, x], dim=1)[:, 16:]
    slots = torch.tensor([0, 1], device=DEV)
    assert torch.equal(ct.causal_conv1d_triton(wide, cu, slots, win.clone(), w, b, CFG),
                       ct.causal_conv1d_triton(x, cu, slots, win.clone(), w, b, CFG))
    with pytest.raises(ValueError, match="round"):
        ct.causal_conv1d_triton(x, cu, slots, win.double(), w, b, CFG)


# -- log-softmax ---------------------------------------------------------------------------------------


def test_log_softmax_matches_the_torch_op_and_token_logprobs_are_its_entries():
    cfg = dataclasses.replace(CFG, logprobs_block_v=128)  # 300 logits: three blocks, the last ragged
    x = _rand(4, 300, seed=50, scale=5.0)
    x[1, 7] = -float("inf")
    x[3] = -float("inf")
    lp = lpt.log_softmax_triton(x, cfg)
    ref = logprobs.log_softmax(x)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(lp)) and torch.equal(torch.isnan(lp), torch.isnan(ref))
    torch.testing.assert_close(lp[fin], ref[fin], rtol=1e-6, atol=2e-6)
    tok = torch.tensor([1, 7, 299, 0], device=DEV)
    tp, lse = lpt.token_logprobs_triton(x, tok, cfg, return_lse=True)
    assert torch.equal(tp[:3], lp[torch.arange(3), tok[:3]])
    assert torch.isnan(tp[3]) and lse[3] == -float("inf")
    # a row alone gives the same bits
    assert torch.equal(lpt.log_softmax_triton(x[2:3], cfg), lp[2:3])


# -- GPU: bits at the model shapes ---------------------------------------------------------------------

# (name, K, N): every linear layer of mamba2-130m, -1.3b, -2.7b, a Nemotron-H-8B mixer, a 256k lm_head
GEMM_SHAPES = [
    ("130m.in_proj", 768, 3352), ("130m.out_proj", 1536, 768), ("130m.lm_head", 768, 50280),
    ("1.3b.in_proj", 2048, 8512), ("1.3b.out_proj", 4096, 2048), ("1.3b.lm_head", 2048, 50280),
    ("2.7b.in_proj", 2560, 10576), ("2.7b.out_proj", 5120, 2560),
    ("8b.in_proj", 4096, 18560), ("8b.out_proj", 8192, 4096), ("lm_head_256k", 4096, 256000),
]
MS = [1, 2, 3, 7, 17, 63, 65, 255, 1000, 4097, 8192]


def _gpu_gemm_operands(K: int, N: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(8192, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    return x, w


def _rows_invariant(fn, x: torch.Tensor, ms: list[int]) -> list[tuple[int, int]]:
    """(M, differing rows) for each M: rows [s, s + M) of one call of M rows against the same rows of a
    call of all rows, s chosen so the slices cover the start, the middle and the end."""
    full = fn(x)
    bad = []
    for i, M in enumerate(ms):
        s = [0, (x.shape[0] - M) // 2, x.shape[0] - M][i % 3]
        part = fn(x[s:s + M])
        bad.append((M, int((part != full[s:s + M]).any(dim=1).sum())))
    return bad


@pytest.mark.parametrize("name,K,N", GEMM_SHAPES, ids=[s[0] for s in GEMM_SHAPES])
@gpu
def test_gpu_gemm_rows_do_not_depend_on_m(name, K, N):
    x, w = _gpu_gemm_operands(K, N, torch.bfloat16)
    b = (torch.randn(N, device="cuda") * 0.1).to(torch.bfloat16) if name.endswith("in_proj") else None
    bad = _rows_invariant(lambda t: lt.linear_triton(t, w, b, CFG), x, MS)
    assert all(n == 0 for _, n in bad), bad


@gpu
def test_gpu_cublas_rows_do_depend_on_m():
    # the baseline that the GEMM test would catch: cuBLAS at out_proj's shape (K 4096)
    x, w = _gpu_gemm_operands(4096, 2048, torch.bfloat16)
    bad = _rows_invariant(lambda t: torch.nn.functional.linear(t, w), x, [1, 7, 64])
    assert any(n > 0 for _, n in bad), bad


@gpu
def test_gpu_gemm_fp32_rows_do_not_depend_on_m():
    x, w = _gpu_gemm_operands(2048, 8512, torch.float32)
    bad = _rows_invariant(lambda t: lt.linear_triton(t, w, None, CFG), x[:4097], [1, 3, 17, 255, 1000, 4097])
    assert all(n == 0 for _, n in bad), bad


@gpu
def test_gpu_gemm_tma_and_pointer_tiles_agree_and_sit_at_the_bf16_floor():
    for K, N in ((2048, 8512), (4096, 2048), (768, 50280)):
        x, w = _gpu_gemm_operands(K, N, torch.bfloat16)
        b = torch.randn(N, device="cuda").to(torch.bfloat16)
        for M in (1, 64, 2048):
            y = lt.linear_triton(x[:M], w, b, CFG)
            assert torch.equal(y, lt.linear_triton(x[:M], w, b, NO_TMA))
            ref = x[:M].double() @ w.double().T + b.double()
            floor = ((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm()).item()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err <= 1.02 * floor, (K, N, M, err, floor)


@gpu
@pytest.mark.parametrize("d,groups", [(768, 1), (2048, 1), (5120, 1), (8192, 8)])
def test_gpu_norm_rows_do_not_depend_on_m(d, groups):
    ms = [1, 7, 300, 4097]
    g = torch.Generator(device="cuda").manual_seed(d)
    x = torch.randn(8192, d, device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn(8192, d, device="cuda", generator=g)
    z = torch.randn(8192, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)

    def add(t: torch.Tensor) -> torch.Tensor:  # t = [x | residual] in fp32: one tensor to slice rows of both
        out, res = nt.add_rms_norm_triton(t[:, :d].to(torch.bfloat16), t[:, d:].contiguous(), w, 1e-5, None, CFG)
        return torch.cat([out.float(), res], dim=1)

    def gated(t: torch.Tensor) -> torch.Tensor:  # t = [y | z]
        return nt.gated_rms_norm_triton(t[:, :d], t[:, d:], w, 1e-5, groups, CFG)

    yz = torch.cat([x, z], dim=1)
    assert all(n == 0 for _, n in _rows_invariant(lambda t: nt.rms_norm_triton(t, w, 1e-5, None, CFG), x, ms))
    assert all(n == 0 for _, n in _rows_invariant(add, torch.cat([x.float(), r], dim=1), ms))
    assert all(n == 0 for _, n in _rows_invariant(gated, yz, ms))
    # close to the torch ops: at most a bf16 rounding apart, in few elements
    for got, ref in ((nt.rms_norm_triton(x, w, 1e-5, None, CFG), norm.rms_norm(x, w, 1e-5)),
                     (gated(yz), norm.gated_rms_norm(x, z, w, 1e-5, groups))):
        diff = (got.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2 ** -6 + 1e-6).all()
        assert (got != ref).float().mean().item() < 0.02


@gpu
def test_gpu_conv_decode_rows_equal_prefill_rows():
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
                                  w, b, CFG)
    ref, _ = conv1d.causal_conv1d(x, cu, torch.zeros(S, K - 1, Cd, device="cuda", dtype=torch.bfloat16), w, b)
    assert torch.equal(one, ref)
    # prefill the first split_s tokens of each sequence, then decode the rest one token per step
    split = (lens.float() * torch.rand(S, generator=g, device="cuda")).long()
    win = torch.zeros(S + 8, K - 1, Cd, device="cuda", dtype=torch.bfloat16)
    got = torch.empty_like(one)
    cu_p = torch.zeros(S + 1, dtype=torch.int64, device="cuda")
    cu_p[1:] = split.cumsum(0)
    rows_p = torch.cat([torch.arange(int(cu[i]), int(cu[i] + split[i]), device="cuda") for i in range(S)])
    got[rows_p] = ct.causal_conv1d_triton(x[rows_p], cu_p, slots, win, w, b, CFG)
    pos = split.clone()
    while bool((pos < lens).any()):
        live = (pos < lens).nonzero().squeeze(1)
        rows = cu[live] + pos[live]
        cu_d = torch.arange(live.numel() + 1, device="cuda")
        got[rows] = ct.causal_conv1d_triton(x[rows], cu_d, slots[live], win, w, b, CFG)
        pos[live] += 1
    assert torch.equal(got, one)


@gpu
def test_gpu_conv_decode_step_in_one_launch_equals_two():
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
    ref = ct.causal_conv1d_triton(x.contiguous(), cu, slots, ref_win, w, b, CFG)
    got = ct.conv_step_triton(x, slots, got_win, w, b, CFG)
    assert torch.equal(got, ref) and torch.equal(got_win, ref_win)


@gpu
def test_gpu_logprob_rows_do_not_depend_on_m():
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(300, 256000, device="cuda", generator=g) * 4).to(torch.bfloat16)
    ms = [1, 7, 64]
    assert all(n == 0 for _, n in _rows_invariant(lambda t: lpt.log_softmax_triton(t, CFG), x, ms))
    tok = torch.randint(0, 256000, (300,), generator=g, device="cuda")
    lp = lpt.log_softmax_triton(x, CFG)
    assert torch.equal(lpt.token_logprobs_triton(x, tok, CFG), lp.gather(1, tok[:, None]).squeeze(1))
    ref = torch.log_softmax(x.double(), dim=-1)
    assert (lp.double() - ref).abs().max().item() < 1e-4
