"""The conv1d + SiLU backward as one walk per row block (``ops.conv1d.triton``, the default form).

- CPU (the Triton interpreter, fp32 and bf16 loads; unmarked, skipped unless TRITON_INTERPRET=1):
  hypothesis over the sequences (empty ones, ones shorter than the window, ones that straddle row
  blocks), channels, width 1 to 4, bias, and the walk's launch (the configs' conv_bwd_block_t,
  _block_c, _warps): dx, dweight and dbias against the fp64 gradient; two calls bit-identical; dx the
  same bits whatever the launch and the tile kernel's (``walk=False``, the reference form). The
  baseline: dweight summed over other row blocks has other bits, so its repeatability comes from the
  walk's fixed reduction order.
- interpreter (marked; through the interpreter on a CPU, compiled where a GPU runs it): the backward
  at 4 rows a program against the torch form (``ops.conv1d.causal_conv1d_backward``) and fp64, row
  blocks that straddle sequences, an empty sequence, ones shorter than the window; two calls
  bit-identical.
- compile (offline sm_90): the walk's loop carries every row it rotates (the defect that gave dx 0.71
  off on the H200: two rotated rows that the compiler did not carry), with the baseline that the
  rotation from one shared zero tensor is not carried.
- gpu (marked gpu): mamba2-1.3b's layer in bf16 (x a column slice of in_proj's output, two sequences
  of 2048 and a start inside a row block), against fp64 and the tile kernel.

The forward: tests/ops/conv1d/test_conv1d_forward.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from fp64_reference import rel_err  # noqa: E402
from kernel_cases import DEV, rand  # noqa: E402
from sm90_offline import run_sm90_script  # noqa: E402

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as ct  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
interp = pytest.mark.skipif(not INTERPRET, reason="the interpreter group (the CPU)")
CFG = TritonKernelConfigs()
RTOL = 1e-5  # fp32 inputs against fp64: measured below 1e-6 (relative norm)


def _inputs(lens: list[int], Cd: int, K: int, bias: bool, seed: int, dev: str = "cpu",
            dtype: torch.dtype = torch.float32, window: bool = True, cols: tuple[int, int] | None = None):
    """x [T, Cd] (cols = (offset, width): columns offset .. offset + Cd of a [T, width] buffer, as in_proj's
    output holds it), cu_seqlens, window [S, K-1, Cd] (zeros if not window), weight [Cd, K] and bias fp32, g."""
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], device=dev)
    off, width = cols or (0, Cd)
    x = r(T, width).to(dtype)[:, off:off + Cd]
    gr = r(T, Cd).to(dtype)
    win = r(S, K - 1, Cd).to(dtype) if window else torch.zeros(S, K - 1, Cd, dtype=dtype, device=dev)
    w, b = r(Cd, K, scale=0.5), r(Cd, scale=0.3) if bias else None
    return x, cu, win, w, b, gr


def _fp64_grads(x, cu, window, w, b, g):
    """dx, dweight, dbias of sum(g * silu(conv)) in fp64, each sequence's (window ++ rows) stream."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    K, outs = w.shape[1], []
    for q in range(window.shape[0]):
        lo, hi = int(cu[q]), int(cu[q + 1])
        stream = torch.cat([window[q].double(), x64[lo:hi]])
        acc = sum(w64[:, k] * stream[k:k + hi - lo] for k in range(K))
        outs.append(torch.nn.functional.silu(acc if b64 is None else acc + b64))
    torch.autograd.backward(torch.cat(outs), g.double())
    return x64.grad, w64.grad, None if b64 is None else b64.grad


def _walk(launch: tuple[int, int, int], *args):
    rows, bc, w = launch
    cfg = dataclasses.replace(CFG, conv_bwd_block_t=rows, conv_bwd_block_c=bc, conv_bwd_warps=w)
    return ct.causal_conv1d_backward_triton(*args, cfg)


def _tile(*args):
    return ct.causal_conv1d_backward_triton(*args, CFG, walk=False)


@interp
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 13), min_size=1, max_size=4).filter(lambda v: sum(v) > 0),
       Cd=st.integers(1, 40), K=st.integers(1, 4), bias=st.booleans(),
       launches=st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 32]), st.sampled_from([16, 32])), min_size=2,
                         max_size=2), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_walk_against_fp64_repeatable_and_dx_the_tile_kernels(lens, Cd, K, bias, launches, strided, seed):
    x, cu, window, w, b, g = _inputs(lens, Cd, K, bias, seed, cols=(3, Cd + 5) if strided else None)
    ref = _fp64_grads(x, cu, window, w, b, g)
    tile = _tile(x, cu, window, w, b, g)
    for rows, bc in launches:
        got = _walk((rows, bc, 1), x, cu, window, w, b, g)
        again = _walk((rows, bc, 1), x, cu, window, w, b, g)
        assert all(u is None and v is None or torch.equal(u, v) for u, v in zip(got, again)), "not repeatable"
        for name, ours, want in zip(("dx", "dw", "db"), got, ref):
            assert (ours is None) == (want is None), name
            if want is not None and want.norm() > 0:
                assert rel_err(ours, want) < RTOL, (name, rows, bc)
        assert torch.equal(got[0], tile[0]), "dx differs from the tile kernel's"


@interp
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 13), min_size=1, max_size=4).filter(lambda v: sum(v) > 0),
       Cd=st.integers(1, 40), K=st.integers(1, 4), bias=st.booleans(), rows=st.sampled_from([1, 2, 4, 8, 32]),
       seed=st.integers(0, 2**16))
def test_walk_loading_four_rows_ahead_gives_the_same_bits(lens, Cd, K, bias, rows, seed):
    """``WALK_AHEAD`` 4 (x and g loaded four rows ahead of their use) against 2: dx, dw and db bit for bit,
    and dx the tile kernel's (which loads no row ahead)."""
    x, cu, window, w, b, g = _inputs(lens, Cd, K, bias, seed)
    two = _walk((rows, 32, 1), x, cu, window, w, b, g)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ct, "WALK_AHEAD", 4)
        four = _walk((rows, 32, 1), x, cu, window, w, b, g)
    assert all(u is None and v is None or torch.equal(u, v) for u, v in zip(two, four))
    assert torch.equal(four[0], _tile(x, cu, window, w, b, g)[0])
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ValueError, match="WALK_AHEAD must be 2 or 4, not 3"):
        mp.setattr(ct, "WALK_AHEAD", 3)  # a depth the kernels do not have: refused, not run as 2
        _walk((rows, 32, 1), x, cu, window, w, b, g)


@interp
def test_walk_weight_gradient_bits_follow_the_reduction_order():
    """The baseline: the same gradient reduced over row blocks of 2 and of 64 rows differs in its bits
    (dx does not), so the bit-identical repeat above holds because the walk's order is fixed."""
    x, cu, window, w, b, g = _inputs([150, 50], 16, 4, True, seed=3)
    small = _walk((2, 16, 1), x, cu, window, w, b, g)
    large = _walk((64, 16, 1), x, cu, window, w, b, g)
    assert torch.equal(small[0], large[0])
    assert not torch.equal(small[1], large[1]) and not torch.equal(small[2], large[2])
    ref = _fp64_grads(x, cu, window, w, b, g)
    assert all(rel_err(u, v) < RTOL and rel_err(s, v) < RTOL for u, s, v in zip(small[1:], large[1:], ref[1:]))


@interp
def test_walk_at_the_gpu_launch_in_bf16_gives_the_tile_kernels_dx():
    """What the H200 ran, through the interpreter: bf16 x a column slice of a wider buffer, the default
    call (the configs' walk launch, 64 rows, 128 channels: 7 row blocks, the second sequence starting
    inside one), no window: dx has the tile kernel's bits in every row (the interpreter carried every
    row; the compiled loop did not)."""
    x, cu, window, w, b, g = _inputs([200, 248], 256, 4, True, seed=7, dtype=torch.bfloat16, window=False,
                                     cols=(40, 336))
    assert not x.is_contiguous()
    tile = _tile(x, cu, window, w, b, g)
    got = ct.causal_conv1d_backward_triton(x, cu, window, w, b, g, CFG)
    assert torch.equal(got[0], tile[0])
    ref = _fp64_grads(x, cu, window, w, b, g)
    assert rel_err(got[1], ref[1]) < RTOL and rel_err(got[2], ref[2]) < RTOL


@interp
def test_the_default_backward_is_the_walk_at_the_configs_launch():
    """The default call is the walk at the pinned (64, 128, 1): its dweight and dbias bits are the walk's
    (the baseline: the tile kernel's, summed over other row blocks, differ), and the configs' launch
    reaches it (the walk at another launch differs there too)."""
    assert (CFG.conv_bwd_block_t, CFG.conv_bwd_block_c, CFG.conv_bwd_warps) == (64, 128, 1)
    x, cu, window, w, b, g = _inputs([150, 50], 16, 4, True, seed=3)
    default = ct.causal_conv1d_backward_triton(x, cu, window, w, b, g, CFG)
    walk = ct.causal_conv1d_backward_triton(x, cu, window, w, b, g, CFG, walk=True)
    tile, other = _tile(x, cu, window, w, b, g), _walk((2, 16, 1), x, cu, window, w, b, g)
    assert all(torch.equal(u, v) for u, v in zip(default, walk))
    assert not torch.equal(default[1], tile[1]) and not torch.equal(default[1], other[1])


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_conv_backward_kernel_is_the_torch_forms_gradient(bias):
    """The conv's Triton backward against ``ops.conv1d.causal_conv1d_backward`` (native torch) and fp64:
    row blocks of 4 that straddle sequences, an empty sequence, sequences shorter than the window,
    windows of earlier rows; two calls bit-identical."""
    from aligned_mamba.ops import conv1d as conv
    from aligned_mamba.ops.conv1d.triton import causal_conv1d_backward_triton

    lens, Cd, K = [9, 0, 2, 1, 17], 40, 4
    T, S = sum(lens), len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    x, g, window = rand(T, Cd, seed=31), rand(T, Cd, seed=32), rand(S, K - 1, Cd, seed=33)
    w, b = rand(Cd, K, seed=34, scale=0.5), rand(Cd, seed=35) if bias else None
    cfg = TritonKernelConfigs(conv_bwd_block_t=4, conv_bwd_block_c=16)  # the walk at 4 rows a program
    got = causal_conv1d_backward_triton(x, cu, window, w, b, g, cfg)
    assert all(u is None or torch.equal(u, v) for u, v in
               zip(got, causal_conv1d_backward_triton(x, cu, window, w, b, g, cfg)))
    dx, _, dw, db = conv.causal_conv1d_backward(x, cu, window, w, b, g)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    outs = []
    for q in range(S):  # fp64: each sequence's (window ++ rows) stream, the K taps summed
        stream, n = torch.cat([window[q].double(), x64[cu[q]:cu[q + 1]]]), lens[q]
        acc = sum(w64[:, k] * stream[k:k + n] for k in range(K)) + (0.0 if b64 is None else b64)
        outs.append(torch.nn.functional.silu(acc))
    torch.autograd.backward(torch.cat(outs), g.double())
    for name, ours, torch_form, ref in (("dx", got[0], dx, x64.grad), ("dw", got[1], dw, w64.grad),
                                        ("db", got[2], db, None if b64 is None else b64.grad)):
        if ref is None:
            assert ours is None and torch_form is None
            continue
        assert rel_err(ours, ref) < RTOL and rel_err(torch_form, ref) < RTOL, name


_CARRIES = r"""
import importlib.util, inspect, json, os, re, tempfile
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.conv1d import triton as ct

cfg = TritonKernelConfigs()
# the rotation as the walk first had it (triton.jit reads its source from a file)
TOY = '''
import triton
import triton.language as tl


@triton.jit
def aliased(out_ptr, n, BLOCK: tl.constexpr):
    zero = tl.zeros((BLOCK,), dtype=tl.float32)
    e1, e2, e3 = zero, zero, zero
    for i in range(n):
        v = tl.load(out_ptr + i * BLOCK + tl.arange(0, BLOCK))
        tl.store(out_ptr + i * BLOCK + tl.arange(0, BLOCK), v + e1 + e2 + e3)
        e3, e2, e1 = e2, e1, v
'''
path = os.path.join(tempfile.mkdtemp(), "toy_rotation.py")
open(path, "w").write(TOY)
spec = importlib.util.spec_from_file_location("toy_rotation", path)
toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(toy)


def carried(fn, sig, consts, warps=1):
    sig = {n: ("constexpr" if n in consts else sig.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    ttir = compile_until(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), dict(num_warps=warps),
                         until="ttir").asm["ttir"]
    loops = [ln for ln in ttir.splitlines() if "scf.for" in ln and "iter_args" in ln]
    return sorted({m for ln in loops for m in re.findall(r"%([a-z]\w*?)(?:_\d+)? = ", ln.split("iter_args")[1])})


walk = carried(ct._conv_bwd_walk_kernel,
               dict(x_ptr="*bf16", cu_ptr="*i64", win_ptr="*bf16", w_ptr="*fp32", b_ptr="*fp32", g_ptr="*bf16",
                    dx_ptr="*bf16", dw_ptr="*fp32", db_ptr="*fp32"),
               dict(K=4, HAS_BIAS=True, ROWS=cfg.conv_bwd_block_t, BLOCK_C=cfg.conv_bwd_block_c, AHEAD=2),
               cfg.conv_bwd_warps)
walk4 = carried(ct._conv_bwd_walk_kernel,
                dict(x_ptr="*bf16", cu_ptr="*i64", win_ptr="*bf16", w_ptr="*fp32", b_ptr="*fp32", g_ptr="*bf16",
                     dx_ptr="*bf16", dw_ptr="*fp32", db_ptr="*fp32"),
                dict(K=4, HAS_BIAS=True, ROWS=cfg.conv_bwd_block_t, BLOCK_C=cfg.conv_bwd_block_c, AHEAD=4),
                cfg.conv_bwd_warps)
fwd4 = carried(ct._conv_walk_kernel,
               dict(x_ptr="*bf16", cu_ptr="*i64", slots_ptr="*i64", win_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16",
                    out_ptr="*bf16"),
               dict(K=4, HAS_BIAS=True, SILU=True, DEVICE_SILU=True, ROWS=cfg.conv_walk_block_t,
                    BLOCK_C=cfg.conv_walk_block_c, AHEAD=4), cfg.conv_walk_warps)
aliased = carried(toy.aliased, dict(out_ptr="*fp32"), dict(BLOCK=16))
print(json.dumps({"walk": walk, "walk4": walk4, "fwd4": fwd4, "aliased": aliased}))
"""


@pytest.mark.compile
def test_compiled_walk_carries_every_rotated_row(sm90_cache):
    """Offline sm_90 compile (no GPU): the walk's loop carries the stream rows c1 .. c3 and the dpre rows
    e1 .. e3 (and, four rows ahead, each row of its load queues, as the forward walk does). Baseline: the
    same rotation from one shared zero tensor carries e1 only (Triton carries a name only if one pass of
    the body changes its IR value; e2 = e1 is the value e2 already had), so e2 and e3 stay zero in every
    iteration: what gave dx 0.71 off on the H200."""
    r = run_sm90_script(_CARRIES, sm90_cache, timeout=600)
    assert {"c1", "c2", "c3", "e1", "e2", "e3", "dw0", "dw3", "db"} <= set(r["walk"]), r
    # four rows ahead: every row of the load queues rotates too (backward: x and g; forward: x)
    assert {"c1", "c3", "e1", "e3", "xa", "xb", "xc", "xd", "ga", "gb", "gc", "gd"} <= set(r["walk4"]), r
    assert {"c1", "c2", "c3", "xa", "xb", "xc", "xd"} <= set(r["fwd4"]), r
    assert "e1" in r["aliased"] and "e2" not in r["aliased"] and "e3" not in r["aliased"], r


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lens", [[2048, 2048], [1000, 1048], [3, 2045]], ids=["two", "inside", "short-first"])
def test_gpu_walk_at_the_layer_shape_bf16(lens):
    """mamba2-1.3b's conv (4352 channels) in bf16, x a column slice of in_proj's output (8512 wide), no
    window: the walk's dx within one bf16 rounding of fp64 and close to the tile kernel's (bits reported
    by the bench), dweight and dbias as accurate as the tile kernel's, repeatable."""
    x, cu, window, w, b, g = _inputs(lens, 4352, 4, True, seed=7, dev="cuda", dtype=torch.bfloat16, window=False,
                                     cols=(4096, 8512))
    ref = _fp64_grads(x, cu, window, w, b, g)
    tile = _tile(x, cu, window, w, b, g)
    got = ct.causal_conv1d_backward_triton(x, cu, window, w, b, g, CFG)
    again = ct.causal_conv1d_backward_triton(x, cu, window, w, b, g, CFG)
    assert all(torch.equal(u, v) for u, v in zip(got, again))
    assert rel_err(got[0], ref[0]) < 4e-3, rel_err(got[0], ref[0])  # one bf16 rounding
    assert rel_err(got[0], tile[0].double()) < 4e-3
    assert rel_err(got[1], ref[1]) < 1e-5 and rel_err(got[2], ref[2]) < 1e-5
