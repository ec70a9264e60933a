"""The conv1d + SiLU backward kernel (``ops.conv1d.triton.causal_conv1d_backward_triton``).

CPU (the Triton interpreter, fp32): hypothesis over the sequences (empty ones, ones shorter than the
window, ones that straddle row blocks), channels, width 1 to 4, bias, and the launch (rows per program,
channels per program): dx, dweight and dbias against the fp64 gradient; two calls bit-identical; dx
the same bits whatever the launch. The baseline: dweight summed over other row blocks has other bits,
so its repeatability comes from the fixed order of the kernel's reduction, which the test pins.

GPU (marked gpu): the same in bf16 at mamba2-1.3b's conv channels, compiled.
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

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d.triton import causal_conv1d_backward_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
CFG = TritonKernelConfigs()
# fp32 inputs against fp64: measured below 1e-6 (relative norm)
RTOL = 1e-5


def _inputs(lens: list[int], Cd: int, K: int, bias: bool, seed: int, dev: str = "cpu",
            dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], device=dev)
    x, gr, window = r(T, Cd).to(dtype), r(T, Cd).to(dtype), r(S, K - 1, Cd).to(dtype)
    w, b = r(Cd, K, scale=0.5), r(Cd, scale=0.3) if bias else None
    return x, cu, window, w, b, gr


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


def _launch(cfg: TritonKernelConfigs, rows: int, block_c: int, warps: int = 1) -> TritonKernelConfigs:
    return dataclasses.replace(cfg, conv_bwd_block_t=rows, conv_bwd_block_c=block_c, conv_bwd_warps=warps)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter group (fp32 on the CPU)")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 13), min_size=1, max_size=4).filter(lambda v: sum(v) > 0),
       Cd=st.integers(1, 40), K=st.integers(1, 4), bias=st.booleans(),
       launches=st.lists(st.tuples(st.sampled_from([1, 2, 4, 8, 32]), st.sampled_from([16, 32])), min_size=2,
                         max_size=2), seed=st.integers(0, 2**16))
def test_gradients_against_fp64_repeatable_and_dx_whatever_the_launch(lens, Cd, K, bias, launches, seed):
    x, cu, window, w, b, g = _inputs(lens, Cd, K, bias, seed)
    ref = _fp64_grads(x, cu, window, w, b, g)
    first = None
    for rows, bc in launches:
        cfg = _launch(CFG, rows, bc)
        got = causal_conv1d_backward_triton(x, cu, window, w, b, g, cfg)
        again = causal_conv1d_backward_triton(x, cu, window, w, b, g, cfg)
        assert all(u is None and v is None or torch.equal(u, v) for u, v in zip(got, again)), "not repeatable"
        for name, ours, want in zip(("dx", "dw", "db"), got, ref):
            assert (ours is None) == (want is None), name
            if want is not None and want.norm() > 0:
                assert rel_err(ours, want) < RTOL, (name, rows, bc)
        if first is not None:
            assert torch.equal(got[0], first[0]), "a row's dx depends on the launch"
        first = got


@pytest.mark.skipif(not INTERPRET, reason="the interpreter group (fp32 on the CPU)")
def test_weight_gradient_bits_follow_the_reduction_order():
    """The baseline: the same gradient reduced over row blocks of 2 and of 64 rows differs in its bits
    (dx does not), so the bit-identical repeat above holds because the kernel's order is fixed."""
    x, cu, window, w, b, g = _inputs([150, 50], 16, 4, True, seed=3)
    small = causal_conv1d_backward_triton(x, cu, window, w, b, g, _launch(CFG, 2, 16))
    large = causal_conv1d_backward_triton(x, cu, window, w, b, g, _launch(CFG, 64, 16))
    assert torch.equal(small[0], large[0])
    assert not torch.equal(small[1], large[1]) and not torch.equal(small[2], large[2])
    ref = _fp64_grads(x, cu, window, w, b, g)
    assert all(rel_err(u, v) < RTOL and rel_err(s, v) < RTOL for u, s, v in zip(small[1:], large[1:], ref[1:]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lens", [[1000, 1048], [3, 2045]], ids=["two", "short-first"])
def test_layer_shape_bf16_on_the_gpu(lens):
    """mamba2-1.3b's conv channels (4352) in bf16, the pinned launch and three others: fp64 accuracy
    (dx rounded once to bf16; fp32 weights keep dweight and dbias in fp32), repeatable, dx the same bits
    under every launch."""
    x, cu, window, w, b, g = _inputs(lens, 4352, 4, True, seed=7, dev="cuda", dtype=torch.bfloat16)
    ref = _fp64_grads(x, cu, window, w, b, g)
    first = None
    for cfg in (CFG, _launch(CFG, 128, 128), _launch(CFG, 32, 256, 2), _launch(CFG, 256, 64, 1)):
        got = causal_conv1d_backward_triton(x, cu, window, w, b, g, cfg)
        again = causal_conv1d_backward_triton(x, cu, window, w, b, g, cfg)
        assert all(torch.equal(u, v) for u, v in zip(got, again))
        assert rel_err(got[0], ref[0]) < 4e-3  # one bf16 rounding
        assert rel_err(got[1], ref[1]) < 1e-5 and rel_err(got[2], ref[2]) < 1e-5
        if first is not None:
            assert torch.equal(got[0], first[0])
        first = got
