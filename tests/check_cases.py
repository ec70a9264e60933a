"""The check's cases and graph decode on a built model, for the GPU tests of hybrid layer kinds."""

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


def assert_graph_decode_equals_single_pass(model, B: int, steps: int, max_start: int,
                                           page_size: int | None = None) -> None:
    """B sequences (random contexts below ``max_start``, random slots) prefilled together, then
    ``steps`` decode steps in CUDA graphs: every row equals the one-pass forward's row. ``page_size``:
    attention keeps its keys in a paged cache, pages handed out in shuffled order."""
    from aligned_mamba.decode_graph import DecodeGraphs
    from aligned_mamba.ops.step import Step

    g = torch.Generator().manual_seed(B)
    V = model.shape.vocab_size
    starts = [int(s) for s in torch.randint(1, max_start, (B,), generator=g)]
    hist = [torch.randint(0, V, (s + steps,), generator=g) for s in starts]
    slots = torch.randperm(B, generator=g).tolist()
    cache = model.new_cache(B + 1, max_len=1024, page_size=page_size)
    if cache.pages is not None:  # scattered pages: a slot's blocks are not adjacent, slots interleave
        cache.pages.free = torch.randperm(cache.pages.num_pages, generator=g).tolist()
    model.advance(cache, Step.make(slots, [0] * B, starts), torch.cat([h[:s] for h, s in zip(hist, starts)]))
    graphs = DecodeGraphs(model, cache, spare_slot=B)
    got = []
    for k in range(steps):
        pos = [s + k for s in starts]
        got.append(graphs.step(slots, pos, torch.stack([h[p] for h, p in zip(hist, pos)])).clone())
    ref = model.forward(hist)
    for i in range(B):
        assert torch.equal(torch.stack([r[i] for r in got]), ref[i][starts[i]:starts[i] + steps]), i


def assert_cli_report_aligned(result: dict, code: int, engine: str, logprob_tokens: int) -> None:
    """A ``check --json`` report: exit 0 and OK, the four exact-replay cases with 0 differing rows and
    logprobs (``logprob_tokens`` each), the baseline differing in both; prints each case's counts."""
    exact = [case for case in result["cases"] if case["exact_replay"]]
    base = next(case for case in result["cases"] if not case["exact_replay"])
    print("\n" + "; ".join(f"{c['name']}: {c['mismatched_rows']}/{c['rows']} rows, "
                           f"{c['mismatched_logprobs']}/{c['logprob_tokens']} logprobs" for c in result["cases"]))
    assert result["engine"] == engine and len(exact) == 4 and all(case["rows"] > 0 for case in exact)
    assert code == 0 and result["ok"] and all(case["mismatched_rows"] == 0 for case in exact)
    assert all(case["logprob_tokens"] == logprob_tokens and case["mismatched_logprobs"] == 0 for case in exact)
    assert base["mismatched_rows"] > 0 and base["mismatched_logprobs"] > 0
