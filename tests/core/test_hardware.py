"""Hardware classes: what this process computes on, what is in the key, and the refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aligned_mamba.errors import ContractError, HardwareMismatchError
from aligned_mamba.hardware import HardwareClass, _native_isa, check_same_hardware, hardware_class, hardware_key

H200 = HardwareClass("cuda", "NVIDIA H200", capability="sm90")


def _message(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_this_cpu() -> None:
    hw = hardware_class()
    assert hw.kind == "cpu" and hw.name and hw.capability is None
    assert hw.isa == torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    assert hw.key.startswith(f"cpu:{hw.isa}") and hw == hardware_class("cpu") == hardware_class(torch.device("cpu"))
    d = hw.to_dict()
    assert d["key"] == hw.key and d["details"]["torch"] == torch.__version__
    assert HardwareClass.from_dict(json.loads(json.dumps(d))) == hw  # survives the trip between processes


def test_details_are_not_the_class() -> None:
    a = HardwareClass("cpu", "AMD EPYC", isa="avx2", native_isa="avx2", details={"torch": "2.13.0"})
    b = HardwareClass("cpu", "AMD EPYC 9654", isa="avx2", native_isa="avx2", details={"torch": "2.11.0"})
    assert a.key == b.key == "cpu:avx2" and check_same_hardware(a, b)
    assert a == HardwareClass("cpu", "AMD EPYC", isa="avx2", native_isa="avx2")  # details not compared


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"isa": "avx512", "native_isa": "avx512"}, "cpu:avx512"),
        ({"isa": "avx2", "native_isa": "avx512"}, "cpu:avx2/avx512"),  # MKL still runs its AVX-512 kernels
        ({"isa": "default", "native_isa": "avx2"}, "cpu:default/avx2"),  # ATen lowered, MKL not
        ({"isa": "avx2", "native_isa": "unknown"}, "cpu:avx2"),
        ({"isa": "avx2", "native_isa": "avx2", "mkl_instructions": "SSE4_2"}, "cpu:avx2+mkl=SSE4_2"),
        ({"isa": "avx2", "native_isa": "avx2", "mkl_cbwr": "COMPATIBLE"}, "cpu:avx2+cbwr=COMPATIBLE"),
    ],
)
def test_cpu_keys(fields: dict[str, str], key: str) -> None:
    hw = HardwareClass("cpu", "some cpu", **fields)
    assert hw.key == key and str(hw) == key and hardware_key(hw.to_dict()) == key


def test_gpu_key() -> None:
    assert H200.key == "cuda:NVIDIA H200:sm90"
    assert HardwareClass("cuda", "NVIDIA H100 80GB HBM3", capability="sm90").key != H200.key  # same sm, other chip


def test_mkl_environment_enters_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    plain = hardware_class()
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    cbwr = hardware_class()
    assert cbwr.mkl_cbwr == "COMPATIBLE" and cbwr.key == plain.key + "+cbwr=COMPATIBLE"
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    assert hardware_class().key == plain.key + "+mkl=SSE4_2+cbwr=COMPATIBLE"
    with pytest.raises(HardwareMismatchError):
        check_same_hardware(plain, cbwr)


@pytest.mark.skipif(not (sys.platform == "linux" and torch.backends.cpu.get_cpu_capability() != "DEFAULT"),
                    reason="needs a vectorised ATen to lower")
def test_aten_capability_override_enters_the_key() -> None:
    # ATen reads ATEN_CPU_CAPABILITY once, when torch starts: only a new process shows it
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = "from aligned_mamba.hardware import hardware_class; print(hardware_class().key)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lowered = out.stdout.strip()
    assert lowered.startswith("cpu:default/") and lowered != hardware_class().key


def test_native_isa_from_flags() -> None:
    avx2 = {"sse4_2", "avx", "avx2", "fma"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert _native_isa(avx2) == "avx2" and _native_isa(avx512) == "avx512"
    assert _native_isa(avx512 | {"amx_tile", "amx_bf16"}) == "avx512"  # AMX: in details, not a level
    assert _native_isa(avx512 - {"avx512vl"}) == "avx2"  # ATen's AVX-512 needs all four
    assert _native_isa({"avx", "avx2"}) == "avx" and _native_isa(set()) == "unknown"


def test_mismatch_message_and_override() -> None:
    cpu = HardwareClass("cpu", "x", isa="avx2", native_isa="avx2")
    with pytest.raises(HardwareMismatchError) as e:
        check_same_hardware(cpu, H200)
    msg = _message(e)
    assert "trainer 'cpu:avx2' vs sampler 'cuda:NVIDIA H200:sm90'" in msg
    assert "allow=True" in msg and "--allow-cross-hardware" in msg
    assert isinstance(e.value, ContractError)  # refused like a contract mismatch: exit status 2
    assert check_same_hardware(cpu, H200, allow=True) is False
    assert check_same_hardware(cpu, cpu.key) is True and check_same_hardware(H200.to_dict(), H200) is True
    with pytest.raises(HardwareMismatchError, match="worker0 'cpu:avx2' vs worker1"):
        check_same_hardware(cpu, H200, names=("worker0", "worker1"))


def test_refusals() -> None:
    with pytest.raises(ValueError) as e:
        HardwareClass("tpu", "x")
    assert "hardware kind 'tpu' refused" in _message(e)
    with pytest.raises(ValueError) as e:
        hardware_class("meta")
    assert "device 'meta' refused" in _message(e)
    with pytest.raises(ValueError) as e:
        HardwareClass.from_dict({**H200.to_dict(), "key": "cuda:NVIDIA H100:sm90"})
    assert "does not match its fields" in _message(e)
    with pytest.raises(ValueError, match="unknown key"):
        HardwareClass.from_dict({"kind": "cpu", "name": "x", "cores": 2})
    with pytest.raises(TypeError, match="expected a HardwareClass"):
        check_same_hardware(3, H200)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_this_gpu() -> None:
    hw = hardware_class("cuda")
    major, minor = torch.cuda.get_device_capability()
    assert hw.kind == "cuda" and hw.capability == f"sm{major}{minor}" and hw.name == torch.cuda.get_device_name()
    assert hw.key == f"cuda:{hw.name}:sm{major}{minor}" and hw.details["sm_count"] > 0
    assert hardware_class("cuda:0") == hw
