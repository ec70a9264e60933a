"""ops.native: the single-loop CPU ops give their torch forms' bits.

Every native function is compared bitwise with the torch form it stands for (``elementwise._exp``
and friends, ``reduce.tree_sum``'s torch tree, ``norm``'s and ``conv1d``'s torch arithmetic), on
values hypothesis picks, on the special values (0, -0, inf, nan, subnormals, the clamps'
edges), and on every float32 exponent. The contrast tests show what a loop that does not replay
the torch forms' operations gets: libm's exp, a fused multiply-add, MKL's sqrt.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_threads import num_threads, single_thread_by_default  # noqa: F401 (autouse fixture)

from aligned_mamba.ops import conv1d, linear, native, norm, reduce
from aligned_mamba.ops import elementwise as ew
from aligned_mamba.ops.conv1d import cpu as conv_cpu
from aligned_mamba.ops.conv1d import taps as conv_taps
from aligned_mamba.ops.elementwise import cpu as ew_cpu
from aligned_mamba.ops.elementwise import ieee
from aligned_mamba.ops.linear import cpu as linear_cpu
from aligned_mamba.ops.norm import cpu as norm_cpu

UNARY = {
    "exp": ieee._exp,
    "log": ieee._log,
    "log1p": ieee._log1p,
    "softplus": lambda x: ieee._softplus(x, 20.0),
    "sigmoid": ieee._sigmoid,
    "silu": ieee._silu,
}
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 1e-38, 1.17549435e-38, -1.0,
           1.0, 2.0, 0.5, 88.3762626647949, 88.38, 88.37626, -87.3365447505531, -88.0365447505531, -88.04, -103.9,
           20.0, 20.000002, 19.999998, -20.0, 1.4142135, 1.4142137, 0.70710677, 3.4028235e38, -3.4028235e38]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns with every nan as one pattern (a nan's payload carries no value)."""
    t = t.contiguous()
    return torch.where(torch.isnan(t), torch.full_like(t.view(torch.int32), 0x7FC00000), t.view(torch.int32))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.float()), _bits(b.float()))


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    # The suite runs where a C compiler is: the native ops must be there, not silently absent.
    assert native.library() is not None, native.status()


def _values(seed: int, n: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(n, generator=g) * scale, torch.tensor(SPECIAL)])


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_equals_torch_form_on_every_exponent(name: str) -> None:
    # every float32 exponent and sign, 64 random mantissas each, plus the special values
    g = torch.Generator().manual_seed(1)
    mant = torch.randint(0, 1 << 23, (64 * 512,), generator=g, dtype=torch.int32)
    sign_exp = torch.arange(512, dtype=torch.int32).repeat_interleave(64) << 23
    x = torch.cat([(sign_exp | mant).view(torch.float32), torch.tensor(SPECIAL)])
    assert _same(ew_cpu.unary(name, x, 20.0), UNARY[name](x))


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(UNARY)), seed=st.integers(0, 2**31), n=st.integers(0, 3000),
       scale=st.sampled_from([1e-3, 1.0, 10.0, 90.0, 1e4]))
def test_unary_equals_torch_form(name: str, seed: int, n: int, scale: float) -> None:
    x = _values(seed, n, scale)
    assert _same(ew_cpu.unary(name, x, 20.0), UNARY[name](x))


def test_softplus_threshold_is_the_callers() -> None:
    x = _values(3, 2000, 10.0)
    assert _same(ew_cpu.unary("softplus", x, 5.0), ieee._softplus(x, 5.0))


native_off = native.off


def _torch_tree_sum(x: torch.Tensor) -> torch.Tensor:
    with native_off():
        return reduce.tree_sum(x)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 9), n=st.integers(1, 1100))
def test_tree_sum_equals_torch_form(seed: int, rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 100
    assert _same(ew_cpu.tree_sum(x), _torch_tree_sum(x))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), M=st.integers(1, 9), d=st.sampled_from([8, 48, 256, 300, 768, 1024]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), wdtype=st.sampled_from([torch.float32, torch.bfloat16]),
       residual=st.sampled_from([None, torch.float32, torch.bfloat16]), eps=st.sampled_from([1e-5, 1e-6, 0.1]))
def test_rms_norm_and_add_norm_equal_torch_form(seed: int, M: int, d: int, dtype: torch.dtype, wdtype: torch.dtype,
                                                residual: torch.dtype | None, eps: float) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g).to(wdtype)
    with native_off():
        if residual is None:
            want, want_res = norm.rms_norm(x, w, eps, dtype), None
        else:
            res = (torch.randn(M, d, generator=g) * 5).to(torch.promote_types(residual, dtype))
            want_res = res + x
            want = norm.rms_norm(want_res, w, eps, dtype)  # the sum as kept (contract version 3)
    got, got_res = norm_cpu.rms_norm_loop(x, w, eps, dtype, residual=None if residual is None else res)
    assert _same(got, want)
    assert (got_res is None) == (want_res is None) and (got_res is None or _same(got_res, want_res))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), M=st.integers(1, 9), G=st.sampled_from([1, 2, 8]), dg=st.sampled_from([16, 64, 96]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_gated_norm_equals_torch_form(seed: int, M: int, G: int, dg: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    y, z = ((torch.randn(M, G * dg, generator=g) * 4).to(dtype) for _ in range(2))
    w = torch.randn(G * dg, generator=g).to(dtype)
    with native_off():
        want = norm.gated_rms_norm(y, z, w, 1e-5, G)
    assert _same(norm_cpu.gated_rms_norm_loop(y, z, w, 1e-5, G), want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 12), K=st.integers(1, 5), Cd=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(), act=st.booleans())
def test_tap_sum_equals_torch_form(seed: int, T: int, K: int, Cd: int, dtype: torch.dtype, bias: bool,
                                   act: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(T, K, Cd, generator=g).to(dtype)
    w = torch.randn(Cd, K, generator=g).to(dtype)
    b = torch.randn(Cd, generator=g).to(dtype) if bias else None
    with native_off():
        want = conv_taps.conv_out(taps, w, b, act)
    assert _same(conv_cpu.tap_sum(taps, w, b, act), want)


def test_public_ops_take_the_native_loop_and_give_the_torch_forms_bits() -> None:
    x = _values(5, 5000, 10.0)
    for name in UNARY:
        fn = getattr(ew, name)
        with native_off():
            want = fn(x)
        assert _same(fn(x), want), name


def test_gradients_and_other_devices_take_the_torch_form() -> None:
    x = torch.randn(10, requires_grad=True)
    assert ew_cpu.unary("exp", x) is None and ew.exp(x).requires_grad
    with torch.no_grad():
        assert ew_cpu.unary("exp", x) is not None
    assert ew_cpu.unary("exp", torch.randn(4, dtype=torch.float64)) is None


# -- the lanes' GEMM --------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), nb=st.sampled_from([0, 1, 3]), M=st.integers(1, 20), N=st.integers(1, 40),
       K=st.integers(1, 300), wdtype=st.sampled_from([torch.float32, torch.bfloat16]), bf16_x=st.booleans())
def test_lane_gemm_equals_lane_matmul(seed: int, nb: int, M: int, N: int, K: int, wdtype: torch.dtype,
                                      bf16_x: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = (nb,) if nb else ()
    x = torch.randn(*batch, M, K, generator=g) * 3
    if bf16_x:
        x = x.bfloat16().float()
    w = torch.randn(*batch, N, K, generator=g).to(wdtype)
    exact = bf16_x and wdtype == torch.bfloat16
    with native_off():
        want = linear.lanes(x, w, exact)
    got = linear.lanes(x, w, exact)
    assert _same(got, want)
    # the same sums with the right operand as [K, N]
    assert _same(linear_cpu.lane_gemm_kn(x, w.transpose(-1, -2), exact), want)
    # a row alone gets the bits it gets among others, whatever M
    assert _same(linear.lanes(x[..., M - 1:, :], w, exact), want[..., M - 1:, :])


@pytest.mark.parametrize("shape", [(32, 2320, 512, 0), (160, 512, 512, 0), (8, 64, 256, 300), (2, 96, 512, 400)])
def test_a_second_thread_changes_no_bit(shape: tuple[int, int, int, int]) -> None:
    # above SPLIT_MACS (2^25 multiply-adds) the GEMMs hand part of their outputs (columns, or whole
    # matrices) to a worker thread
    M, N, K, nb = shape
    g = torch.Generator().manual_seed(0)
    batch = (nb,) if nb else ()
    x = torch.randn(*batch, M, K, generator=g).bfloat16().float()
    w = torch.randn(*batch, N, K, generator=g).bfloat16()
    with num_threads(1):
        one = linear_cpu.lane_gemm(x, w, True), linear_cpu.lane_gemm_kn(x, w.transpose(-1, -2), False)
    with num_threads(2):
        for _ in range(3):
            two = linear_cpu.lane_gemm(x, w, True), linear_cpu.lane_gemm_kn(x, w.transpose(-1, -2), False)
            assert _same(one[0], two[0]) and _same(one[1], two[1])


def test_lane_gemm_kn_reads_slots_in_place_and_stops_where_the_terms_are_zero() -> None:
    """The decode's intra GEMM reads each sequence's chunk buffer at its slot (strided slots, no copy)
    and stops at the token's row: the bits of the whole chain over a gathered copy, because the terms
    it leaves out are +0.0 times finite values. Where they are not zero, stopping changes the bits."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(12, 3, 40, 16, generator=g).bfloat16()
    w = big[::2]  # [6 slots, H, K, N] with a doubled slot stride, as vLLM's page views have
    index, klen = torch.tensor([4, 1, 5]), torch.tensor([7, 40, 23])
    x = torch.randn(3, 3, 2, 40, generator=g)
    for s in range(3):
        x[s, :, :, int(klen[s]):] = 0.0
        w[int(index[s]), :, int(klen[s]):] = 0.0
    want = linear_cpu.lane_gemm_kn(x, w[index].contiguous(), False)
    assert _same(linear_cpu.lane_gemm_kn(x, w, False, index=index, klen=klen), want)
    assert _same(linear_cpu.lane_gemm_kn(x, w, False, index=index), want)
    x[0, :, :, 10] = 1.0
    w[int(index[0]), :, 10] = 1.0
    assert not _same(linear_cpu.lane_gemm_kn(x, w, False, index=index, klen=klen),
                     linear_cpu.lane_gemm_kn(x, w[index].contiguous(), False))


def test_lane_gemm_reads_slots_in_place() -> None:
    """The decode's C.h and C.B GEMMs read each sequence's state at its slot (strided slots and groups,
    no copy): the bits of the same GEMMs over a gathered copy; another slot's state gives others."""
    g = torch.Generator().manual_seed(1)
    for wdtype, exact in ((torch.float32, False), (torch.bfloat16, True)):
        big = torch.randn(10, 2, 24, 16, generator=g).to(wdtype)
        w = big[::2]  # [5 slots, G, N, Kp] with a doubled slot stride
        index = torch.tensor([3, 0, 4])
        x = torch.randn(3, 2, 1, 16, generator=g)
        if exact:
            x = x.bfloat16().float()
        want = linear_cpu.lane_gemm(x, w[index].contiguous(), exact)
        assert _same(linear_cpu.lane_gemm(x, w, exact, index=index), want)
        assert not _same(linear_cpu.lane_gemm(x, w, exact, index=index.roll(1)), want)


def test_lane_gemm_bf16_weights_for_many_rows_have_the_fp32_weights_bits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 264, generator=g).bfloat16().float()
    w = torch.randn(72, 264, generator=g).bfloat16()
    full = linear_cpu.lane_gemm(x, w, True)  # bf16 weights read as they are, with fused multiply-adds
    assert _same(full, linear_cpu.lane_gemm(x, w.float(), False))
    assert all(_same(linear_cpu.lane_gemm(x[i:i + 1], w, True), full[i:i + 1]) for i in range(40))


def test_builds_for_other_instruction_sets_give_the_same_bits(tmp_path: Path) -> None:
    # The library is built with -mavx2 -mfma where the CPU has them; a baseline x86-64 build computes
    # every element with the same operations (lanes as arrays, fmaf from libm).
    isa = native._isa_flags()
    if not isa:
        pytest.skip("this CPU has no AVX2 + FMA: the build is the baseline one already")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 264, generator=g).bfloat16().float()
    w = torch.randn(33, 264, generator=g).bfloat16()
    v = _values(9, 4000, 20.0)
    results = []
    for flags in (isa, ()):
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "-".join(flags or ("base",)))}
        code = ("import sys, torch; from aligned_mamba.ops import native; "
                "from aligned_mamba.ops.elementwise import cpu as ew_cpu; "
                "from aligned_mamba.ops.linear import cpu as linear_cpu; "
                "native._isa_flags = lambda: tuple(sys.argv[1:]); "
                f"x, w, v = torch.load({str(tmp_path / 'in.pt')!r}); "
                "out = [linear_cpu.lane_gemm(x, w, True), linear_cpu.lane_gemm(x, w.float(), False), "
                "ew_cpu.unary('exp', v), ew_cpu.unary('softplus', v, 20.0)]; "
                f"torch.save(out, {str(tmp_path / 'out.pt')!r} + '-'.join(sys.argv[1:]))")
        torch.save((x, w, v), tmp_path / "in.pt")
        run = subprocess.run([sys.executable, "-c", code, *flags], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        results.append(torch.load(str(tmp_path / "out.pt") + "-".join(flags)))
    assert all(_same(a, b) for a, b in zip(*results, strict=True))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), M=st.integers(1, 20), N=st.integers(1, 70), K=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), wdtype=st.sampled_from([torch.float32, torch.bfloat16]),
       bias=st.booleans(), strided=st.booleans())
def test_fused_linear_equals_torch_form(seed: int, M: int, N: int, K: int, dtype: torch.dtype, wdtype: torch.dtype,
                                        bias: bool, strided: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K + 5 * strided, generator=g) * 2).to(dtype)[:, :K]  # a column slice: rows strided
    w = linear.gemm_weight(torch.randn(N, K, generator=g).to(wdtype))
    b = torch.randn(N, generator=g).to(wdtype) if bias else None
    with native_off():
        want = linear.linear(x, w, b)
    got = linear_cpu.linear(x, w, b)
    assert _same(got, want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), S=st.integers(1, 6), K=st.integers(2, 5), Cd=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans())
def test_conv_step_in_place_equals_torch_form(seed: int, S: int, K: int, Cd: int, dtype: torch.dtype,
                                              bias: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    windows = torch.randn(S + 3, K - 1, Cd, generator=g).to(dtype)
    slots = torch.randperm(S + 3, generator=g)[:S]
    x = torch.randn(S, Cd + 7, generator=g).to(dtype)[:, 3:3 + Cd]
    w, b = torch.randn(Cd, K, generator=g).to(dtype), (torch.randn(Cd, generator=g).to(dtype) if bias else None)
    with native_off():
        want_out, want_win = conv1d.causal_conv1d_step(x, windows.index_select(0, slots), w, b)
    mine = windows.clone()
    got = conv_cpu.conv_step(mine, slots, x, w, b)
    assert _same(got, want_out) and _same(mine[slots], want_win)
    others = [i for i in range(S + 3) if i not in slots.tolist()]
    assert torch.equal(mine[others], windows[others])  # the other slots' windows untouched


def test_contrast_a_blas_row_alone_differs() -> None:
    # what the lanes prevent: a decode row computed by the BLAS in a call of its own
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(512, 256, generator=g)
    full = x @ w.t()
    assert not torch.equal(torch.cat([x[i:i + 1] @ w.t() for i in range(64)]), full)
    lanes = linear.lanes(x, w)
    assert torch.equal(torch.cat([linear.lanes(x[i:i + 1], w) for i in range(64)]), lanes)


# -- the mismatches a loop that does not replay the torch forms would give --------------------------------


def test_contrast_libm_exp_and_mkl_sqrt_differ() -> None:
    x = _values(7, 20000, 10.0)
    assert not _same(torch.exp(x), ieee._exp(x))  # SLEEF / libm: other roundings
    v = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 10 + 0.1
    # torch.sqrt (MKL's vector math) is not correctly rounded; the norms' rsqrt is 1 / sqrt, IEEE
    assert not torch.equal(1.0 / torch.sqrt(v), torch.rsqrt(v))
    assert torch.equal(torch.rsqrt(v), 1.0 / torch.sqrt(v.double()).float())


def test_contrast_fused_multiply_add_differs() -> None:
    # the conv's tap sum built with fused multiply-adds (what -ffp-contract would make of the loop)
    g = torch.Generator().manual_seed(0)
    taps, w = torch.randn(64, 4, 256, generator=g), torch.randn(256, 4, generator=g)
    fma = torch.zeros(64, 256, dtype=torch.float64)
    for k in range(4):  # exact product + sum in float64, rounded once per step: a fused multiply-add
        fma = (fma + taps[:, k].double() * w[:, k].double()).float().double()
    assert not torch.equal(fma.float(), conv_cpu.tap_sum(taps, w, None, False))


def test_no_compiler_falls_back_to_the_torch_forms(tmp_path: Path) -> None:
    code = ("import torch; from aligned_mamba.ops import native, elementwise as ew; "
            "from aligned_mamba.ops.elementwise import ieee; "
            "x = torch.randn(100); y = ew.exp(x); print(native.status()); "
            "assert torch.equal(y, ieee._exp(x))")
    env = {**os.environ, "CC": "/nonexistent/cc", "XDG_CACHE_HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unavailable" in out.stdout and "native CPU ops unavailable" in out.stderr
