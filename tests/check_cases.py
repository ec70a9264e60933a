"""The check's cases on a built model, for the GPU tests of hybrid layer kinds."""

import torch


def assert_every_case(model, prompt_len: int = 300, requests: int = 3, gen_len: int = 120, budget: int = 100) -> None:
    """Every exact-replay case of ``check`` gives the one-pass forward's rows bit for bit, and the
    baseline (exact replay off) differs: the check can fail."""
    from aligned_mamba.check import CASES, compare, make_prompts, run_case

    prompts = make_prompts(model.shape.vocab_size, prompt_len, requests, seed=0)
    for spec in CASES:
        res = run_case(spec, model, prompts, gen_len, budget, seed=0)
        report = compare(res.rows, model.forward([torch.tensor(t) for t in res.tokens]), model.contract,
                         model.contract)
        assert report.bitwise_equal == spec.exact_replay, (spec.name, report.summary())
