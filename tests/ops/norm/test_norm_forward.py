"""The Triton RMS norms' forwards (``ops/norm/triton.py``): the plain, add, embed and gated norm.

- interpreter (the Triton interpreter on a CPU; compiled where a GPU runs them): fp32, tiny shapes,
  the logic against the torch ops: the norm and the residual add (the residual's bits exact, a fresh
  buffer where there is no x), the embedding gather as the first residual, the gated norm over 1, 2
  and 4 groups of a column slice, a row's bits the same alone and among others.
- gpu (skipped without CUDA; run on the H200): bf16 at the model widths (768 to 8192, 8 groups): a
  row's bits do not depend on the other rows of the call (plain, add and gated norm), and the norms
  are at most a bf16 rounding from the torch ops, in few elements.

The backwards: tests/ops/norm/test_norm_backward.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import CFG, DEV, gpu, rand, rows_invariant  # noqa: E402

from aligned_mamba.ops import norm  # noqa: E402
from aligned_mamba.ops.norm import triton as nt  # noqa: E402


@pytest.mark.interpreter
def test_rms_norm_and_residual_add_match_the_torch_ops():
    x, r, w = rand(5, 48, seed=10), rand(5, 48, seed=11), rand(48, seed=12)
    torch.testing.assert_close(nt.rms_norm_triton(x, w, 1e-5, None, CFG), norm.rms_norm(x, w, 1e-5), rtol=2e-6,
                               atol=2e-6)
    out, res = nt.add_rms_norm_triton(x, r, w, 1e-5, None, CFG)
    assert torch.equal(res, r + x)
    torch.testing.assert_close(out, norm.rms_norm(r + x, w, 1e-5), rtol=2e-6, atol=2e-6)
    out, res = nt.add_rms_norm_triton(None, r, w, 1e-5, None, CFG)
    assert torch.equal(res, r) and res.data_ptr() != r.data_ptr()
    torch.testing.assert_close(out, norm.rms_norm(r, w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.interpreter
def test_embedding_gather_is_the_first_residual():
    emb, w = rand(11, 48, seed=13), rand(48, seed=14)
    ids = torch.tensor([3, 0, 10, 3], device=DEV)
    out, res = nt.embed_rms_norm_triton(ids, emb, w, 1e-5, None, torch.float32, CFG)
    assert torch.equal(res, emb[ids])
    ref, _ = nt.add_rms_norm_triton(None, emb[ids], w, 1e-5, None, CFG)
    assert torch.equal(out, ref)


@pytest.mark.interpreter
@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_gated_norm_matches_the_torch_op(n_groups):
    y, w = rand(5, 48, seed=15), rand(48, seed=16)
    z = rand(5, 100, seed=17)[:, 10:58]  # a column slice, as in_proj's output gives it
    torch.testing.assert_close(nt.gated_rms_norm_triton(y, z, w, 1e-5, n_groups, CFG),
                               norm.gated_rms_norm(y, z, w, 1e-5, n_groups), rtol=2e-6, atol=2e-6)


@pytest.mark.interpreter
def test_a_norm_row_is_the_same_alone_and_among_others():
    x, w = rand(6, 40, seed=18), rand(40, seed=19)
    z = rand(6, 40, seed=20)
    full = nt.rms_norm_triton(x, w, 1e-5, None, CFG)
    gfull = nt.gated_rms_norm_triton(x, z, w, 1e-5, 2, CFG)
    for i in (0, 3, 5):
        assert torch.equal(nt.rms_norm_triton(x[i:i + 1], w, 1e-5, None, CFG), full[i:i + 1])
        assert torch.equal(nt.gated_rms_norm_triton(x[i:i + 1], z[i:i + 1], w, 1e-5, 2, CFG), gfull[i:i + 1])


# -- gpu ------------------------------------------------------------------------------------------------


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
    assert all(n == 0 for _, n in rows_invariant(lambda t: nt.rms_norm_triton(t, w, 1e-5, None, CFG), x, ms))
    assert all(n == 0 for _, n in rows_invariant(add, torch.cat([x.float(), r], dim=1), ms))
    assert all(n == 0 for _, n in rows_invariant(gated, yz, ms))
    # close to the torch ops: at most a bf16 rounding apart, in few elements
    for got, ref in ((nt.rms_norm_triton(x, w, 1e-5, None, CFG), norm.rms_norm(x, w, 1e-5)),
                     (gated(yz), norm.gated_rms_norm(x, z, w, 1e-5, groups))):
        diff = (got.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2 ** -6 + 1e-6).all()
        assert (got != ref).float().mean().item() < 0.02
