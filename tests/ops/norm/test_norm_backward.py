"""The Triton RMS norms' backwards (``ops/norm/triton.py``): the plain and add norm's, the gated norm's.

- interpreter (the Triton interpreter on a CPU; compiled where a GPU runs them): fp32 and bf16 rows,
  37 rows in blocks of 4 (a partial last block), widths that are not a power of two, groups of one
  block and of two: the backwards against their torch forms (``ops.norm.*_backward``), two calls
  bit-identical; the gated norm's backward writes the forward's output again from the saved rstd
  (the forward kernel's bits), and the add-norm's Function holds the new residual, not x (the
  plain kernel's gradients at that sum, dx rounded in the kernel). Each with a baseline that differs
  (an rstd one ulp off; the sum normalised as contract version 2 did).

The forwards: tests/ops/norm/test_norm_forward.py; the norms' autograd Functions against fp64
(``test_kernel_functions_forward_bits_and_gradients``): tests/ops/test_triton_backward.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

from fp64_reference import rel_err  # noqa: E402
from kernel_cases import EPS, OP_RTOL, rand  # noqa: E402
from torch_threads import single_thread_by_default  # noqa: E402, F401 (autouse fixture)

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.norm.triton import gated_rms_norm_triton  # noqa: E402


@pytest.mark.parametrize("d", [48, 60, 84], ids=["groups16", "groups20", "groups28"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_backward_kernels_are_the_torch_forms_gradients(dtype, d):
    """The norms' Triton backwards against their torch forms (``ops.norm.*_backward``, native torch):
    37 rows in blocks of 4 (a partial last block), a width that is not a power of two, 3 groups of
    16 columns (one block), 20 (16 + 4) or 28 (16 + a partial 16); two calls bit-identical."""
    from aligned_mamba.ops import norm
    from aligned_mamba.ops.norm.triton import gated_rms_norm_backward_triton, rms_norm_backward_triton

    cfg = TritonKernelConfigs(norm_bwd_rows=4)
    M = 37
    x, y, z, g, add = (rand(M, d, seed=s).to(dtype) for s in (51, 52, 53, 54, 55))
    w = rand(d, seed=56).to(dtype)
    tol = OP_RTOL if dtype == torch.float32 else 1e-2  # bf16: the outputs' own rounding
    got = rms_norm_backward_triton(x, w, EPS, dtype, g, cfg, add=add)
    assert all(torch.equal(u, v) for u, v in zip(got, rms_norm_backward_triton(x, w, EPS, dtype, g, cfg, add=add)))
    dx, dw = norm.rms_norm_backward(x, w, EPS, dtype, g)
    assert rel_err(got[0], (dx.float() + add.float()).double()) < tol and rel_err(got[1], dw.double()) < tol
    got = gated_rms_norm_backward_triton(y, z, w, EPS, 3, g, cfg)
    assert all(torch.equal(u, v) for u, v in zip(got, gated_rms_norm_backward_triton(y, z, w, EPS, 3, g, cfg)))
    want = norm.gated_rms_norm_backward(y, z, w, EPS, 3, g)
    assert all(rel_err(u, v.double()) < tol for u, v in zip(got, want))


@pytest.mark.parametrize("silu", ["ieee", "device"])
@pytest.mark.parametrize("d", [48, 60], ids=["groups16", "groups20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_norm_backward_forms_the_forwards_output(dtype, d, silu):
    """With ``write_out`` the gated norm's backward writes the norm's output again, from the forward's
    saved rstd: the forward kernel's bits (groups of one block, and of two: 16 + 4 columns), with either
    SiLU (``silu="device"``'s fp32 output differs from ``"ieee"``'s), and the gradients those of the call
    without it. The baseline (an rstd one ulp off, as a second reduction in another order could give)
    differs, so the comparison can fail."""
    from aligned_mamba.ops.norm.triton import gated_rms_norm_backward_triton

    cfg = TritonKernelConfigs(norm_bwd_rows=4, silu=silu)
    M = 37
    y, z, g = (rand(M, d, seed=s).to(dtype) for s in (61, 62, 63))
    w = rand(d, seed=64).to(dtype)
    out, rstd = gated_rms_norm_triton(y, z, w, EPS, 3, cfg, with_rstd=True)
    assert torch.equal(out, gated_rms_norm_triton(y, z, w, EPS, 3, cfg))
    *grads, again = gated_rms_norm_backward_triton(y, z, w, EPS, 3, g, cfg, rstd, write_out=True)
    assert torch.equal(again, out)
    assert all(torch.equal(u, v) for u, v in zip(grads, gated_rms_norm_backward_triton(y, z, w, EPS, 3, g, cfg, rstd)))
    off = rstd * (1 + 2 ** -12)
    assert not torch.equal(gated_rms_norm_backward_triton(y, z, w, EPS, 3, g, cfg, off, write_out=True)[3], out)
    if dtype == torch.float32:  # (bf16's rounding of 37 rows hides the SiLUs' last-bit differences)
        other = TritonKernelConfigs(norm_bwd_rows=4, silu="ieee" if silu == "device" else "device")
        assert not torch.equal(gated_rms_norm_triton(y, z, w, EPS, 3, other), out)


@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16], ids=["fp32-residual", "bf16-residual"])
def test_add_norm_backward_reads_the_new_residual_and_holds_not_x(res_dtype):
    """The add-norm's Function holds the new residual (residual + x, rounded to the residual's dtype and
    no further), not the mixer's output x: the gradients are the plain kernel's at that sum (dx rounded
    to x's dtype in the kernel), and nothing it saves is x's storage. The baseline (an fp32 sum rounded
    to the model dtype, as contract version 2 normalised it; a bf16 residual's sum left unrounded)
    differs, so the comparison can fail."""
    from aligned_mamba.ops.norm import triton as norm_tr
    from aligned_mamba.ops.norm.triton import rms_norm_backward_triton

    cfg = TritonKernelConfigs(norm_bwd_rows=4)
    M, d, bf = 37, 48, torch.bfloat16
    x, g = (rand(M, d, seed=s).to(bf) for s in (61, 62))
    residual, add = (rand(M, d, seed=s).to(res_dtype) for s in (63, 64))
    w = rand(d, seed=65).to(bf)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, residual, w))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        normed, summed = norm_tr.add_norm(xs, rs, ws, EPS, bf, cfg)
    assert saved and all(t.untyped_storage().data_ptr() != xs.untyped_storage().data_ptr() for t in saved)
    torch.autograd.backward([normed, summed], [g, add])
    want_in = (residual.float() + x.float()).to(res_dtype)
    assert torch.equal(summed.detach(), want_in)
    want_dx, want_dw = rms_norm_backward_triton(want_in, w, EPS, bf, g, cfg, add=add)
    assert torch.equal(rs.grad, want_dx.to(res_dtype)) and torch.equal(xs.grad, want_dx.to(bf))
    assert torch.equal(ws.grad, want_dw)
    base_in = (residual + x).to(bf) if res_dtype == torch.float32 else residual.float() + x.float()
    base_dx, _ = rms_norm_backward_triton(base_in, w, EPS, bf, g, cfg, add=add)
    assert not torch.equal(rs.grad, base_dx.to(res_dtype))
