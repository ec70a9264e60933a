"""What spans the Triton op kernels (the GEMM, norms, conv1d and log-softmax), one test each where it runs:

- CPU: ``TritonKernelConfigs`` refuses, in one line, a value of any op's field that no kernel implements.
- compile: every op kernel compiles for sm_90 (the H200) as the launchers call them, offline with the
  triton wheel's ptxas and cuobjdump: every GEMM regime of the pinned configs (bf16 decode, mid and
  large tiles through TMA and through pointers, the fp32 tile), each norm variant, the conv and window
  kernels, log-softmax (and its backward) and token logprobs. The SASS must show the instructions the
  tiles were chosen for: HGMMA (wgmma) for bf16 tiles of 64 rows and more, HMMA for 16-row tiles, TMA
  loads where descriptors are used, and no local memory (spills) in any GEMM.
- gpu: the model check's cases on the triton backend, rows and reported logprobs (the kernel's on both sides).

Each kernel's own tests live in its op's folder (tests/ops/linear/test_linear_gemm.py, tests/ops/norm/,
tests/ops/conv1d/, tests/ops/logprobs/test_logprobs_triton.py); their autograd Functions against fp64 in
tests/ops/test_triton_backward.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sm90_offline import run_sm90_script, sass_script  # noqa: E402

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402

_REFUSED = [("linear_warps", 2), ("linear_block_k", 256), ("linear_persistent", 1), ("linear_epi_split", 4),
            ("linear_decode_stages", 17), ("linear_decode_tma", "yes"), ("linear_mid_programs_per_sm", 0),
            ("linear_fill_programs", -1), ("linear_mid_max_m", -1), ("norm_block_per_warp", 3),
            ("conv_block_c", 100), ("logprobs_block_v", 64), ("silu", "fast")]


@pytest.mark.parametrize("field,value", _REFUSED)
def test_configs_refuse_values_no_kernel_implements(field, value):
    with pytest.raises(ValueError, match=field) as e:
        TritonKernelConfigs(**{field: value})
    assert "\n" not in str(e.value)


_ALIGNED = {"K", "N", "D", "GS", "V", "C", "Cd", "stride_x", "stride_xm", "stride_wn", "stride_ym", "stride_res",
            "stride_out", "stride_res_out", "stride_y", "stride_z", "stride_ws", "stride_wk"}
_COMPILE_OPS = sass_script(_ALIGNED, r"""
from aligned_mamba.ops.conv1d import triton as ct
from aligned_mamba.ops.linear import triton as lt
from aligned_mamba.ops.logprobs import triton as lpt
from aligned_mamba.ops.norm import triton as nt
from aligned_mamba.ops.norm import triton_sliced as nst

# every GEMM plan the model shapes (N of each layer) meet at decode, mid and prefill sizes, and fp32's
plans = gemm_plans((768, 2048, 2560, 3352, 4096, 8512, 10576, 18560, 50280, 256000),
                   (1, cfg.linear_decode_max_m, 64, cfg.linear_block_m, cfg.linear_mid_max_m, 8192))
for dt, p in plans:
    tag = f"linear:{dt}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}"
    opts = dict(num_warps=p.num_warps, num_stages=p.num_stages)
    c = dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision)
    if p.tma:
        for bias in (False, True):
            comp(tag + f":tma:bias{int(bias)}", lt._linear_tma_kernel,
                 dict(tma_descs(dt, p), b_ptr="*" + dt),
                 dict(c, HAS_BIAS=bias, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent), **opts)
    # the pointer kernel: the plan's own launch without TMA, and every plan's fallback
    comp(tag + ":ptr", lt._linear_ptr_kernel, dict(x_ptr="*" + dt, w_ptr="*" + dt, y_ptr="*" + dt, b_ptr="*" + dt),
         dict(c, HAS_BIAS=True), **opts)

f32, bf = "fp32", "bf16"
for name, x, res, ro, has_x, idx in (("rms", bf, bf, bf, False, False), ("add", bf, f32, f32, True, False),
                                     ("embed", bf, bf, f32, False, True)):
    comp("norm:" + name, nt._rms_norm_kernel,
         dict(x_ptr="*" + x, res_ptr="*" + res, idx_ptr="*i64", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*" + ro,
              eps="fp32"),
         dict(HAS_X=has_x, HAS_IDX=idx, WRITE_RES=name != "rms", BLOCK_D=4096), num_warps=nt._block_warps(4096, cfg)[1],
         enable_fp_fusion=False)
# training saves rstd; 5120: two blocks; silu "device" (the GPU's exp) beside the pinned "ieee"
for rstd, width, dev in ((False, 1024, False), (True, 1024, False), (True, 5120, False), (True, 5120, True)):
    a, b, warps = nt.gated_launch(width, cfg)
    comp(f"norm:gated:rstd{int(rstd)}" + (f":{width}" if b else "") + (":device" if dev else ""),
         nt._gated_norm_kernel,
         dict(y_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", rstd_ptr="*fp32", eps="fp32"),
         dict(WRITE_RSTD=rstd, DEVICE_SILU=dev, BLOCK_A=a, BLOCK_B=b), num_warps=warps, enable_fp_fusion=False)
for add in (False, True):  # the backwards (fp32 gradients of bf16 rows; the add-norm's from its fp32 sum)
    comp(f"norm:backward:add{int(add)}", nt._rms_norm_bwd_kernel,
         dict(x_ptr="*fp32" if add else "*bf16", w_ptr="*bf16", g_ptr="*bf16", add_ptr="*fp32", dx_ptr="*fp32",
              dx2_ptr="*bf16", dw_ptr="*fp32", eps="fp32"),
         dict(HAS_ADD=add, HAS_DX2=add, OUT=triton.language.bfloat16, ROWS=cfg.norm_bwd_rows,
              BLOCK_D=4096), num_warps=nt._block_warps(4096, cfg)[1])
# with out: the norm's output written again for out_proj's weight gradient; 5120 (2.7b's group): two blocks
for out, width, dev in ((False, 4096, False), (True, 4096, False), (True, 5120, False), (True, 5120, True)):
    a, b, warps = nt.gated_bwd_launch(width, cfg)
    comp(f"norm:gated:backward:out{int(out)}:{width}" + (":device" if dev else ""), nt._gated_norm_bwd_kernel,
         dict(y_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", g_ptr="*bf16", rstd_ptr="*fp32", dy_ptr="*bf16",
              dz_ptr="*bf16", dw_ptr="*fp32", out_ptr="*bf16", eps="fp32"),
         dict(WRITE_OUT=out, DEVICE_SILU=dev, ROWS=cfg.norm_bwd_rows, BLOCK_A=a, BLOCK_B=b), num_warps=warps,
         enable_fp_fusion=False)
for sw in (256, 1280):  # the sliced gated norm (TP slices): slices of 256 and of 1280 (2.7b's group / 4: two blocks)
    a, b, warps = nt.gated_launch(sw, cfg)
    comp(f"norm:gated:sliced:squares:{sw}", nst._slice_squares_kernel,
         dict(y_ptr="*bf16", z_ptr="*bf16", ss_ptr="*fp32"), dict(DEVICE_SILU=False, BLOCK_A=a, BLOCK_B=b),
         num_warps=warps, enable_fp_fusion=False)
    comp(f"norm:gated:sliced:normalize:{sw}", nst._slice_normalize_kernel,
         dict(y_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", ss_ptr="*fp32", eps="fp32"),
         dict(DEVICE_SILU=False, BLOCK_A=a, BLOCK_B=b), num_warps=warps, enable_fp_fusion=False)
    # its backward (the default SiLU): the slices' shares of sum(g w vhat), then dy, dz and dw's partial sums
    comp(f"norm:gated:sliced:backward_dot:{sw}", nst._slice_bwd_dot_kernel,
         dict(y_ptr="*bf16", z_ptr="*bf16", g_ptr="*bf16", w_ptr="*bf16", ss_ptr="*fp32", part_ptr="*fp32",
              eps="fp32"), dict(DEVICE_SILU=cfg.device_silu, BLOCK_A=a, BLOCK_B=b), num_warps=warps,
         enable_fp_fusion=False)
    comp(f"norm:gated:sliced:backward:{sw}", nst._slice_bwd_kernel,
         dict(y_ptr="*bf16", z_ptr="*bf16", g_ptr="*bf16", w_ptr="*bf16", ss_ptr="*fp32", tot_ptr="*fp32",
              dy_ptr="*bf16", dz_ptr="*bf16", dw_ptr="*fp32", eps="fp32"),
         dict(DEVICE_SILU=cfg.device_silu, ROWS=cfg.norm_bwd_rows, BLOCK_A=a, BLOCK_B=b), num_warps=warps,
         enable_fp_fusion=False)
conv_t = dict(x_ptr="*bf16", cu_ptr="*i64", slots_ptr="*i64", win_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16",
              out_ptr="*bf16")
for bias in (False, True):
    comp(f"conv:bias{int(bias)}", ct._conv_kernel, conv_t,
         dict(K=4, HAS_BIAS=bias, SILU=True, DEVICE_SILU=False, BLOCK_T=cfg.conv_block_t, BLOCK_C=cfg.conv_block_c),
         num_warps=4, enable_fp_fusion=False)
for bias, dev, ahead in ((False, False, 2), (True, False, 2), (True, True, 2), (True, True, 4)):  # the forward's walk
    comp(f"conv:walk:bias{int(bias)}:ahead{ahead}" + (":device" if dev else ""), ct._conv_walk_kernel, conv_t,
         dict(K=4, HAS_BIAS=bias, SILU=True, DEVICE_SILU=dev, ROWS=cfg.conv_walk_block_t,
              BLOCK_C=cfg.conv_walk_block_c, AHEAD=ahead), num_warps=cfg.conv_walk_warps, enable_fp_fusion=False)
comp("conv:window", ct._window_kernel, conv_t, dict(K=4, BLOCK_Q=4, BLOCK_C=cfg.conv_block_c), num_warps=4)
for bias, dev in ((False, False), (True, False), (True, True)):  # a decode step's conv and window in one launch
    comp(f"conv:step:bias{int(bias)}" + (":device" if dev else ""), ct._conv_step_kernel, conv_t,
         dict(K=4, HAS_BIAS=bias, SILU=True, DEVICE_SILU=dev, BLOCK_Q=4, BLOCK_C=cfg.conv_block_c), num_warps=4,
         enable_fp_fusion=False)
for bias in (False, True):  # the backward's tile form (dx in the inputs' bf16, fp32 weight-gradient partial sums)
    comp(f"conv:backward:bias{int(bias)}", ct._conv_bwd_kernel,
         dict(x_ptr="*bf16", cu_ptr="*i64", win_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", g_ptr="*bf16",
              dx_ptr="*bf16", dw_ptr="*fp32", db_ptr="*fp32"),
         dict(K=4, HAS_BIAS=bias, BLOCK_T=ct.TILE_LAUNCH[0], BLOCK_C=ct.TILE_LAUNCH[1]), num_warps=ct.TILE_LAUNCH[2])
for bias in (False, True):  # the backward's walk (the default form) and its block sums
    comp(f"conv:backward:walk:bias{int(bias)}", ct._conv_bwd_walk_kernel,
         dict(x_ptr="*bf16", cu_ptr="*i64", win_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", g_ptr="*bf16",
              dx_ptr="*bf16", dw_ptr="*fp32", db_ptr="*fp32"),
         dict(K=4, HAS_BIAS=bias, ROWS=cfg.conv_bwd_block_t, BLOCK_C=cfg.conv_bwd_block_c, AHEAD=ct.WALK_AHEAD),
         num_warps=cfg.conv_bwd_warps)
comp("conv:backward:walk:ahead4", ct._conv_bwd_walk_kernel,
     dict(x_ptr="*bf16", cu_ptr="*i64", win_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", g_ptr="*bf16",
          dx_ptr="*bf16", dw_ptr="*fp32", db_ptr="*fp32"),
     dict(K=4, HAS_BIAS=True, ROWS=cfg.conv_bwd_block_t, BLOCK_C=cfg.conv_bwd_block_c, AHEAD=4),
     num_warps=cfg.conv_bwd_warps)
comp("conv:backward:partials", ct._partials_kernel, dict(dw_ptr="*fp32", db_ptr="*fp32", dwo_ptr="*bf16",
                                                         dbo_ptr="*bf16"),
     dict(K=4, HAS_BIAS=True, BLOCK_B=16, BLOCK_C=128), num_warps=4)
lw = dict(num_warps=cfg.logprobs_num_warps, enable_fp_fusion=False)
rows = dict(lpt._slicing(lpt.VOCAB_SLICES), BLOCK_V=cfg.logprobs_block_v)
comp("logprobs:log_softmax", lpt._log_softmax_kernel, dict(x_ptr="*bf16", out_ptr="*fp32"), rows, **lw)
comp("logprobs:token", lpt._token_logprobs_kernel, dict(x_ptr="*bf16", tok_ptr="*i64", out_ptr="*fp32",
                                                        lse_ptr="*fp32"), rows, **lw)
for slices in (1, 4, 8):  # a shard's slices at TP 8 and TP 2, the split grid's; their join
    comp(f"logprobs:slice_stats:{slices}", lpt._slice_kernel, dict(x_ptr="*bf16", stats_ptr="*fp32"),
         dict(SLICES=slices, BLOCK_V=cfg.logprobs_block_v), **lw)
comp("logprobs:join", lpt._join_kernel, dict(stats_ptr="*fp32", lse_ptr="*fp32"), lpt._slicing(lpt.VOCAB_SLICES),
     num_warps=1, enable_fp_fusion=False)
# the split grid (logprobs_split_max_m): the slices' stats, then the join with the write or the token
comp("logprobs:log_softmax:split", lpt._write_kernel, dict(x_ptr="*bf16", stats_ptr="*fp32", out_ptr="*fp32"), rows,
     **lw)
comp("logprobs:join_token", lpt._join_token_kernel, dict(x_ptr="*bf16", stats_ptr="*fp32", tok_ptr="*i64",
                                                         out_ptr="*fp32", lse_ptr="*fp32"),
     lpt._slicing(lpt.VOCAB_SLICES), num_warps=1, enable_fp_fusion=False)
comp("logprobs:backward", lpt._log_softmax_bwd_kernel, dict(out_ptr="*fp32", g_ptr="*fp32", dx_ptr="*bf16"),
     dict(BLOCK_V=cfg.logprobs_block_v), num_warps=cfg.logprobs_num_warps)
comp("logprobs:token_backward", lpt._token_logprobs_bwd_kernel,
     dict(x_ptr="*bf16", tok_ptr="*i64", lse_ptr="*fp32", g_ptr="*fp32", dx_ptr="*bf16"),
     dict(BLOCK_V=cfg.logprobs_block_v), num_warps=cfg.logprobs_num_warps)
print(json.dumps(done))
""")


@pytest.mark.compile
@pytest.mark.slow
def test_every_op_kernel_compiles_for_sm90_with_the_instructions_it_was_tiled_for(sm90_cache):
    done = run_sm90_script(_COMPILE_OPS, sm90_cache)
    by = {d["name"]: d for d in done}
    linear = [d for d in done if d["name"].startswith("linear:")]
    assert len(linear) >= 10 and len(done) - len(linear) == 21 + 16 + 10, sorted(by)  # norms, conv1d, logprobs
    for d in done:
        if d["name"].startswith("norm:gated"):
            assert d["LDL"] == d["STL"] == 0, d  # a 5120-wide group's two blocks fit in registers too
        if d["name"].startswith("logprobs:"):
            assert d["LDL"] == d["STL"] == 0, d  # a row's slices' maxes and sums stay in registers
        if d["name"].startswith(("logprobs:log_softmax", "logprobs:token", "logprobs:slice_stats")):
            # the walks read 16-byte vectors (slices start at multiples of 16 logits); one element: the token's
            assert d["LDG128"] > 0 and d["LDG16"] <= 1, d
        if d["name"].startswith(("conv:backward:walk", "conv:walk")):
            assert d["LDL"] == d["STL"] == 0, d  # the walks' carried rows stay in registers
        if d["name"].startswith(("conv:walk", "conv:step", "norm:gated:rstd")):
            # silu "ieee" builds exp of IEEE operations; "device" takes the hardware's
            assert (d["EX2"] > 0) == d["name"].endswith(":device"), d
        if d["name"].startswith("linear:"):
            assert d["LDL"] == d["STL"] == 0, d  # no spills
            bf16, bm = d["name"].split(":")[1] == "bf16", int(d["name"].split(":")[2].split("x")[0])
            assert d["HGMMA" if bf16 and bm >= 64 else "HMMA"] > 0 or not bf16, d
            if ":tma:" in d["name"]:
                assert d["UTMALDG"] > 0, d


@pytest.mark.gpu
def test_model_check_on_triton_backend_is_bit_identical():
    from aligned_mamba.check import CASES, compare, compare_logprobs, make_prompts, run_case
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.mamba2 import make_tiny

    cfg, tensors = make_tiny(0)
    model = build_model(cfg, tensors, Contract(chunk_size=cfg.chunk_size, backend="triton"))
    prompts = make_prompts(cfg.vocab_size, 300, 3, seed=0)
    torch_form = Contract(chunk_size=cfg.chunk_size, backend="torch")  # the slice tree's logprobs, not the kernel's
    baseline_lp = 0
    for spec in CASES:
        res = run_case(spec, model, prompts, 120, 100, seed=0)
        logits = model.forward([torch.tensor(t) for t in res.tokens])
        report = compare(res.rows, logits, model.contract, model.contract)
        assert report.bitwise_equal == spec.exact_replay, (spec.name, report.summary())
        if spec.exact_replay:  # the reported logprobs: the triton backend's kernel on both sides
            assert compare_logprobs(res, logits, 120, model.contract)["mismatched_logprobs"] == 0, spec.name
            baseline_lp += compare_logprobs(res, logits, 120, torch_form)["mismatched_logprobs"]
    assert baseline_lp > 0
