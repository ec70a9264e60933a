"""The hardware class a process computes on: what, besides the contract, selects a row's bits.

The contract pins every setting the library chooses. The machine chooses the rest: on a CPU, the
instruction set ATen's vectorised kernels and the BLAS (MKL) dispatch to; on a GPU, the chip the
kernels were compiled and tuned for. Two processes whose hardware classes differ may compute
different bits from the same contract, so trainer and sampler compare ``HardwareClass.key``
before any row, and a difference is refused unless the caller allows it
(``check_same_hardware(..., allow=True)``; the CLI's ``--allow-cross-hardware``).

What the key holds, and why (measured with the main job and ``benchmarks/cpu_isa_bits.py`` on an
AMD EPYC, AVX2, torch 2.13.0+cpu: ``benchmarks/README.md``, "Bits and hardware on the CPU"):

- ``isa``, ATen's capability (``torch.backends.cpu.get_cpu_capability()``, lowered by
  ``ATEN_CPU_CAPABILITY``): ``ATEN_CPU_CAPABILITY=default`` changed ATen's own kernels' bits (its
  bf16 GEMM, and the baseline's recurrent decode: 818 -> 819 differing rows), because their
  vectorised loops group operations by the vector width. (The torch backend's exact-replay
  logits kept their bits: its GEMMs are MKL's and its transcendentals IEEE-only.)
- ``mkl_cbwr``, when set: ``MKL_CBWR=COMPATIBLE`` changed every MKL GEMM, fp32 and fp64, and so
  the trainer's logits. Other values (AUTO, AVX2, AVX, SSE4_2) gave the default bits on that CPU,
  but they name a kernel family that lowers the level on a CPU above it, so the value is kept
  as written.
- ``mkl_instructions``, when set: ``MKL_ENABLE_INSTRUCTIONS`` caps MKL's kernel level. On the AMD
  CPU no value (AVX2, AVX, SSE4_2) changed a bit; issue 19 reports ``AVX2`` changing the accuracy
  line's 13th digit on its machine (the one whose baseline differs in 779 rows: an Intel Xeon
  with AVX-512/AMX), so it is in the key.
- ``native_isa``, the CPU's own level from /proc/cpuinfo, when it differs from ``isa``: MKL
  dispatches on the CPU, not on ATen's capability (``ATEN_CPU_CAPABILITY=default`` left every
  MKL GEMM's bits as they were), so an AVX-512 machine run with ``ATEN_CPU_CAPABILITY=avx2`` is
  not an AVX2 machine.
- on a GPU: its name and compute capability ("sm90"): kernels are compiled per capability and
  tuned (tile choices, SM count) per chip.

Not in the key, recorded in ``details``: the CPU model name and vendor (nothing measured here
separates two CPUs of one level; MKL's dispatch on AMD and Intel CPUs of one level is not
measured), intra-op threads (1 and 2 gave the same bits), ``ONEDNN_MAX_CPU_ISA`` (no op here
runs in oneDNN: it changed nothing), and the software (torch, triton, CUDA, driver, MKL, oneDNN
versions): another version is another question than another hardware class, and is not refused.
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
# x86 levels from /proc/cpuinfo flags, highest first, in ATen's names (what its capability says
# on such a CPU); each needs all of its flags. AMX (oneDNN's bf16 GEMMs; no op of the torch
# backend runs in oneDNN) is recorded in details, not a level of its own: nothing showed it.
_X86_LEVELS = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    ("avx2", ("avx2", "fma")),
    ("avx", ("avx",)),
    ("sse4_2", ("sse4_2",)),
)


@dataclass(frozen=True)
class HardwareClass:
    """What a process computes on, as far as it changes bits; compare with ``key``.

    kind: "cpu" or "cuda". name: the CPU model name (/proc/cpuinfo) or the GPU's name.
    CPU fields (None on a GPU): isa (ATen's capability, lower case: "avx2", "avx512", "default"),
    native_isa (the CPU's highest level from its flags; "unknown" off x86 Linux),
    mkl_instructions / mkl_cbwr (the environment overrides as set, None when unset).
    GPU field (None on a CPU): capability ("sm90").
    details: versions and facts recorded for the reader, never compared.
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
        """The class as one short string: "cpu:<isa>[/<native_isa>][+mkl=<MKL_ENABLE_INSTRUCTIONS>]
        [+cbwr=<MKL_CBWR>]" (the native level only where ATen runs below it), e.g. "cpu:avx2",
        "cpu:default/avx2+cbwr=COMPATIBLE", or "cuda:<name>:sm<major><minor>", e.g.
        "cuda:NVIDIA H200:sm90". Equal keys: one hardware class (the module docstring says what is
        in it and why)."""
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
    """The hardware class of ``device`` in this process (None: torch's default device, the CPU
    unless ``torch.set_default_device`` says otherwise; "cuda": the current GPU).

    Read from torch (ATen's capability is fixed when torch starts, so ATEN_CPU_CAPABILITY must be
    set before the process starts), the environment (MKL_ENABLE_INSTRUCTIONS, MKL_CBWR) and
    /proc/cpuinfo. Raises ValueError for a device kind other than cpu or cuda.
    """
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
    """True when ``a`` and ``b`` (each a HardwareClass, its to_dict() or its key) are one class.

    Different classes raise HardwareMismatchError (one line naming both and the override) unless
    ``allow``, which returns False instead. ``names`` label the two sides in the message.
    """
    ka, kb = hardware_key(a), hardware_key(b)
    if ka == kb:
        return True
    if allow:
        return False
    raise HardwareMismatchError(
        f"hardware class mismatch: {names[0]} {ka!r} vs {names[1]} {kb!r} (their kernels may round differently, so "
        "rows are not promised bit-identical); pass allow=True (CLI: --allow-cross-hardware) to compare anyway"
    )
