"""The hardware class a process computes on: what, besides the contract, selects a row's bits.

Trainer and sampler compare ``HardwareClass.key`` before any row; a difference is refused unless
allowed (``check_same_hardware(..., allow=True)``, the CLI's ``--allow-cross-hardware``). What the key
holds and why: docs/design.md, "How the bits are kept"; the measurements: benchmarks/README.md, "Bits
and hardware on the CPU".
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

from .errors import HardwareMismatchError

KINDS = ("cpu", "cuda")
# x86 levels from /proc/cpuinfo flags, highest first, in ATen's names; a level needs all its flags.
# AMX is only recorded in details: no op here runs in oneDNN.
_X86_LEVELS = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    ("avx2", ("avx2", "fma")),
    ("avx", ("avx",)),
    ("sse4_2", ("sse4_2",)),
)


@dataclass(frozen=True)
class HardwareClass:
    """What a process computes on, as far as it changes bits; compare with ``key``.

    kind: "cpu" or "cuda"; name: the CPU model or GPU name. CPU only: isa (ATen's capability: "avx2",
    "avx512", "default"), native_isa (highest level of the CPU's flags; "unknown" off x86 Linux),
    mkl_instructions / mkl_cbwr (the environment overrides, None when unset). GPU only: capability
    ("sm90"). details: versions and facts for the reader, never compared.
    """

    kind: str
    name: str
    isa: str | None = None
    native_isa: str | None = None
    mkl_instructions: str | None = None
    mkl_cbwr: str | None = None
    capability: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"hardware kind {self.kind!r} refused: expected one of {', '.join(KINDS)}")

    @property
    def key(self) -> str:
        """The class as one string, e.g. "cpu:avx2", "cpu:default/avx2+cbwr=COMPATIBLE" (native level
        only where ATen runs below it), "cuda:NVIDIA H200:sm90". Equal keys: one hardware class."""
        if self.kind == "cuda":
            return f"cuda:{self.name}:{self.capability}"
        key = f"cpu:{self.isa}"
        if self.native_isa not in (None, "unknown", self.isa):
            key += f"/{self.native_isa}"  # ATen lowered below what MKL still dispatches to
        if self.mkl_instructions is not None:
            key += f"+mkl={self.mkl_instructions}"
        if self.mkl_cbwr is not None:
            key += f"+cbwr={self.mkl_cbwr}"
        return key

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, details included, plus "key"."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["details"] = dict(self.details)
        d["key"] = self.key
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareClass:
        """Inverse of ``to_dict``; a "key" entry, if present, must match the fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"key"})
        if unknown:
            raise ValueError(f"hardware class dict: unknown key(s) {', '.join(unknown)}")
        hw = cls(**{k: v for k, v in d.items() if k in names})
        if "key" in d and d["key"] != hw.key:
            raise ValueError(f"hardware class dict: key {d['key']!r} does not match its fields ({hw.key!r})")
        return hw

    def __str__(self) -> str:
        return self.key


def _cpuinfo() -> dict[str, str]:
    """The first processor's "key: value" lines of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break  # the first processor's block is enough: the class is per machine
                    continue
                k, _, v = line.partition(":")
                out.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return out


def _native_isa(flags: set[str]) -> str:
    for level, needs in _X86_LEVELS:
        if all(f in flags for f in needs):
            return level
    return "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _build_versions() -> dict[str, str | None]:
    """MKL and oneDNN versions as torch's build reports them."""
    show = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", show)
    dnn = re.search(r"MKL-DNN v([\w.\-]+)", show)
    return {"mkl": mkl.group(1) if mkl else None, "onednn": dnn.group(1) if dnn else None}


def _nvidia_driver() -> str | None:
    """The kernel driver's version (e.g. "570.124.06"), None where /proc does not say."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def hardware_class(device: torch.device | str | None = None) -> HardwareClass:
    """The hardware class of ``device`` in this process (None: torch's default device; "cuda": the
    current GPU). ATEN_CPU_CAPABILITY counts only if set before the process starts. Raises ValueError
    for a device other than cpu or cuda."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    details: dict[str, Any] = {"torch": torch.__version__, "triton": _version("triton")}
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        details |= {"cuda": torch.version.cuda, "driver": _nvidia_driver(), "sm_count": props.multi_processor_count,
                    "memory_bytes": props.total_memory, "device_index": index}
        return HardwareClass("cuda", props.name, capability=f"sm{props.major}{props.minor}", details=details)
    if dev.type != "cpu":
        raise ValueError(f"device {str(dev)!r} refused: hardware classes are defined for cpu and cuda")
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    isa = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "_")
    details |= _build_versions() | {
        "vendor": info.get("vendor_id"),
        "amx": "amx_bf16" in flags,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "aten_cpu_capability_env": _env("ATEN_CPU_CAPABILITY"),
    }
    return HardwareClass(
        "cpu",
        info.get("model name") or platform.processor() or platform.machine() or "unknown",
        isa=isa,
        native_isa=_native_isa(flags) if flags else "unknown",
        mkl_instructions=_env("MKL_ENABLE_INSTRUCTIONS"),
        mkl_cbwr=_env("MKL_CBWR"),
        details=details,
    )


HardwareLike = HardwareClass | Mapping[str, Any] | str


def hardware_key(hw: HardwareLike) -> str:
    """A HardwareClass, its to_dict() or its key, as the key."""
    if isinstance(hw, HardwareClass):
        return hw.key
    if isinstance(hw, Mapping):
        return HardwareClass.from_dict(hw).key
    if isinstance(hw, str):
        return hw
    raise TypeError(f"expected a HardwareClass, its to_dict() or its key, got {type(hw).__name__}")


def check_same_hardware(a: HardwareLike, b: HardwareLike, *, allow: bool = False,
                        names: tuple[str, str] = ("trainer", "sampler")) -> bool:
    """True when ``a`` and ``b`` (HardwareClass, its to_dict() or key) are one class; otherwise raise
    HardwareMismatchError, or return False under ``allow``. ``names`` label the sides in the message."""
    ka, kb = hardware_key(a), hardware_key(b)
    if ka == kb:
        return True
    if allow:
        return False
    raise HardwareMismatchError(
        f"hardware class mismatch: {names[0]} {ka!r} vs {names[1]} {kb!r} (their kernels may round differently, so "
        "rows are not promised bit-identical); pass allow=True (CLI: --allow-cross-hardware) to compare anyway"
    )
