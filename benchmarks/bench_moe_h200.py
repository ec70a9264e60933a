#!/usr/bin/env python3
"""The MoE layer alone on one GPU: the triton backend's row-invariant MoE against stock torch.

    python3 benchmarks/bench_moe_h200.py --out OUT/h200_moe.json [--quick] [--no-backward] [--sweep]
        [--decode-sweep] [--layer-backward] [--profile]
    python3 benchmarks/bench_moe_h200.py --dry-run --out /tmp/moe.json   # CPU, Triton interpreter

Shape: Nemotron-3-Nano-30B-A3B's MoE block (hidden 2688, 128 routed experts, top-6, expert width
1856, squared ReLU, one shared expert of --shared-width, sigmoid router with the score correction
bias, norm_topk_prob, routed_scaling_factor 2.5), bf16, random weights, at 1, 64, 4096 and 32768
tokens. Each cell times the whole layer (router GEMM in fp32, routing, experts, shared expert,
combine):

- ours: ``layers.moe.MoE`` on the triton backend (``ops.moe.triton``'s grouped GEMMs, the fp32
  router and the shared expert through ``linear_triton``);
- stock: the same weights through torch: the router as cuBLAS fp32 ``F.linear`` + sigmoid +
  ``torch.topk`` (transformers' router), the experts either as ``torch._grouped_mm`` over the
  tokens sorted by expert (``stock_grouped_ms``) or as a per-expert loop of cuBLAS ``F.linear``
  (``stock_loop_ms``), whichever is faster is ``stock_ms`` (``stock_form`` says which), the shared
  expert cuBLAS, the combine a torch weighted sum.

``bitwise``: our rows of the cell equal the same tokens' rows computed alone (the first 8 tokens,
each its own call); ``stock_bitwise`` the same for the stock grouped form (expected false at
large counts). With the backward (unless --no-backward): fwd+bwd of the routed experts alone
(``ops.moe.triton.experts_triton`` against ``torch._grouped_mm`` under autograd) at 4096 and
32768 tokens, ``ours_grads_repeat_equal``: two backwards give the same bits. With --sweep: the
routed experts' forward under other grouped-GEMM tiles (``SWEEP``) at 4096 and 32768 tokens, each
with ``bitwise_equal_to_pinned`` (a row's bits must not depend on the tile). With --stock-parts
(instead of the layer and backward cells): which stock piece (router scores, routed experts, shared
expert) changes a row's bits with the batch. With --layer-backward (instead of the layer and backward
cells): the whole layer's fwd+bwd as a trainer runs it (``layer_backward_cells``) at 4096 and 16384
tokens (an 8-layer slice's 4 x 4096), with --profile each side's kernel table. With --bwd-sweep: the
routed experts' fwd+bwd at 16384 tokens under other weight-gradient tiles (``BWD_SWEEP``).

With --decode-sweep: the whole layer in a CUDA graph at 1, 64 and 256 tokens under other decode
tiles (``DECODE_SWEEP``), with the large tile for all (moe_decode_max_rows 0) and with the decode
tile up to 2048 rows, each with
``bitwise_equal_to_pinned``. Each layer cell also times both layers replayed from a CUDA graph
(``ours_graph_ms``, ``stock_graph_ms``: the grouped form; a decode step runs so), where the
eager times include the host's launches.

CUDA-event medians (triton.testing.do_bench) after a warm-up call. The JSON is written after every
entry; it names the GPU, torch, triton, the commit (GIT_COMMIT, else git's HEAD) and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_h200 import git_commit  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
NANO = dict(hidden=2688, experts=128, top_k=6, width=1856)
TINY = dict(hidden=48, experts=16, top_k=6, width=40)




def _bench(fn, dry: bool) -> float:
    if dry:  # the interpreter: one timed call, wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _bench_graph(fn) -> float | None:
    """fn's CUDA-event median replayed from one CUDA graph (a decode step's launches cost no host time
    there), or None where fn cannot be captured (a host synchronisation)."""
    import triton.testing

    from benchmarks.gpu_validate import captured

    try:
        graph = captured(fn)
    except Exception:  # noqa: BLE001 (a sync inside the capture, say: no graph cell)
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median"))


def _moe_config(shape: dict, shared: int):
    from aligned_mamba.layers.moe import MoEConfig
    return MoEConfig(hidden_size=shape["hidden"], n_routed_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                     moe_intermediate_size=shape["width"], moe_shared_expert_intermediate_size=shared,
                     routed_scaling_factor=2.5)


def _weights(config, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, s in config.weight_shapes().items():
        out[name] = (torch.randn(*s, generator=g, device=device) / s[-1] ** 0.5).to(dtype)
    out["gate.e_score_correction_bias"] = torch.rand(config.n_routed_experts, generator=g, device=device) * 0.01
    return out


class Stock:
    """The stock MoE layer on the same weights (module docstring)."""

    def __init__(self, config, w: dict) -> None:
        E = config.n_routed_experts
        self.c = config
        self.gate = w["gate.weight"].float()
        self.bias = w["gate.e_score_correction_bias"].float()
        self.up = torch.stack([w[f"experts.{e}.up_proj.weight"] for e in range(E)])      # [E, f, d]
        self.down = torch.stack([w[f"experts.{e}.down_proj.weight"] for e in range(E)])  # [E, d, f]
        self.shared_up, self.shared_down = w["shared_experts.up_proj.weight"], w["shared_experts.down_proj.weight"]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.gate))
        idx = torch.topk(scores + self.bias, self.c.num_experts_per_tok, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.c.routed_scaling_factor

    def experts(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, form: str) -> torch.Tensor:
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat)
        tok = order // k
        xs = x[tok]
        if form == "grouped":  # the counts by scatter_add (bincount syncs with the host: no CUDA graph)
            counts = torch.zeros(self.c.n_routed_experts, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))
            offs = torch.cumsum(counts, 0).to(torch.int32)
            a = torch.square(torch.relu(torch._grouped_mm(xs, self.up.transpose(1, 2), offs=offs)))
            y = torch._grouped_mm(a, self.down.transpose(1, 2), offs=offs)
        else:
            counts = torch.bincount(flat, minlength=self.c.n_routed_experts).tolist()
            ys, lo = [], 0
            for e, n in enumerate(counts):
                if n:
                    ys.append(F.linear(torch.square(torch.relu(F.linear(xs[lo:lo + n], self.up[e]))), self.down[e]))
                lo += n
            y = torch.cat(ys)
        out = torch.empty_like(y)
        out[order] = y
        return (out.view(T, k, -1).float() * w[..., None]).sum(1).to(x.dtype)

    def __call__(self, x: torch.Tensor, form: str) -> torch.Tensor:
        idx, w = self.route(x)
        shared = F.linear(torch.square(torch.relu(F.linear(x, self.shared_up))), self.shared_down)
        return self.experts(x, idx, w, form) + shared


def layer_cells(res: dict, save, shape: dict, shared: int, counts: list[int], dry: bool,
                profile: bool = False) -> None:
    from aligned_mamba.contract import Contract
    from aligned_mamba.layers.moe import MoE
    from aligned_mamba.ops.backend import resolve

    dev = "cpu" if dry else "cuda"
    dtype = F32 if dry else BF16  # the interpreter computes bf16 wrongly
    config = _moe_config(shape, shared)
    w = _weights(config, dev, dtype)
    be = resolve(Contract(chunk_size=64, backend="triton", model_dtype="float32" if dry else "bfloat16"), dev)
    layer = MoE(config, w, "", backend=be, dtype=dtype)
    stock = Stock(config, w)
    forms = ["loop"] if dry else ["grouped", "loop"]
    g = torch.Generator(device=dev).manual_seed(1)
    for T in counts:
        x = torch.randn(T, shape["hidden"], generator=g, device=dev).to(dtype)
        with torch.no_grad():
            ours_ms = _bench(lambda: layer.advance(None, None, x), dry)
            stock_ms = {f: _bench(lambda f=f: stock(x, f), dry) for f in forms}
            best = min(stock_ms, key=stock_ms.get)
            full, sfull = layer.advance(None, None, x), stock(x, forms[0])
            n = min(T, 8)
            bitwise = all(torch.equal(layer.advance(None, None, x[t:t + 1])[0], full[t]) for t in range(n))
            sbit = all(torch.equal(stock(x[t:t + 1], forms[0])[0], sfull[t]) for t in range(n))
            err = float((full.float() - sfull.float()).norm() / sfull.float().norm())
        res["layer"].append(dict(tokens=T, shape=shape, shared_width=shared, ours_ms=ours_ms,
                                 stock_ms=stock_ms[best], stock_form=best,
                                 stock_grouped_ms=stock_ms.get("grouped"), stock_loop_ms=stock_ms["loop"],
                                 ours_over_stock=ours_ms / stock_ms[best], bitwise=bitwise, stock_bitwise=sbit,
                                 rel_diff_vs_stock=err))
        if not dry:  # in a CUDA graph, as a decode step runs (stock: the grouped form, capturable)
            with torch.no_grad():
                og, sg = _bench_graph(lambda: layer.advance(None, None, x)), _bench_graph(lambda: stock(x, "grouped"))
            res["layer"][-1].update(ours_graph_ms=og, stock_graph_ms=sg,
                                    ours_over_stock_graph=og / sg if og and sg else None)
        if profile and not dry and T <= 4096:  # kernel tables: where launches decide, and at 4096
            from benchmarks.bench_mamba_ssm_h200 import kernel_table

            with torch.no_grad():
                res["layer"][-1]["ours_profile"] = kernel_table(torch, lambda: layer.advance(None, None, x))
                res["layer"][-1]["stock_profile"] = kernel_table(torch, lambda: stock(x, best))
        save()
        if not dry:
            torch.cuda.empty_cache()


def backward_cells(res: dict, save, shape: dict, counts: list[int], dry: bool) -> None:
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.moe import route
    from aligned_mamba.ops.moe.triton import experts_triton

    dev = "cpu" if dry else "cuda"
    dtype = F32 if dry else BF16
    cfg = TritonKernelConfigs()
    if dry:
        import dataclasses
        cfg = dataclasses.replace(cfg, moe_block_m=16, moe_block_n=32, moe_block_k=16, moe_wgrad_block_n=32,
                                  moe_wgrad_block_k=16, moe_wgrad_block_t=16)
    E, k, d, f = shape["experts"], shape["top_k"], shape["hidden"], shape["width"]
    g = torch.Generator(device=dev).manual_seed(2)
    up = (torch.randn(E, f, d, generator=g, device=dev) / d ** 0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, d, f, generator=g, device=dev) / f ** 0.5).to(dtype).requires_grad_()
    for T in counts:
        h = torch.randn(T, d, generator=g, device=dev).to(dtype).requires_grad_()
        experts, weights = route(torch.sigmoid(torch.randn(T, E, generator=g, device=dev)),
                                 torch.zeros(E, device=dev), top_k=k)
        weights.requires_grad_()
        grad = torch.randn(T, d, generator=g, device=dev).to(dtype)
        leaves = (h, weights, up, down)

        def ours() -> list[torch.Tensor]:
            return list(torch.autograd.grad(experts_triton(h, experts, weights, up, down, cfg), leaves, grad))

        def stock() -> list[torch.Tensor]:
            flat = experts.reshape(-1)
            order = torch.argsort(flat)
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
            a = torch.square(torch.relu(torch._grouped_mm(h[order // k], up.transpose(1, 2), offs=offs)))
            y = torch._grouped_mm(a, down.transpose(1, 2), offs=offs)
            out = torch.empty_like(y)
            out[order] = y
            o = (out.view(T, k, -1).float() * weights[..., None]).sum(1).to(dtype)
            return list(torch.autograd.grad(o, leaves, grad))

        a, b = ours(), ours()
        cell = dict(tokens=T, ours_ms=_bench(ours, dry), ours_grads_repeat_equal=all(map(torch.equal, a, b)))
        if not dry:
            cell["stock_ms"] = _bench(stock, dry)
            cell["ours_over_stock"] = cell["ours_ms"] / cell["stock_ms"]
        res["backward"].append(cell)
        save()


BWD_SWEEP = [dict(moe_wgrad_block_n=n, moe_wgrad_block_k=k, moe_wgrad_block_t=t, moe_wgrad_warps=w)
             for n, k, t, w in ((128, 64, 64, 8), (128, 128, 64, 8), (128, 256, 64, 8), (256, 128, 64, 8),
                                (128, 128, 32, 4), (64, 128, 64, 4), (128, 128, 128, 8))]


def bwd_sweep_cells(res: dict, save, shape: dict, counts: list[int]) -> None:
    """The routed experts' fwd+bwd under other weight-gradient tiles: time, two backwards' bits equal,
    and whether the weight gradients equal the pinned tile's (a K-order change would move them)."""
    import dataclasses

    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.moe import route
    from aligned_mamba.ops.moe.triton import experts_triton

    base = TritonKernelConfigs()
    E, k, d, f = shape["experts"], shape["top_k"], shape["hidden"], shape["width"]
    g = torch.Generator(device="cuda").manual_seed(7)
    up = (torch.randn(E, f, d, generator=g, device="cuda") / d ** 0.5).to(BF16).requires_grad_()
    down = (torch.randn(E, d, f, generator=g, device="cuda") / f ** 0.5).to(BF16).requires_grad_()
    for T in counts:
        h = torch.randn(T, d, generator=g, device="cuda").to(BF16).requires_grad_()
        experts, weights = route(torch.sigmoid(torch.randn(T, E, generator=g, device="cuda")),
                                 torch.zeros(E, device="cuda"), top_k=k)
        weights.requires_grad_()
        grad = torch.randn(T, d, generator=g, device="cuda").to(BF16)

        def step(cfg) -> tuple:
            return torch.autograd.grad(experts_triton(h, experts, weights, up, down, cfg), (h, weights, up, down),
                                       grad)

        ref = step(base)
        for over in BWD_SWEEP:
            cfg = dataclasses.replace(base, **over)
            try:
                a, b = step(cfg), step(cfg)
                ms = _bench(lambda cfg=cfg: step(cfg), False)
                res["bwd_sweep"].append(dict(tokens=T, **over, fwd_bwd_ms=ms, repeat_equal=all(map(torch.equal, a, b)),
                                             wgrads_equal_to_pinned=torch.equal(a[2], ref[2])
                                             and torch.equal(a[3], ref[3])))
                del a, b
            except Exception as e:  # a tile that does not fit: say so, go on
                res["bwd_sweep"].append(dict(tokens=T, **over, error=str(e)[:200]))
            save()


def layer_backward_cells(res: dict, save, shape: dict, shared: int, counts: list[int], dry: bool,
                         profile: bool = False) -> None:
    """fwd+bwd of the whole layer as a trainer runs it: ours ``layers.moe.MoE`` built from leaf weights
    on each step (the experts stacked in the step, as a trainer's model is built), the gradients of x
    and of every weight but the score correction bias; stock ``Stock`` (the ``_grouped_mm`` form) on
    stacked leaves. ``ours_grads_repeat_equal``: two of our steps give the same bits."""
    from aligned_mamba.contract import Contract
    from aligned_mamba.layers.moe import MoE
    from aligned_mamba.ops.backend import resolve

    dev = "cpu" if dry else "cuda"
    dtype = F32 if dry else BF16
    config = _moe_config(shape, shared)
    w = _weights(config, dev, dtype)
    be = resolve(Contract(chunk_size=64, backend="triton", model_dtype="float32" if dry else "bfloat16"), dev)
    leaves = {k: v.clone().requires_grad_(not k.endswith("e_score_correction_bias")) for k, v in w.items()}
    names = [k for k in sorted(leaves) if leaves[k].requires_grad]
    stock = Stock(config, w)
    for t in ("gate", "up", "down", "shared_up", "shared_down"):
        setattr(stock, t, getattr(stock, t).detach().clone().requires_grad_())
    stock_leaves = [stock.gate, stock.up, stock.down, stock.shared_up, stock.shared_down]
    g = torch.Generator(device=dev).manual_seed(6)
    for T in counts:
        x = torch.randn(T, shape["hidden"], generator=g, device=dev).to(dtype).requires_grad_()
        grad = torch.randn(T, shape["hidden"], generator=g, device=dev).to(dtype)

        def ours() -> tuple:
            out = MoE(config, leaves, "", backend=be, dtype=dtype).advance(None, None, x)
            return torch.autograd.grad(out, [x] + [leaves[k] for k in names], grad)

        def stock_step() -> tuple:
            return torch.autograd.grad(stock(x, "grouped"), [x] + stock_leaves, grad)

        a, b = ours(), ours()
        cell = dict(tokens=T, ours_ms=_bench(ours, dry), ours_grads_repeat_equal=all(map(torch.equal, a, b)))
        del a, b
        if not dry:
            cell["stock_ms"] = _bench(stock_step, dry)
            cell["ours_over_stock"] = cell["ours_ms"] / cell["stock_ms"]
            if profile:
                from benchmarks.bench_mamba_ssm_h200 import kernel_table

                cell["ours_profile"] = kernel_table(torch, ours, top=30)
                cell["stock_profile"] = kernel_table(torch, stock_step, top=30)
        res["layer_backward"].append(cell)
        save()
        if not dry:
            torch.cuda.empty_cache()


def stock_parts_cells(res: dict, save, shape: dict, shared: int, counts: list[int]) -> None:
    """Which piece of the stock layer changes a row's bits with the batch: for the first 8 tokens, how
    many give other bits alone than among ``T`` tokens in the router's fp32 scores, the routed experts
    (grouped and loop forms, on the batch's own routing) and the shared expert."""
    config = _moe_config(shape, shared)
    stock = Stock(config, _weights(config, "cuda", BF16))
    g = torch.Generator(device="cuda").manual_seed(4)

    def shared_expert(x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.square(torch.relu(F.linear(x, stock.shared_up))), stock.shared_down)

    for T in counts:
        x = torch.randn(T, shape["hidden"], generator=g, device="cuda").to(BF16)
        with torch.no_grad():
            idx, w = stock.route(x)
            full = dict(router=torch.sigmoid(F.linear(x.float(), stock.gate)), shared=shared_expert(x),
                        experts_grouped=stock.experts(x, idx, w, "grouped"),
                        experts_loop=stock.experts(x, idx, w, "loop"))
            n = min(T, 8)
            differ = dict.fromkeys(full, 0)
            for t in range(n):
                one = x[t:t + 1]
                alone = dict(router=torch.sigmoid(F.linear(one.float(), stock.gate)), shared=shared_expert(one),
                             experts_grouped=stock.experts(one, idx[t:t + 1], w[t:t + 1], "grouped"),
                             experts_loop=stock.experts(one, idx[t:t + 1], w[t:t + 1], "loop"))
                for k in full:
                    differ[k] += not torch.equal(alone[k][0], full[k][t])
        res["stock_parts"].append(dict(tokens=T, tokens_checked=n,
                                       **{f"{k}_rows_differ": v for k, v in differ.items()}))
        save()


SWEEP = [dict(moe_block_m=bm, moe_block_n=bn, moe_warps=w, moe_stages=st)
         for bm, bn, w, st in ((64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3), (128, 256, 8, 3),
                               (64, 64, 4, 4), (128, 128, 4, 4))]


def sweep_cells(res: dict, save, shape: dict, counts: list[int]) -> None:
    """The routed experts' forward under other grouped-GEMM tiles: time, and whether every output row
    equals the pinned tile's (a row's bits must not depend on the tile)."""
    import dataclasses

    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.moe import route
    from aligned_mamba.ops.moe.triton import experts_triton

    base = TritonKernelConfigs()
    E, k, d, f = shape["experts"], shape["top_k"], shape["hidden"], shape["width"]
    g = torch.Generator(device="cuda").manual_seed(3)
    up = (torch.randn(E, f, d, generator=g, device="cuda") / d ** 0.5).to(BF16)
    down = (torch.randn(E, d, f, generator=g, device="cuda") / f ** 0.5).to(BF16)
    for T in counts:
        h = torch.randn(T, d, generator=g, device="cuda").to(BF16)
        experts, weights = route(torch.sigmoid(torch.randn(T, E, generator=g, device="cuda")),
                                 torch.zeros(E, device="cuda"), top_k=k)
        ref = experts_triton(h, experts, weights, up, down, base)
        for over in SWEEP:
            cfg = dataclasses.replace(base, **over)
            try:
                ms = _bench(lambda cfg=cfg: experts_triton(h, experts, weights, up, down, cfg), False)
                same = torch.equal(experts_triton(h, experts, weights, up, down, cfg), ref)
                res["sweep"].append(dict(tokens=T, **over, ms=ms, bitwise_equal_to_pinned=same))
            except Exception as e:  # a tile that does not fit: say so, go on
                res["sweep"].append(dict(tokens=T, **over, error=str(e)[:200]))
            save()


DECODE_SWEEP = [dict(moe_decode_block_m=bm, moe_decode_block_n=bn, moe_decode_warps=w, moe_decode_stages=st)
                for bm, bn, w, st in ((16, 64, 4, 4), (64, 128, 4, 3), (16, 128, 4, 4), (16, 64, 4, 6), (16, 32, 4, 6),
                                      (16, 128, 8, 4), (16, 256, 8, 3), (32, 128, 4, 4))]


def decode_sweep_cells(res: dict, save, shape: dict, shared: int, counts: list[int]) -> None:
    """The whole layer in a CUDA graph under other decode tiles of the grouped GEMM (and the large tile
    for every count: moe_decode_max_rows 0), each with whether every row
    equals the pinned configs' (a row's bits must not depend on the tile)."""
    import dataclasses

    from aligned_mamba.layers.moe import MoE
    from aligned_mamba.ops.backend import TritonBackend
    from aligned_mamba.ops.configs import TritonKernelConfigs

    config = _moe_config(shape, shared)
    w = _weights(config, "cuda", BF16)
    base = TritonKernelConfigs()
    g = torch.Generator(device="cuda").manual_seed(5)
    xs = {T: torch.randn(T, shape["hidden"], generator=g, device="cuda").to(BF16) for T in counts}
    layer = MoE(config, w, "", backend=TritonBackend(base, torch.device("cuda")), dtype=BF16)
    with torch.no_grad():
        ref = {T: layer.advance(None, None, x) for T, x in xs.items()}
    for over in [DECODE_SWEEP[0], dict(moe_decode_max_rows=0), *DECODE_SWEEP[1:], dict(moe_decode_max_rows=2048)]:
        try:
            layer.backend = TritonBackend(dataclasses.replace(base, **over), torch.device("cuda"))
            for T, x in xs.items():
                with torch.no_grad():
                    same = torch.equal(layer.advance(None, None, x), ref[T])
                    ms = _bench_graph(lambda x=x: layer.advance(None, None, x))
                res["decode_sweep"].append(dict(tokens=T, **over, graph_ms=ms, bitwise_equal_to_pinned=same))
        except Exception as e:  # a tile that does not fit: say so, go on
            res["decode_sweep"].append(dict(**over, error=str(e)[:200]))
        save()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="the experts under other grouped-GEMM tiles")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes, fp32")
    ap.add_argument("--shared-width", type=int, default=3712, help="the shared expert's width")
    ap.add_argument("--profile", action="store_true", help="kernel tables of both sides at 1, 64 and 4096 tokens")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="instead of the layer cells: the layer in a CUDA graph at 1, 64 and 256 tokens "
                    "under other decode tiles")
    ap.add_argument("--layer-backward", action="store_true",
                    help="instead of the layer and backward cells: the whole layer's fwd+bwd at 4096 and 16384 "
                    "tokens against stock's (kernel tables with --profile)")
    ap.add_argument("--tokens", help="comma-separated token counts of the layer cells (default 1,64,4096,32768; "
                    "--quick 1,64,4096)")
    ap.add_argument("--bwd-sweep", action="store_true",
                    help="the routed experts' fwd+bwd at 16384 tokens under other weight-gradient tiles")
    ap.add_argument("--stock-parts", action="store_true",
                    help="instead of the layer and backward cells: which stock piece changes a row's bits")
    a = ap.parse_args()
    import triton

    dry = a.dry_run
    res = dict(script="benchmarks/bench_moe_h200.py", gpu="cpu (dry run)" if dry else torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, commit=git_commit() or "unknown",
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), layer=[], backward=[],
               layer_backward=[], bwd_sweep=[], sweep=[],
               decode_sweep=[], stock_parts=[], errors=[])
    out = Path(a.out)

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    shape = TINY if dry else NANO
    counts = [1, 12, 40] if dry else [1, 64, 4096] if a.quick else [1, 64, 4096, 32768]
    if a.tokens and not dry:
        counts = [int(t) for t in a.tokens.split(",")]
    jobs = []
    if a.layer_backward:
        jobs.append(("layer_backward", lambda: layer_backward_cells(
            res, save, shape, 24 if dry else a.shared_width, [40] if dry else [4096, 16384], dry, a.profile)))
    elif not a.stock_parts and not a.decode_sweep and not a.bwd_sweep:
        jobs.append(("layer", lambda: layer_cells(res, save, shape, 24 if dry else a.shared_width, counts, dry,
                                                               a.profile)))
        if not a.no_backward:
            jobs.append(("backward", lambda: backward_cells(res, save, shape, [40] if dry else [4096, 32768], dry)))
    if a.bwd_sweep and not dry:
        jobs.append(("bwd_sweep", lambda: bwd_sweep_cells(res, save, shape, [16384])))
    if a.sweep and not dry:
        jobs.append(("sweep", lambda: sweep_cells(res, save, shape, [4096, 32768])))
    if a.decode_sweep and not dry:
        jobs.append(("decode_sweep", lambda: decode_sweep_cells(res, save, shape, a.shared_width, [1, 64, 256])))
    if a.stock_parts and not dry:
        jobs.append(("stock_parts", lambda: stock_parts_cells(res, save, shape, a.shared_width, [64, 4096])))
    for name, fn in jobs:
        try:
            fn()
        except Exception as e:  # keep what was measured; say what broke
            traceback.print_exc()
            res["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
            save()
    save()
    print(f"{res['gpu']} torch {res['torch']} triton {res['triton']} commit {res['commit'][:10]}")
    for r in res["layer"]:
        print(f"moe {r['tokens']:6d} tokens ours {r['ours_ms']:8.3f} ms stock {r['stock_ms']:8.3f} ms "
              f"({r['stock_form']}) x{r['ours_over_stock']:.2f} bitwise {r['bitwise']} (stock {r['stock_bitwise']})")
    for r in res["layer"]:
        if r.get("ours_graph_ms"):
            print(f"moe {r['tokens']:6d} tokens in a CUDA graph: ours {r['ours_graph_ms']:8.3f} ms stock "
                  f"{r['stock_graph_ms']} ms")
    for r in res["sweep"] + res["decode_sweep"] + res["bwd_sweep"]:
        print("sweep", r)
    for r in res["stock_parts"]:
        print("stock parts", r)
    for r in res["layer_backward"]:
        print(f"moe layer fwd+bwd {r['tokens']:6d} tokens ours {r['ours_ms']:8.3f} ms stock {r.get('stock_ms')} ms "
              f"repeat-equal {r['ours_grads_repeat_equal']}")
    for r in res["backward"]:
        print(f"moe fwd+bwd {r['tokens']:6d} tokens ours {r['ours_ms']:8.3f} ms stock {r.get('stock_ms')} ms "
              f"repeat-equal {r['ours_grads_repeat_equal']}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
