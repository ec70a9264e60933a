"""Contract: validation, fingerprint, loading (HF config, YAML), diff and compatibility."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from aligned_mamba.contract import CONTRACTS_DIR, Contract, check_compatible
from aligned_mamba.errors import ContractError, ContractMismatchError
from aligned_mamba.ops.configs import TorchKernelConfigs, TritonKernelConfigs, kernel_configs, pinned_configs


def test_defaults_and_fingerprint_stable() -> None:
    c = Contract(256)
    assert (c.state_dtype, c.backend, c.model_dtype, c.version) == ("float32", "torch", "bfloat16", 3)
    assert c.kernel_configs == TorchKernelConfigs() and c.to_dict()["kernel_configs"] == pinned_configs("torch")
    assert len(c.fingerprint) == 12 and int(c.fingerprint, 16) >= 0
    assert c.fingerprint == Contract(256).fingerprint
    # Key order of kernel_configs does not matter; the canonical JSON sorts it.
    reordered = dict(reversed(list(pinned_configs("torch").items())))
    assert Contract(256, kernel_configs=reordered).fingerprint == c.fingerprint
    assert Contract(256) == c and hash(Contract(256)) == hash(c)


@pytest.mark.parametrize(
    "change",
    [
        {"chunk_size": 128},
        {"backend": "triton"},
        {"model_dtype": "float32"},
        {"kernel_configs": {"row_tile": 32, "linear_row_tile": 16}},
    ],
)
def test_fingerprint_changes_with_each_field(change: dict) -> None:
    base = {"chunk_size": 256}
    assert Contract(**{**base, **change}).fingerprint != Contract(**base).fingerprint


@pytest.mark.parametrize("version", [1, 2, 4])
def test_another_version_is_refused_in_one_line(version: int) -> None:
    """Version 1's norms rounded twice, version 2's rounded the fp32 residual first: a contract of
    another version promises bits this release does not compute, so it is refused rather than
    silently run with other bits."""
    with pytest.raises(ContractError) as e:
        Contract(256, version=version)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"version {version} refused")


def test_bf16_state_refused_one_line() -> None:
    with pytest.raises(ContractError) as e:
        Contract(256, state_dtype="bf16")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("state_dtype 'bfloat16' refused: exact replay needs an fp32 SSM state")


@pytest.mark.parametrize("bad", [0, 8, 100, 2048, True, "256", 256.0])
def test_chunk_size_refused(bad: object) -> None:
    with pytest.raises(ContractError, match="chunk_size"):
        Contract(bad)  # type: ignore[arg-type]


def test_kernel_configs_are_typed_and_refuse_what_no_kernel_implements() -> None:
    c = Contract(256, backend="triton", kernel_configs={"block_k": 64})
    assert isinstance(c.kernel_configs, TritonKernelConfigs) and c.kernel_configs.block_k == 64
    assert c.kernel_configs.row_tile == TritonKernelConfigs().row_tile  # the rest stay pinned
    assert c.fingerprint != Contract(256, backend="triton").fingerprint
    assert isinstance(Contract(256).kernel_configs, TorchKernelConfigs)
    for bad, words in [({"block_k": 48}, "block_k 48 refused: expected a power of two"),
                       ({"bf16_dots": "tf32"}, "bf16_dots 'tf32' refused: the kernels implement 'split2', 'round'"),
                       ({"dot_precision": "tf32"}, "dot_precision 'tf32' refused"),
                       ({"num_warps": 3}, "num_warps 3 refused"),
                       ({"accumulate": "seeded"}, "kernel configs accumulate refused: the triton backend's are")]:
        with pytest.raises(ContractError, match=words) as e:
            Contract(256, backend="triton", kernel_configs=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ContractError, match="kernel configs BLOCK_K refused"):
        Contract(256, kernel_configs={"BLOCK_K": 32})  # the torch backend has no such config
    with pytest.raises(ContractError, match="expected a mapping"):
        Contract(256, backend="triton", kernel_configs=TorchKernelConfigs())
    assert pinned_configs("torch") == {"row_tile": 16, "gemm_form": "lanes", "linear_row_tile": 16}


def test_other_fields_refused() -> None:
    with pytest.raises(ContractError, match="backend 'cuda'"):
        Contract(256, backend="cuda")
    with pytest.raises(ContractError, match="model_dtype 'float16'"):
        Contract(256, model_dtype="fp16")
    with pytest.raises(ContractError, match="row_tile .* refused"):
        Contract(256, kernel_configs={"row_tile": object()})


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", torch.bfloat16, "BF16"])
def test_dtype_spellings(spelling: object) -> None:
    assert Contract(256, model_dtype=spelling).model_dtype == "bfloat16"  # type: ignore[arg-type]
    assert Contract(256, model_dtype="fp32", state_dtype=torch.float32).state_dtype == "float32"  # type: ignore


def test_to_from_dict_roundtrip_and_pickle() -> None:
    c = Contract(128, backend="triton")
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d and d["fingerprint"] == c.fingerprint
    assert Contract.from_dict(d) == c
    assert pickle.loads(pickle.dumps(c)) == c
    with pytest.raises(ContractError, match="fingerprint 'deadbeef0000'"):
        Contract.from_dict({**d, "fingerprint": "deadbeef0000"})
    with pytest.raises(ContractError, match="unknown key"):
        Contract.from_dict({**d, "chunk": 1})


def _write(path, obj) -> None:
    path.write_text(json.dumps(obj))


def test_from_hf_config(tmp_path) -> None:
    _write(tmp_path / "config.json", {"model_type": "mamba2", "chunk_size": 128, "torch_dtype": "bfloat16"})
    c = Contract.from_hf_config(tmp_path)  # a directory holding config.json
    assert (c.chunk_size, c.model_dtype) == (128, "bfloat16")
    assert Contract.from_hf_config(tmp_path / "config.json") == c
    assert Contract.from_hf_config(str(tmp_path / "config.json"), model_dtype="fp32").model_dtype == "float32"

    _write(tmp_path / "new.json", {"dtype": "bfloat16"})  # newer transformers write "dtype"
    c = Contract.from_hf_config(tmp_path / "new.json")
    assert (c.chunk_size, c.model_dtype) == (256, "bfloat16")
    c = Contract.from_hf_config({})  # HF defaults: chunk 256, weights loaded as float32
    assert (c.chunk_size, c.model_dtype) == (256, "float32")
    assert Contract.from_hf_config({"ssm_cfg": {"chunk_size": 64}}).chunk_size == 64


def test_from_hf_config_errors(tmp_path) -> None:
    with pytest.raises(ContractError, match="missing.json") as e:
        Contract.from_hf_config(tmp_path / "missing.json")
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ContractError, match="malformed JSON") as e:
        Contract.from_hf_config(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ContractError, match="chunk_size 100"):
        Contract.from_hf_config({"chunk_size": 100})
    with pytest.raises(ContractError, match="state_dtype 'bfloat16'"):
        Contract.from_hf_config({}, state_dtype="bfloat16")


def test_from_yaml_by_name_and_path(tmp_path) -> None:
    default = Contract.from_yaml("default")
    assert default == Contract(256, model_dtype="bfloat16")
    assert Contract.from_yaml("chunk128") == Contract(128)
    assert Contract.from_yaml(CONTRACTS_DIR / "default.yaml") == default
    assert Contract.from_yaml("default", chunk_size=64).chunk_size == 64
    assert Contract.from_yaml("default", backend="triton").kernel_configs == kernel_configs("triton")
    p = tmp_path / "mine.yaml"
    p.write_text(f"chunk_size: 512\nfingerprint: {Contract(512).fingerprint}\n")
    assert Contract.from_yaml(str(p)) == Contract(512)


def test_from_yaml_errors(tmp_path) -> None:
    with pytest.raises(ContractError, match="no contract named 'nope'.*available: .*chunk128.*default"):
        Contract.from_yaml("nope")
    with pytest.raises(ContractError, match="not found"):
        Contract.from_yaml(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: [256\n")
    with pytest.raises(ContractError, match="malformed YAML") as e:
        Contract.from_yaml(bad)
    assert "\n" not in str(e.value)
    bad.write_text("chunk_size: 256\nchunksize: 128\n")
    with pytest.raises(ContractError, match="unknown key.*chunksize"):
        Contract.from_yaml(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ContractError, match="expected a mapping"):
        Contract.from_yaml(bad)
    with pytest.raises(ContractError, match="unknown key.*colour"):
        Contract.from_yaml("default", colour="red")


def test_diff_and_check_compatible() -> None:
    a = Contract(128)
    b = Contract(256, kernel_configs={"row_tile": 32, "linear_row_tile": 16})
    assert a.diff(a) == []
    assert a.diff(b) == [("chunk_size", 128, 256), ("kernel_configs.row_tile", 16, 32)]
    check_compatible(a, Contract(128))
    with pytest.raises(ContractMismatchError) as e:
        check_compatible(a, b)
    msg = str(e.value)
    assert "\n" not in msg
    assert "chunk_size trainer=128 sampler=256" in msg and "kernel_configs.row_tile trainer=16 sampler=32" in msg
    with pytest.raises(ContractMismatchError, match="backend trainer='torch' sampler='triton'"):
        check_compatible(a, Contract(128, backend="triton"))


def test_str_is_short() -> None:
    s = str(Contract(256))
    assert "256" in s and "torch" in s and Contract(256).fingerprint in s and "\n" not in s
