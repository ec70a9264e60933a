"""The Megatron-Core hook on a hybrid MambaModel (Nemotron-H: ``hybrid_override_pattern`` of M, *, - and E
layers): exact Megatron <-> Hugging Face weight conversion, Megatron's logits equal to the core's CausalLM
(the reference engine's model) bit for bit, training through Megatron whose served weights sample what it
scores, the stock baselines that differ, and the refusals.

The Megatron side is a real megatron-core 0.16 MambaModel from ``local_mamba_stack_spec`` on the CPU
(``trainer_hooks.megatron.cpu`` shims). "Stock" means Megatron's own attention (DotProductAttention over torch GEMMs and
softmax) or MLP forward in place of the hook's, so each equality test here can fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from torch_threads import single_thread_by_default  # noqa: E402, F401 (autouse fixture)

from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.engine import SamplerEngine  # noqa: E402
from aligned_mamba.errors import ModelLoadError  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.nemotron_h import make_tiny_hybrid, save_checkpoint  # noqa: E402
from aligned_mamba.train import PolicyTrainer, weights_digest, weights_from_bytes  # noqa: E402
from trainer_hooks import megatron as hk  # noqa: E402
from trainer_hooks.megatron import trainer as mc  # noqa: E402
from trainer_hooks.megatron.weights import (  # noqa: E402
    export_hf_checkpoint,
    hf_to_megatron,
    import_hf_checkpoint,
    megatron_to_hf,
)

SMALL = dict(hidden_size=64, vocab_size=256, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
             intermediate_size=128, chunk_size=32)
# Megatron-representable Nemotron-H layouts (no Mamba2/MLP biases: Megatron's one add_bias_linear would
# also give attention biases); GQA ratios 1, 4 and 8
LAYOUTS = {
    "attention_first_gqa1": dict(pattern="*M-M", num_attention_heads=4, num_key_value_heads=4, head_dim=32),
    "attention_last_gqa4": dict(pattern="M-M*", num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "two_attention_gqa8": dict(pattern="M**-M", num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                               n_groups=2),
}
DTYPES = ("bfloat16", "float32")
# MoE layers as Nemotron 3 Nano's (8 experts in 4 groups, top 2 from the best group, a shared expert), in a
# layout Megatron's MoELayer represents: its group score is the top topk / group_topk = 2 experts, as ours
MOE = dict(pattern="ME*-E", num_attention_heads=4, num_key_value_heads=4, head_dim=16, topk_group=1)


@pytest.fixture(scope="module", autouse=True)
def megatron_process() -> None:
    mc.prepare_process()


@pytest.fixture(autouse=True)
def no_hook_left() -> Iterator[None]:
    yield
    if hk.installed() is not None:
        hk.installed().uninstall()


def hybrid(layout: str, dtype: str, seed: int = 7):
    over = dict(MOE if layout == "moe" else LAYOUTS[layout])
    config, tensors = make_tiny_hybrid(seed, dtype=dtype, pattern=over.pop("pattern"), **{**SMALL, **over})
    return config, tensors, Contract(chunk_size=config.chunk_size, model_dtype=dtype)


def sequences(vocab: int, lengths: tuple[int, ...] = (90, 17, 5, 1), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def megatron_model(config, tensors, contract: Contract | None):
    """Hook on (installed for ``contract`` before building) or off (Megatron's stock modules, the contract's
    chunk size passed to its mixers)."""
    if contract is not None:
        hk.install(contract)
        model = mc.build_mamba_model(config, contract.model_dtype)
    else:
        model = mc.build_mamba_model(config, config.dtype, chunk_size=config.chunk_size)
    mc.load_hf_weights(model, config, tensors)
    model.eval()
    return model


def score(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(torch.split(mc.megatron_packed_logits(model, seqs), [int(s.numel()) for s in seqs]))


def differing_rows(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int(not torch.equal(x[i], y[i])) for x, y in zip(a, b, strict=True) for i in range(x.shape[0]))


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]


def stock(model, kind: str):
    """Put Megatron's own forward back on every SelfAttention (``kind="attention"``) or MLP of a hooked model
    (their linears were never swapped: Megatron's stock modules run), the rest staying aligned."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    cls = {"attention": SelfAttention, "mlp": MLP}[kind]
    n = 0
    for m in model.modules():
        if type(m) is cls:
            del m.forward  # the instance attribute the hook set; the class's forward shows through
            n += 1
    assert n
    return model


def refused(fn, *words: str, error: type[Exception] = hk.AlignmentRefused) -> None:
    with pytest.raises(error) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


# -- weights ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_round_trip_exactly_through_the_megatron_model(layout: str, dtype: str, tmp_path) -> None:
    config, tensors, contract = hybrid(layout, dtype)
    model = megatron_model(config, tensors, contract)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert set(sd) == set(hf_to_megatron(tensors, config))
    back = megatron_to_hf(model.state_dict(), config)
    assert list(back) == list(tensors)  # the checkpoint's names, in its order
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    again = hf_to_megatron(back, config)
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) and again[k].dtype == sd[k].dtype
                                           for k in sd)
    # the Transformer Engine spelling of the layer norms (fused into the next linear) converts the same
    te = hf_to_megatron(tensors, config, te_fused_norm=True)
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in te)
    assert all(torch.equal(a, b) for a, b in zip(megatron_to_hf(te, config).values(), tensors.values()))
    # through files: export, then import (strict load) gives the same tensors
    export_hf_checkpoint(model.state_dict(), config, tmp_path / "ckpt")
    config2, mg = import_hf_checkpoint(tmp_path / "ckpt")
    assert config2 == config and all(torch.equal(mg[k], sd[k]) for k in sd)


def test_linear_qkv_layout_is_megatrons_own() -> None:
    """The q/k/v split is Megatron's (per key/value group [q heads | k | v]): Megatron's own
    ``get_query_key_value_tensors`` on the converted weight gives the HF projections' q, k, v (fp32, to
    rounding: one fused GEMM against three)."""
    config, tensors, _ = hybrid("attention_last_gqa4", "float32")
    model = megatron_model(config, tensors, None)
    attn = model.decoder.layers[3].self_attention
    x = torch.randn(11, 2, config.hidden_size)
    q, k, v = attn.get_query_key_value_tensors(x)
    p = "backbone.layers.3.mixer."
    H, G, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    for got, name, heads in ((q, "q_proj", H), (k, "k_proj", G), (v, "v_proj", G)):
        want = (x @ tensors[p + name + ".weight"].T).view(11, 2, heads, D)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_stock_megatron_is_the_same_model_to_rounding() -> None:
    """Semantics of the whole conversion: Megatron's stock forward (no hook) of the converted checkpoint is
    the core's model in fp32 to rounding, and not bit for bit."""
    for layout in LAYOUTS:
        config, tensors, contract = hybrid(layout, "float32")
        seqs = sequences(config.vocab_size, (70, 9))
        ref = build_model(config, tensors, contract).forward(seqs)
        with torch.no_grad():
            got = torch.split(mc.megatron_sequence_logits(megatron_model(config, tensors, None), seqs), [70, 9])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
        assert differing_rows(list(got), ref) > 0


# -- bits ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_hybrid_logits_equal_the_reference_engine(layout: str, dtype: str) -> None:
    config, tensors, contract = hybrid(layout, dtype)
    seqs = sequences(config.vocab_size)  # 90 tokens: two key blocks (64) and three chunks (32)
    ref = build_model(config, tensors, contract).forward(seqs)
    model = megatron_model(config, tensors, contract)
    got = score(model, seqs)
    assert got[0].dtype == ref[0].dtype
    assert differing_rows(got, ref) == 0
    # the training forward (train mode, autograd recording) gives the same bits, and reaches every weight
    model.train()
    logits = mc.megatron_packed_logits(model, seqs)
    assert torch.equal(logits.detach(), torch.cat(ref))
    logits.float().logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and float(p.grad.abs().max()) > 0, name
    # an unpacked [s, b] batch, with no mask or Megatron's causal one: each batch row is its own sequence
    same_len = [seqs[0], sequences(config.vocab_size, (90,), seed=1)[0]]
    ref2 = torch.stack(build_model(config, tensors, contract).forward(same_len))
    model.eval()
    with torch.no_grad():
        for mask in (None, causal(90)):
            assert torch.equal(model(torch.stack(same_len), None, attention_mask=mask), ref2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_without_the_hook_the_logits_differ(layout: str, dtype: str) -> None:
    """What the hook prevents. Megatron's stock attention alone (Mamba2 and MLP layers aligned) differs in
    almost every row: one softmax over the whole row and GEMMs whose shapes follow the call, where the
    sampler visits key blocks of 64 with an online softmax. The whole stock model (no hook) differs too."""
    config, tensors, contract = hybrid(layout, dtype)
    seqs = sequences(config.vocab_size, (90, 90))
    ref = torch.stack(build_model(config, tensors, contract).forward(seqs))
    with torch.no_grad():
        got = stock(megatron_model(config, tensors, contract), "attention")(torch.stack(seqs), None,
                                                                            attention_mask=causal(90))
        hk.installed().uninstall()
        whole = torch.stack(torch.split(mc.megatron_sequence_logits(megatron_model(config, tensors, None), seqs),
                                        90))
    rows = ref.shape[0] * ref.shape[1]
    assert int((got != ref).any(-1).sum()) > rows // 2
    assert int((whole != ref).any(-1).sum()) > rows // 2


def test_stock_mlp_differs_where_its_gemm_changes_path() -> None:
    """Megatron's stock MLP (torch F.linear, pow(relu, 2)) matches the core's MLP at many rows on this CPU, but
    not for a micro-batch of 1 or 2 tokens in fp32 (ATen's small-M GEMM path: measured on torch 2.13 CPU,
    as docs/design.md records for fp32 linear rows at M = 1, 2, 7). The hook runs the core's fixed-tile GEMM
    whatever the call holds."""
    config, tensors, contract = hybrid("attention_first_gqa1", "float32")
    model = megatron_model(config, tensors, contract)
    diffs = 0
    for n in (1, 2):
        seqs = sequences(config.vocab_size, (n,), seed=n)
        ref = build_model(config, tensors, contract).forward(seqs)
        assert differing_rows(score(model, seqs), ref) == 0
        diffs += differing_rows(score(stock(megatron_model(config, tensors, contract), "mlp"), seqs), ref)
    assert diffs > 0


# -- MoE layers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_hybrid_round_trips_and_equals_the_reference_engine(dtype: str) -> None:
    """Megatron's MoELayer (TopKRouter, SequentialMLP experts, a shared expert) under the hook: the weights
    round-trip exactly, the logits equal the core model's bit for bit (packed, and in train mode with
    autograd on), and the gradient reaches the router and every expert."""
    config, tensors, contract = hybrid("moe", dtype)
    model = megatron_model(config, tensors, contract)
    back = megatron_to_hf(model.state_dict(), config)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    seqs = sequences(config.vocab_size)
    ref = build_model(config, tensors, contract).forward(seqs)
    assert differing_rows(score(model, seqs), ref) == 0
    model.train()
    logits = mc.megatron_packed_logits(model, seqs)
    assert torch.equal(logits.detach(), torch.cat(ref))
    logits.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".mlp.router." in n or ".mlp.experts." in n}
    assert len(grads) == 2 * (1 + 2 * config.n_routed_experts)  # two MoE layers: router + fc1/fc2 per expert
    assert all(g is not None and float(g.abs().max()) > 0 for g in grads.values()), \
        [n for n, g in grads.items() if g is None or not float(g.abs().max())]
    # Megatron's expert-bias bookkeeping (its aux-loss-free update) saw every routed token: 113 tokens x top 2
    counts = [float(m.router.local_tokens_per_expert.sum()) for m in model.modules()
              if type(m).__name__ == "MoELayer"]
    assert counts == [2.0 * sum(int(s.numel()) for s in seqs)] * 2


def test_moe_hybrid_under_row_parallel_slices_equals_the_reference() -> None:
    """Under a contract of row_parallel_slices 4 every expert's and the shared expert's down projection is
    the sliced tree GEMM on both sides (the core's MoE layer at any TP degree dividing 4): Megatron's
    logits equal the reference's bit for bit; the slices change the arithmetic (S = 1's rows differ)."""
    import dataclasses

    config, tensors, plain = hybrid("moe", "float32")
    contract = dataclasses.replace(plain, row_parallel_slices=4)
    seqs = sequences(config.vocab_size)
    ref = build_model(config, tensors, contract).forward(seqs)
    assert differing_rows(score(megatron_model(config, tensors, contract), seqs), ref) == 0
    assert differing_rows(build_model(config, tensors, plain).forward(seqs), ref) > 0


def test_moe_hybrid_without_the_aligned_moe_the_logits_differ() -> None:
    """What the hook's MoE forward prevents: transformers' NemotronHMoE (its experts' F.linear over however
    many rows each expert got) in place of it, same weights, the rest aligned, gives other bits (fp32).
    Megatron's own MoELayer cannot run on this CPU without Transformer Engine (its router GEMM), so that is
    the stock expert path measured here."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    config, tensors, contract = hybrid("moe", "float32")
    seqs = sequences(config.vocab_size, (90, 90))
    ref = torch.stack(build_model(config, tensors, contract).forward(seqs))
    model = megatron_model(config, tensors, contract)
    hc = transformers.NemotronHConfig(**{k: v for k, v in config.to_hf_dict().items() if k != "architectures"})
    n = 0
    for i, kind in enumerate(config.hybrid_override_pattern):
        if kind != "E":
            continue
        theirs, t = hf.NemotronHMoE(hc).to(torch.float32).eval(), f"backbone.layers.{i}.mixer."
        with torch.no_grad():
            theirs.gate.weight.copy_(tensors[t + "gate.weight"])
            theirs.gate.e_score_correction_bias.copy_(tensors[t + "gate.e_score_correction_bias"])
            for name in ("up_proj", "down_proj"):
                getattr(theirs.experts, name).copy_(torch.stack([tensors[f"{t}experts.{e}.{name}.weight"]
                                                                 for e in range(config.n_routed_experts)]))
                getattr(theirs.shared_experts, name).weight.copy_(tensors[f"{t}shared_experts.{name}.weight"])
        layer = model.decoder.layers[i].mlp
        layer.forward = lambda x, *a, _m=theirs, **k: (_m(x.transpose(0, 1).contiguous()).transpose(0, 1), None)
        n += 1
    assert n == 2
    with torch.no_grad():
        got = model(torch.stack(seqs), None, attention_mask=causal(90))
    rows = ref.shape[0] * ref.shape[1]
    assert int((got != ref).any(-1).sum()) > rows // 2


def test_moe_features_not_covered_are_refused_in_one_line() -> None:
    config, _, contract = hybrid("moe", "bfloat16")

    def build(**overrides: Any):
        from megatron.core.models.mamba.mamba_model import MambaModel

        hk.install(contract)
        tc = mc.megatron_transformer_config(config, contract.model_dtype)
        for k, v in overrides.items():
            setattr(tc, k, v)
        spec = hk.local_mamba_stack_spec(config.layer_norm_epsilon, moe_experts=config.n_routed_experts)
        return MambaModel(tc, spec, vocab_size=config.vocab_size, max_sequence_length=4096,
                          hybrid_override_pattern=config.hybrid_override_pattern, position_embedding_type="none")

    build()  # the covered configuration builds
    hk.installed().uninstall()
    refused(lambda: build(moe_router_score_function="softmax"), "decoder.layers.1.mlp", "'softmax'")
    hk.installed().uninstall()
    refused(lambda: build(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss"), "aux loss")
    hk.installed().uninstall()
    refused(lambda: build(moe_router_group_topk=2, moe_router_topk=2), "group_topk 2", "top 2 experts")
    hk.installed().uninstall()
    for over, words in ((dict(moe_latent_size=32), ("moe_latent_size=32", "Transformer Engine")),
                        (dict(norm_topk_prob=False), ("norm_topk_prob=False",)),
                        (dict(topk_group=2), ("topk_group=2", "top 2"))):
        c, _ = make_tiny_hybrid(0, pattern="ME", **{**SMALL, **over})
        refused(lambda c=c: mc.megatron_transformer_config(c, "bfloat16"), *words, error=ModelLoadError)


# -- training -------------------------------------------------------------------------------------------------


def sample(config, weights, contract, seed: int):
    """Three requests (prompts 29, 70, 81 tokens, 12 new each) at a 23-token budget: chunked prefill split off
    both the chunk (32) and the key-block (64) grids, mixed with other requests' decode steps."""
    eng = SamplerEngine(build_model(config, weights, contract), num_slots=3, max_batch_tokens=23, seed=seed)
    reqs = [eng.add_request(list(range(1, n + 1)), 12) for n in (29, 70, 81)]
    eng.run()
    return [torch.tensor(r.tokens) for r in reqs], [r.prompt_len for r in reqs], reqs


def exported(trainer) -> dict[str, torch.Tensor]:
    blob, digest = trainer.export_bytes()
    w = weights_from_bytes(blob)
    assert weights_digest(w) == digest
    return w


@pytest.mark.parametrize("layout,dtype", [("two_attention_gqa8", "bfloat16"), ("attention_first_gqa1", "float32"),
                                          ("moe", "bfloat16")])
def test_megatron_trainer_steps_and_serves_what_it_scores(layout: str, dtype: str) -> None:
    """Steps through Megatron's forward and backward on the hybrid; after each, the exported weights sample
    (reference engine, chunked prefill mixed with decode) logprobs equal to the trainer's scores, bit for bit.

    Against the reference trainer: the loss is equal in both dtypes (the forward bits are); the grad norm and
    the updated weights are equal in bf16 (3 steps) but not in fp32, where Megatron's backward gives
    gradients a few ulps apart from the core model's own (measured, torch 2.13 CPU: most weights' gradients,
    max |d| ~1e-8, the last layer's own equal). Both are self-consistent trainers; exact replay asks only
    that what one trainer serves samples what it scores."""
    config, tensors, contract = hybrid(layout, dtype)
    tr = mc.make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    ref = PolicyTrainer(config, tensors, contract, lr=1e-3)
    assert tr.export_bytes()[1] == weights_digest(tensors)
    digests = {weights_digest(tensors)}
    w = exported(tr)
    for step, advantages in enumerate(([1.0, -1.0, 0.5], [0.25, 1.0, -2.0], [-0.5, 0.75, 1.0])):
        seqs, pl, reqs = sample(config, w, contract, step)
        for lp, r in zip(tr.token_logprobs(seqs, pl), reqs):
            assert torch.equal(lp, torch.tensor(r.sampled_logprobs, dtype=torch.float32))
        stats = tr.step(seqs, pl, advantages)
        assert stats["weights_version"] == step + 1 and stats["grad_norm"] > 0
        w = exported(tr)
        assert {k: v.dtype for k, v in w.items()} == {k: v.dtype for k, v in tensors.items()}
        assert weights_digest(w) not in digests  # the weights move
        digests.add(weights_digest(w))
        want = ref.step(seqs, pl, advantages)
        if step == 0 or dtype == "bfloat16":  # (fp32 after a step: other weights, see the docstring)
            assert stats["loss"] == want["loss"]
        if dtype == "bfloat16":
            assert stats == want and weights_digest(w) == ref.export_bytes()[1]
    seqs, pl, reqs = sample(config, w, contract, 9)
    for lp, r in zip(tr.token_logprobs(seqs, pl), reqs):
        assert torch.equal(lp, torch.tensor(r.sampled_logprobs, dtype=torch.float32))


@pytest.mark.parametrize("layout,engine", [pytest.param("two_attention_gqa8", "vllm", marks=pytest.mark.engines("own")),
                                           ("moe", "reference")])
def test_cli_check_trainer_megatron_on_a_hybrid(layout: str, engine: str, tmp_path) -> None:
    """``aligned-mamba check --trainer megatron`` on hybrid checkpoints: with real vLLM engines sampling
    (plugin on for the exact-replay cases, stock vLLM's NemotronH for the baseline, which differs), and
    on the MoE layout with the reference engine (stock vLLM-cpu cannot run its own MoE layer on a CPU)."""
    from aligned_mamba.cli import main

    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm engine needs vllm (extra 'vllm')")
    config, tensors, _ = hybrid(layout, "bfloat16")
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    out = tmp_path / "result.json"
    code = main(["check", "--model", str(tmp_path / "ckpt"), "--trainer", "megatron", "--engine", engine,
                 "--backend", "torch", "--prompt-len", "45", "--gen-len", "25", "--requests", "2", "--jobs",
                 "2" if engine == "vllm" else "1", *(["--dtype", "float32"] if engine == "reference" else []),
                 "--json", str(out)])  # float32: at these sizes bf16 logits round the baseline's differences away
    result = json.loads(out.read_text())
    assert result["trainer"] == "megatron" and result["engine"] == engine
    assert result["model"]["family"] == "nemotron_h"
    exact = [case for case in result["cases"] if case["exact_replay"]]
    assert len(exact) == 4 and all(case["rows"] > 0 for case in exact)
    assert code == 0 and result["ok"] and all(case["mismatched_rows"] == 0 for case in exact)
    if engine == "vllm":
        assert next(case for case in result["cases"] if not case["exact_replay"])["mismatched_rows"] > 0


# -- refusals ---------------------------------------------------------------------------------------------------


def build_with(config, contract: Contract, *, pattern: str | None = None, position: str = "none",
               **overrides: Any):
    """A hooked hybrid MambaModel with TransformerConfig fields overridden (the hook checks on construction)."""
    from megatron.core.models.mamba.mamba_model import MambaModel

    hk.install(contract)
    tc = mc.megatron_transformer_config(config, contract.model_dtype)
    for k, v in overrides.items():
        setattr(tc, k, v)
    spec = hk.local_mamba_stack_spec(config.layer_norm_epsilon)
    pattern = pattern or config.hybrid_override_pattern
    return MambaModel(tc, spec, vocab_size=config.vocab_size, max_sequence_length=4096,
                      hybrid_override_pattern=pattern, position_embedding_type=position)


def test_features_not_covered_are_refused_in_one_line() -> None:
    config, tensors, contract = hybrid("attention_first_gqa1", "bfloat16")
    # an E layer built without a MoE spec (MambaStack's default IdentityOp)
    refused(lambda: build_with(config, contract, pattern="*M-E"), "layer 3 ('E' in '*M-E') is a IdentityOp")
    refused(lambda: build_with(config, contract, window_size=(16, 0)), "sliding-window attention")
    refused(lambda: build_with(config, contract, qk_layernorm=True), "qk_layernorm")
    refused(lambda: build_with(config, contract, softmax_type="off-by-one"), "softmax_type 'off-by-one'")
    refused(lambda: build_with(config, contract, softmax_scale=0.5), "softmax_scale 0.5")
    refused(lambda: build_with(config, contract, attention_output_gate=True), "output gate")
    refused(lambda: build_with(config, contract, add_qkv_bias=True), "attention biases")
    refused(lambda: build_with(config, contract, gated_linear_unit=True), "gated linear unit")
    refused(lambda: build_with(config, contract, activation_func=torch.nn.functional.gelu), "activation gelu")
    refused(lambda: build_with(config, contract, position="rope"), "position_embedding_type 'rope'")
    refused(lambda: build_with(config, contract, attention_dropout=0.1), "attention dropout 0.1")

    model = megatron_model(config, tensors, contract)
    x = torch.zeros(8, 1, config.hidden_size, dtype=torch.bfloat16)
    attn = model.decoder.layers[0].self_attention
    padding = causal(8).clone()
    padding[..., 6:] = True  # the last two keys masked as padding
    refused(lambda: attn(x, attention_mask=padding), "not the causal mask", "padding")
    refused(lambda: attn(x, None, rotary_pos_emb=torch.zeros(8, 1, 1, 32)), "rotary embeddings")
    refused(lambda: attn(x, None, inference_context=object()), "inference context")
    refused(lambda: model.decoder.layers[2].mlp(x, per_token_scale=torch.ones(8)), "per_token_scale")
    # a Transformer Engine style layer: the norm fused into linear_qkv leaves an IdentityOp in its slot
    from megatron.core.transformer.identity_op import IdentityOp

    model = mc.build_mamba_model(config, "bfloat16")
    model.decoder.layers[0].input_layernorm = IdentityOp()
    refused(lambda: hk.installed().apply_to_model(model), "decoder.layers.0", "input_layernorm is IdentityOp")
    # Nemotron-H configs Megatron cannot represent
    biased, _ = make_tiny_hybrid(0, pattern="M*-", mlp_bias=True, **SMALL)
    refused(lambda: mc.megatron_transformer_config(biased, "bfloat16"), "mlp_bias=True", "add_bias_linear",
            error=ModelLoadError)


def test_conversion_refusals_name_the_key() -> None:
    config, tensors, _ = hybrid("attention_last_gqa4", "bfloat16")
    mg = hf_to_megatron(tensors, config)
    qkv = "decoder.layers.3.self_attention.linear_qkv.weight"
    w = mg[qkv]

    def convert(sd: dict[str, Any]):
        return lambda: megatron_to_hf(sd, config)

    refused(convert({**mg, "decoder.layers.3.mixer.A_log": mg["decoder.layers.0.mixer.A_log"]}),
            "'decoder.layers.3.mixer.A_log'", "layer 3 is an attention layer", error=ModelLoadError)
    refused(convert({k: v for k, v in mg.items() if k != qkv}), f"lacks {qkv!r}", "q_proj.weight/",
            error=ModelLoadError)
    refused(convert({**mg, qkv: w[: w.shape[0] // 2]}), qkv, "TP=2", error=ModelLoadError)
    refused(convert({**mg, "decoder.layers.1.mlp.linear_fc1.layer_norm_weight":
                     mg["decoder.layers.1.pre_mlp_layernorm.weight"]}), "twice", error=ModelLoadError)
    refused(lambda: hf_to_megatron({**tensors, "backbone.layers.1.mixer.up_proj.bias": torch.zeros(128)}, config),
            "'backbone.layers.1.mixer.up_proj.bias'", "mlp_bias=False", error=ModelLoadError)
    refused(lambda: hf_to_megatron({k: v for k, v in tensors.items() if "k_proj" not in k}, config),
            "'backbone.layers.3.mixer.k_proj.weight'", qkv, error=ModelLoadError)
