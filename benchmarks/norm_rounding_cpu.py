#!/usr/bin/env python3
"""How much of a bf16 model's logits error the norms' rounding accounts for (CPU, the torch backend).

    python3 benchmarks/norm_rounding_cpu.py --out OUT.json [--layers 12,24] [--tokens 512] [--dry-run]

A random Mamba2 (d_model 512, 16 heads of 64, state 128, 1 group, vocab 4096, chunk 128; ``make_tiny``
weights, seed 3) in bf16 on the torch backend, its logits against the fp64 reference model
(tests/fp64_reference.py) as ||got - ref|| / ||ref||, with top-1 agreement, for the contract's norms
(v3: each output rounded once, weight times the fp32 normalised value, and the fp32 residual
normalised unrounded), for v2 (the residual rounded to bf16 before the RMSNorms), for the Hugging
Face / vLLM torch form's second rounding (the normalised value rounded to bf16, then the product
rounded again) in the RMSNorms or in the gated norm, and for Hugging Face's Mamba2 (v1: the residual
rounded first and both norms rounding twice). Nothing else changes between the rows.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from fp64_reference import reference_logits_fp64, rel_err  # noqa: E402

from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402
from aligned_mamba.models.registry import build_model  # noqa: E402
from aligned_mamba.ops import elementwise as ew  # noqa: E402
from aligned_mamba.ops.norm import tree  # noqa: E402


def rms_twice(x, weight, eps, out_dtype=None):
    """Hugging Face's Mamba2 RMSNorm: the normalised value rounded, then weight times it rounded."""
    out_dtype = out_dtype or weight.dtype
    return weight.to(out_dtype) * tree._normalize(x.to(torch.float32), eps).to(out_dtype)


def gated_twice(y, z, weight, eps, n_groups):
    """Hugging Face's gated RMSNorm, rounding as ``rms_twice``."""
    M, d = y.shape
    g = y.to(torch.float32) * ew.silu(z.to(torch.float32))
    g = tree._normalize(g.view(M, n_groups, d // n_groups), eps).view(M, d)
    return weight.to(y.dtype) * g.to(y.dtype)


def embed_norm_rounded(token_ids, embedding, w, eps, dtype, residual_dtype, *, norm=tree.rms_norm):
    """Contract v2's first norm: the residual rounded to the model dtype before it is normalised."""
    residual = embedding[token_ids].to(residual_dtype)
    return norm(residual.to(dtype), w, eps, dtype), residual


def add_norm_rounded(x, residual, w, eps, dtype, *, norm=tree.rms_norm):
    """Contract v2's add-norm: the sum rounded to the model dtype before it is normalised."""
    residual = residual + x
    return norm(residual.to(dtype), w, eps, dtype), residual


RMS_TWICE = dict(rms_norm=rms_twice, embed_norm=functools.partial(tree.embed_norm, norm=rms_twice),
                 add_norm=functools.partial(tree.add_norm, norm=rms_twice))
VARIANTS = {"contract (v3)": {}, "input rounded (v2)": dict(add_norm=add_norm_rounded, embed_norm=embed_norm_rounded),
            "RMSNorms twice": RMS_TWICE, "gated norm twice": dict(gated_rms_norm=gated_twice),
            "input rounded, both twice (v1, HF)": dict(
                rms_norm=rms_twice, gated_rms_norm=gated_twice,
                add_norm=functools.partial(add_norm_rounded, norm=rms_twice),
                embed_norm=functools.partial(embed_norm_rounded, norm=rms_twice))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="12,24")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dry-run", action="store_true", help="2 layers, 64 tokens (the test's)")
    args = ap.parse_args()
    if args.dry_run:
        args.layers, args.tokens = "2", 64
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
           "commit": os.environ.get("GIT_COMMIT"), "cells": []}
    for layers in map(int, args.layers.split(",")):
        shape = dict(hidden_size=512, num_heads=16, head_dim=64, state_size=128, n_groups=1,
                     num_hidden_layers=layers, vocab_size=4096, chunk_size=128)
        config, tensors = make_tiny(3, dtype="bfloat16", **shape)
        seq = torch.randint(0, shape["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(5))
        ref = reference_logits_fp64(config, {k: v.double() for k, v in tensors.items()}, seq)
        contract = Contract(chunk_size=128, backend="torch", model_dtype="bfloat16")
        for name, forms in VARIANTS.items():
            model = build_model(config, tensors, contract)
            if forms:  # every holder of the backend gets the variant's forms
                be = model.backend.replace(**forms)
                for obj in (model, *model.blocks, *(getattr(b, "mixer", None) for b in model.blocks)):
                    if obj is not None and hasattr(obj, "backend"):
                        obj.backend = be
            with torch.no_grad():
                logits = model.forward([seq])[0]
            cell = {"layers": layers, "tokens": args.tokens, "norms": name, "rel_err": rel_err(logits, ref),
                    "top1": float((logits.float().argmax(-1) == ref.argmax(-1)).float().mean())}
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
