"""The Megatron-Core hook (``--aligned-mamba``): Megatron's MambaModel gives the reference engine's
logits bit for bit, trains, and refuses what it cannot align.

The Megatron side is a real megatron-core 0.16 MambaModel (non-TE spec) on the CPU, built with the
CPU shims of ``trainer_hooks.megatron.cpu``; the reference side is the core's model on the same weights.
"Hook off" is Megatron's stock forward with torch stand-ins for mamba_ssm's kernels (see
trainer_hooks.megatron.cpu): it must differ, so these equality tests can fail.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from fp64_reference import GRAD_RTOL, reference_logits_fp64, rel_err  # noqa: E402
from torch_threads import single_thread_by_default  # noqa: E402, F401 (autouse fixture)

from aligned_mamba import Contract, ContractMismatchError  # noqa: E402
from aligned_mamba.errors import AlignedMambaError  # noqa: E402
from aligned_mamba.layers.mamba2 import Mamba2Mixer  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint  # noqa: E402
from aligned_mamba.ops.logprobs import log_softmax  # noqa: E402
from aligned_mamba.ops.ssd import SSMParams, ssd_naive  # noqa: E402
from trainer_hooks import megatron as hk  # noqa: E402
from trainer_hooks.megatron import trainer as mc  # noqa: E402
from trainer_hooks.megatron.weights import megatron_to_hf  # noqa: E402

SMALL = dict(hidden_size=64, num_heads=4, head_dim=32, state_size=16, num_hidden_layers=2, vocab_size=96,
             conv_kernel=4, chunk_size=16)
SHAPES = {
    "bf16_groups2": dict(SMALL, n_groups=2, dtype="bfloat16"),
    "fp32": dict(SMALL, dtype="float32"),
    "bf16_tied_bf16residual_chunk32": dict(SMALL, chunk_size=32, tie_word_embeddings=True, residual_in_fp32=False,
                                           dtype="bfloat16"),
    "default_tiny": dict(dtype="bfloat16"),  # the embedded default: 3 layers, state 128, chunk 256
}
LENGTHS = {"default_tiny": (300, 45, 1)}


@pytest.fixture(scope="module", autouse=True)
def megatron_process() -> None:
    mc.prepare_process()


@pytest.fixture(autouse=True)
def no_hook_left() -> Iterator[None]:
    yield
    if hk.installed() is not None:
        hk.installed().uninstall()


def score(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One packed forward of a built Megatron model -> per sequence [len_i, vocab] logits."""
    return list(torch.split(mc.megatron_packed_logits(model, seqs), [int(s.numel()) for s in seqs]))


def tiny(name: str):
    kw = dict(SHAPES[name])
    dtype = kw.pop("dtype")
    config, tensors = make_tiny(0, dtype=dtype, **kw)
    return config, tensors, Contract(chunk_size=config.chunk_size, model_dtype=dtype)


def sequences(vocab: int, lengths: tuple[int, ...] = (40, 17, 5, 1), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def megatron_model(config, tensors, contract: Contract | None, *, chunk_size: int | None = None):
    """Hook on (contract given: installed before building) or off (stock forward, stand-in kernels)."""
    if contract is not None:
        hk.install(contract)
    model = mc.build_mamba_model(config, contract.model_dtype if contract else config.dtype, chunk_size=chunk_size)
    mc.load_hf_weights(model, config, tensors)
    return model


def differing_rows(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int(not torch.equal(x[i], y[i])) for x, y in zip(a, b) for i in range(x.shape[0]))


# -- bits ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_megatron_logits_equal_reference_engine(name: str) -> None:
    config, tensors, contract = tiny(name)
    seqs = sequences(config.vocab_size, LENGTHS.get(name, (40, 17, 5, 1)))
    ref = build_model(config, tensors, contract).forward(seqs)
    model = megatron_model(config, tensors, contract)
    model.eval()
    with torch.no_grad():
        got = score(model, seqs)
    assert got[0].dtype == ref[0].dtype
    assert differing_rows(got, ref) == 0
    # the training forward (train mode, autograd recording) gives the same bits
    model.train()
    train_logits = mc.megatron_packed_logits(model, seqs)
    assert torch.equal(train_logits.detach(), torch.cat(ref))
    # an unpacked [s, b] batch: each row of the batch is its own sequence, anchored at its start
    same_len = [seqs[0], sequences(config.vocab_size, (seqs[0].numel(),), seed=1)[0]]
    with torch.no_grad():
        batch_logits = model(torch.stack(same_len), None, attention_mask=None)
    ref2 = build_model(config, tensors, contract).forward(same_len)
    assert torch.equal(batch_logits, torch.stack(ref2))


@pytest.mark.parametrize("chunk", [None, 16])
def test_hook_off_stock_forward_differs(chunk: int | None) -> None:
    """Megatron's stock arrangement (gate inside the scan, its chunk grid, torch norms and GEMMs) gives other
    bits, at its default chunk 128 and even at the contract's chunk; numerically it is the same model."""
    config, tensors, contract = tiny("bf16_groups2")
    seqs = sequences(config.vocab_size)
    ref = build_model(config, tensors, contract).forward(seqs)
    model = megatron_model(config, tensors, None, chunk_size=chunk)
    model.eval()
    with torch.no_grad():
        got = score(model, seqs)
    rows = sum(x.shape[0] for x in ref)
    assert differing_rows(got, ref) > rows // 2
    scale = max(float(x.float().abs().max()) for x in ref)
    assert max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, ref)) < 0.05 * scale


def test_stock_stand_in_scan_is_right() -> None:
    """The hook-off stand-in is mamba_ssm's math (global chunk grid + seq_idx resets), not a strawman."""
    from trainer_hooks.megatron.cpu import _stock_scan

    g = torch.Generator().manual_seed(0)
    lens, H, P, G, N = [40, 17, 5], 4, 8, 2, 16
    T = sum(lens)
    x, dt = torch.randn(T, H, P, generator=g), torch.rand(T, H, generator=g) * 3 - 2
    A, D, db = -torch.exp(torch.rand(H, generator=g) * 2.7), torch.randn(H, generator=g), torch.randn(H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    ref, _ = ssd_naive(x, dt, B, C, SSMParams(A, D, db), torch.tensor([0, 40, 57, 62]))
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))[None]
    y = _stock_scan(x[None], torch.nn.functional.softplus(dt + db)[None], A, B[None], C[None], 16, D, seq)[0]
    assert rel_err(y, ref) < 1e-5


def test_stock_stand_ins_refuse_what_they_do_not_cover() -> None:
    """Arguments beyond what Megatron's forward passes (states in or out, a dt limit) are refused by name."""
    from trainer_hooks.megatron.cpu import stock_chunk_scan_combined, stock_split_conv1d_scan_combined

    x, dt, A = torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2), -torch.ones(2)
    B = C = torch.zeros(1, 8, 1, 4)
    with pytest.raises(ValueError, match="mamba_chunk_scan_combined does not cover initial_states, dt_limit"):
        stock_chunk_scan_combined(x, dt, A, B, C, 4, initial_states=torch.zeros(1, 2, 4, 4), dt_limit=(0.0, 1.0))
    with pytest.raises(ValueError, match="mamba_split_conv1d_scan_combined does not cover return_final_states"):
        stock_split_conv1d_scan_combined(torch.zeros(1, 8, 26), torch.zeros(16, 4), None, torch.zeros(2), A,
                                         torch.zeros(2), 4, return_final_states=True, headdim=4)


# -- gradients and training ----------------------------------------------------------------------------


def test_megatron_gradients_match_fp64_reference() -> None:
    config, tensors, contract = tiny("fp32")
    seqs = sequences(config.vocab_size, (40, 17, 5))
    targets = sequences(config.vocab_size, (40, 17, 5), seed=9)
    model = megatron_model(config, tensors, contract)
    model.train()
    logits = torch.split(mc.megatron_packed_logits(model, seqs), [s.numel() for s in seqs])
    loss = -sum(log_softmax(lg).gather(-1, t[:, None]).sum() for lg, t in zip(logits, targets))
    loss.backward()
    grads = megatron_to_hf({n: p.grad for n, p in model.named_parameters()}, config)

    ref = {k: v.double().requires_grad_() for k, v in tensors.items()}
    ref_logits = [reference_logits_fp64(config, ref, s) for s in seqs]
    ref_loss = -sum(torch.log_softmax(lg, -1).gather(-1, t[:, None]).sum() for lg, t in zip(ref_logits, targets))
    ref_loss.backward()
    assert math.isclose(float(loss.detach()), float(ref_loss.detach()), rel_tol=1e-5)
    errs = {k: rel_err(grads[k], ref[k].grad) for k in tensors}
    assert all(e < GRAD_RTOL for e in errs.values()), {k: e for k, e in errs.items() if e >= GRAD_RTOL}


def test_training_run_lowers_loss_and_stays_aligned() -> None:
    """A short Adam run through the hooked Megatron model on the CPU (packed THD batches, fp32 params):
    the loss falls, and the trained weights, exported to the HF layout, give the reference engine the
    trainer's logits bit for bit."""
    config, tensors, contract = tiny("fp32")
    model = megatron_model(config, tensors, contract)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    # a learnable stream: each sequence counts up modulo the vocabulary from a random start
    starts = sequences(config.vocab_size, (1, 1, 1, 1), seed=5)
    seqs = [(s + torch.arange(n)) % config.vocab_size for s, n in zip(starts, (37, 20, 9, 50))]
    losses = []
    for _ in range(12):
        opt.zero_grad()
        logits = torch.split(mc.megatron_packed_logits(model, seqs), [s.numel() for s in seqs])
        loss = -sum(log_softmax(lg[:-1]).gather(-1, s[1:, None]).sum() for lg, s in zip(logits, seqs))
        loss = loss / sum(s.numel() - 1 for s in seqs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    exported = {k: v.detach() for k, v in megatron_to_hf(model.state_dict(), config).items()}
    model.eval()
    with torch.no_grad():
        got = score(model, seqs)
    assert differing_rows(got, build_model(config, exported, contract).forward(seqs)) == 0


def test_layers_of_one_forward_share_its_batch(monkeypatch) -> None:
    """Every mixer of a forward gets the same ``Step`` (so the Triton backend plans the step once per
    forward, not once per layer); a forward over the same lengths reuses it, one over other lengths
    gets its own."""
    config, tensors, contract = tiny("fp32")
    model = megatron_model(config, tensors, contract)
    model.eval()
    seen = []
    real = Mamba2Mixer.advance

    def spy(self, state, batch, *args, **kwargs):
        seen.append(batch)
        return real(self, state, batch, *args, **kwargs)

    monkeypatch.setattr(Mamba2Mixer, "advance", spy)
    with torch.no_grad():
        for lengths in ((40, 17), (40, 17), (9,)):
            score(model, sequences(config.vocab_size, lengths))
    n = config.num_hidden_layers
    assert len(seen) == 3 * n and n > 1
    assert all(b is seen[0] for b in seen[:2 * n])
    assert all(b is seen[2 * n] for b in seen[2 * n:]) and seen[2 * n] is not seen[0]
    assert seen[2 * n].lengths.tolist() == [9]


# -- refusals ------------------------------------------------------------------------------------------


def test_chunk_size_from_the_contract_and_mismatch_refused() -> None:
    config, tensors, contract = tiny("bf16_groups2")
    hook = hk.install(contract)
    model = mc.build_mamba_model(config, "bfloat16")
    assert all(layer.mixer.chunk_size == 16 for layer in model.decoder.layers)
    with pytest.raises(hk.AlignmentRefused, match=r"chunk_size=128.*chunk_size=16"):
        mc.build_mamba_model(config, "bfloat16", chunk_size=128)
    hook.uninstall()
    stock = mc.build_mamba_model(config, "bfloat16")  # Megatron's default chunk, 128
    with pytest.raises(hk.AlignmentRefused, match=r"chunk_size=128 but the contract says chunk_size=16"):
        hk.install(contract).apply_to_model(stock)


def test_aligned_spec_places_the_aligned_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """``aligned_mamba_stack_spec``: AlignedRMSNorm in every norm slot (no torch RMSNorm left for the hook to
    swap), the contract's chunk size, the local spec's parameter names, and the hooked local spec's logits bit
    for bit (``test_hook_off_stock_forward_differs``: the stock forward gives others). Under another contract
    its mixers are refused, naming both chunk sizes."""
    config, tensors, contract = tiny("bf16_groups2")
    seqs = sequences(config.vocab_size)
    local = megatron_model(config, tensors, contract)
    monkeypatch.setattr(mc, "local_mamba_stack_spec",
                        lambda eps, **kw: hk.aligned_mamba_stack_spec(contract, eps, **kw))
    aligned = megatron_model(config, tensors, contract)
    assert not any(isinstance(m, torch.nn.RMSNorm) for m in aligned.modules())
    assert all(type(layer.norm) is hk.AlignedRMSNorm and layer.mixer.chunk_size == contract.chunk_size
               for layer in aligned.decoder.layers)
    assert aligned.state_dict().keys() == local.state_dict().keys()
    with torch.no_grad():
        assert differing_rows(score(aligned, seqs), score(local, seqs)) == 0
    hk.installed().uninstall()
    hk.install(Contract(chunk_size=32, model_dtype="bfloat16"))
    with pytest.raises(hk.AlignmentRefused, match=r"chunk_size=16 but the contract says chunk_size=32"):
        mc.build_mamba_model(config, "bfloat16")


def test_contract_mismatch_refused_before_any_comparison(tmp_path) -> None:
    from aligned_mamba.check import run_check
    from aligned_mamba.integrations import EngineSpec

    config, tensors, contract = tiny("bf16_groups2")
    trainer = mc.make_trainer(config=config, tensors=tensors, contract=contract)
    other = Contract(chunk_size=32, model_dtype="bfloat16")
    spec = EngineSpec(model="tiny", contract=other.to_dict(), dtype="bfloat16")
    with pytest.raises(ContractMismatchError, match=r"chunk_size trainer=16 sampler=32"):
        run_check(trainer, "reference", spec, reference=build_model(config, tensors, contract), prompt_len=8,
                  gen_len=4, requests=1, max_batch_tokens=None, seed=0)
    with pytest.raises(hk.AlignmentRefused, match=r"contract.*chunk=16.*chunk=32"):
        hk.install(other)


def test_uncovered_modules_refused() -> None:
    from megatron.core.transformer.identity_op import IdentityOp

    config, tensors, contract = tiny("bf16_groups2")
    hook = hk.install(contract)
    model = mc.build_mamba_model(config, "bfloat16")
    model.decoder.layers[0].norm = IdentityOp()  # what a TE spec has: the norm fused into in_proj
    with pytest.raises(hk.AlignmentRefused, match=r"decoder.layers.0.*IdentityOp"):
        hook.apply_to_model(model)

    class TELayerNormColumnParallelLinear(torch.nn.Module):  # stands in for a TE layer the hook was not taught
        weight = None
        bias = None

    model = mc.build_mamba_model(config, "bfloat16")
    model.decoder.layers[1].mixer.in_proj = TELayerNormColumnParallelLinear()
    with pytest.raises(hk.AlignmentRefused, match=r"TELayerNormColumnParallelLinear"):
        hook.apply_to_model(model)
    model = mc.build_mamba_model(config, "bfloat16")
    model.decoder.extra = torch.nn.GELU()
    with pytest.raises(hk.AlignmentRefused, match=r"decoder.extra .*GELU.* is not covered"):
        hook.apply_to_model(model)


def test_settings_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    config, tensors, contract = tiny("bf16_groups2")
    hook = hk.install(contract)
    with pytest.raises(hk.AlignmentRefused, match=r"params_dtype float32 \(contract model_dtype bfloat16\)"):
        mc.build_mamba_model(config, "float32")
    tc = mc.megatron_transformer_config(config, "bfloat16")
    tc.hidden_dropout = 0.1
    with pytest.raises(hk.AlignmentRefused, match=r"hidden dropout 0.1"):
        hk.apply_from_config(tc, contract)
    model = megatron_model(config, tensors, contract)
    ids = sequences(config.vocab_size, (8,))[0][None]
    with pytest.raises(hk.AlignmentRefused, match=r"inference context"):
        model.eval()
        model.decoder.layers[0].mixer(torch.zeros(8, 1, config.hidden_size, dtype=torch.bfloat16),
                                      inference_context=object())
    with pytest.raises(hk.AlignmentRefused, match=r"without z"):
        model.decoder.layers[0].mixer.norm(torch.zeros(2, config.intermediate_size))
    from megatron.core.ssm import mamba_mixer

    with pytest.raises(hk.AlignmentRefused, match=r"stock kernel mamba_split_conv1d_scan_combined"):
        mamba_mixer.mamba_split_conv1d_scan_combined(None)
    hook.uninstall()
    # the triton backend trains too (tests/ops/test_triton_backward.py); without a GPU or the interpreter
    # it is refused when the forward first needs it, in one line
    triton = Contract(chunk_size=16, model_dtype="bfloat16", backend="triton")
    model = megatron_model(config, tensors, triton)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AlignedMambaError, match=r"backend 'triton' needs a CUDA device"):
        model(ids, None, attention_mask=None)


def test_flags_and_apply_from_args() -> None:
    parser = hk.add_arguments(argparse.ArgumentParser())
    assert hk.apply_from_args(parser.parse_args([])) is None
    args = parser.parse_args(["--aligned-mamba", "--aligned-mamba-contract", "chunk128"])
    args.bf16 = True
    hook = hk.apply_from_args(args)
    assert hook is hk.installed() and hook.contract.chunk_size == 128
    hook.uninstall()
    args.tensor_model_parallel_size, args.transformer_impl = 2, "transformer_engine"
    with pytest.raises(hk.AlignmentRefused, match=r"tensor model parallel size 2.*transformer_engine"):
        hk.apply_from_args(args)
    assert hk.installed() is None


# -- the check command -----------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["on", "off"])
def test_cli_check_trainer_megatron(tmp_path, monkeypatch, hook: str) -> None:
    """The command end to end; with ALIGNED_MAMBA_MEGATRON_HOOK=off (Megatron's stock forward) it must fail."""
    from aligned_mamba.cli import main

    monkeypatch.setenv("ALIGNED_MAMBA_MEGATRON_HOOK", hook)
    # float32: at these sizes bf16 logits round the baseline's differences away (check exits 4, no control)
    config, tensors = make_tiny(0, dtype="float32", **dict(SMALL, n_groups=2))
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    out = tmp_path / "result.json"
    code = main(["check", "--model", str(tmp_path / "ckpt"), "--trainer", "megatron", "--backend", "torch",
                 "--prompt-len", "40", "--gen-len", "24", "--requests", "2", "--jobs", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["trainer"] == "megatron"
    exact = [case for case in result["cases"] if case["exact_replay"]]
    assert len(exact) == 4 and all(case["rows"] > 0 for case in exact)
    if hook == "on":
        assert code == 0 and result["ok"] and all(case["mismatched_rows"] == 0 for case in exact)
    else:
        assert code == 1 and not result["ok"] and all(case["mismatched_rows"] > 0 for case in exact)


@pytest.mark.engines("own")
@pytest.mark.parametrize("name", ["bf16_groups2", "fp32"])
def test_cli_check_trainer_megatron_engine_vllm(tmp_path, name: str) -> None:
    """Both integrations at once: Megatron (hook on) scores, real vLLM engines sample (plugin on for
    the exact-replay cases, stock vLLM for the baseline): 0 differing rows in every exact-replay case,
    and the stock baseline differs."""
    pytest.importorskip("vllm", reason="the vllm engine needs vllm (extra 'vllm')")
    from aligned_mamba.cli import main

    kw = dict(SHAPES[name])
    config, tensors = make_tiny(0, dtype=kw.pop("dtype"), **kw)
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    out = tmp_path / "result.json"
    code = main(["check", "--model", str(tmp_path / "ckpt"), "--trainer", "megatron", "--engine", "vllm",
                 "--backend", "torch", "--prompt-len", "45", "--gen-len", "20", "--requests", "2", "--jobs", "2",
                 "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["trainer"] == "megatron" and result["engine"] == "vllm"
    exact = [case for case in result["cases"] if case["exact_replay"]]
    assert len(exact) == 4 and all(case["rows"] > 0 for case in exact)
    assert code == 0 and result["ok"] and all(case["mismatched_rows"] == 0 for case in exact)
    base = next(case for case in result["cases"] if not case["exact_replay"])
    assert base["mismatched_rows"] > 0
