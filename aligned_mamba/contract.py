"""The alignment contract: the settings trainer and sampler must share for bit-identical logits.

Chunk size, SSM state dtype, backend, model dtype and pinned kernel configs all change a row's
bits, so both sides must agree on every one. The contract's fingerprint travels with results, so
a mismatch is refused before a single logit is compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ContractError, ContractMismatchError
from .ops.configs import BACKENDS, TRITON_MAX_SLICES, KernelConfigs, kernel_configs

# 3: the RMSNorms normalise the residual as it is kept (fp32 unrounded); 2 rounded it to the model dtype
# first; 2 and 3: the norms round once (weight times the fp32 normalised value), 1 rounded twice
CONTRACT_VERSION = 3
# a wheel ships the contracts inside the package; a source checkout keeps them in configs/contracts
_PACKAGED = Path(__file__).resolve().parent / "contracts"
CONTRACTS_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[1] / "configs" / "contracts"
MODEL_DTYPES = ("bfloat16", "float32")
HF_DEFAULT_CHUNK_SIZE = 256  # transformers' Mamba2Config default

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp64": "float64",
    "double": "float64",
    "float64": "float64",
}


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """'bf16', 'torch.bfloat16', torch.bfloat16 -> 'bfloat16' (unknown names are returned lower-cased)."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class Contract:
    """What trainer and sampler must share. Compare with ``==`` or ``diff``; hash by fingerprint.

    ``kernel_configs``: the backend's typed, frozen configs (``ops.configs``), what its launches
    use; given as a mapping, its fields replace the pinned defaults (unknown names and values no
    kernel implements are refused).

    ``row_parallel_slices`` (S, a power of two): every row-parallel GEMM (out_proj, o_proj, the MLP's
    down projection) reduces K in S contiguous slices summed by a fixed pairwise tree, and Mamba2's
    gated norm sums each group's squares in S slices the same way (``aligned_mamba.parallel``), so
    tensor-parallel degrees 1, 2, 4 ... S give the same bits. 1 is the plain linear layer (and is
    left out of the fingerprint, so contracts written before the field keep their digests).
    """

    chunk_size: int
    state_dtype: str = "float32"
    backend: str = "torch"
    model_dtype: str = "bfloat16"
    kernel_configs: KernelConfigs | Mapping[str, Any] | None = None
    version: int = CONTRACT_VERSION
    row_parallel_slices: int = 1

    def __post_init__(self) -> None:
        cs = self.chunk_size
        # bool is an int subclass; True must not pass as chunk size 1.
        if not isinstance(cs, int) or isinstance(cs, bool) or cs < 16 or cs > 1024 or cs & (cs - 1):
            raise ContractError(
                f"chunk_size {cs!r} refused: must be a power of two from 16 to 1024 (kernels tile rows by 16)"
            )
        state = normalize_dtype(self.state_dtype)
        if state != "float32":
            raise ContractError(
                f"state_dtype {state!r} refused: exact replay needs an fp32 SSM state "
                "(a rounded state changes every token after the next chunk boundary)"
            )
        if self.backend not in BACKENDS:
            raise ContractError(f"backend {self.backend!r} refused: expected one of {', '.join(BACKENDS)}")
        model = normalize_dtype(self.model_dtype)
        if model not in MODEL_DTYPES:
            raise ContractError(f"model_dtype {model!r} refused: expected one of {', '.join(MODEL_DTYPES)}")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise ContractError(f"version {self.version!r} refused: expected a positive int")
        if self.version != CONTRACT_VERSION:
            raise ContractError(f"version {self.version} refused: this release computes version {CONTRACT_VERSION}'s "
                                "bits (version 3's norms take the fp32 residual unrounded; both sides must run one "
                                "version)")
        s = self.row_parallel_slices
        if not isinstance(s, int) or isinstance(s, bool) or s < 1 or s > 1024 or s & (s - 1):
            raise ContractError(f"row_parallel_slices {s!r} refused: must be a power of two from 1 to 1024 "
                                "(the partial sums are joined by a pairwise tree)")
        if s > TRITON_MAX_SLICES and self.backend == "triton":
            raise ContractError(f"row_parallel_slices {s} refused on the triton backend: its tree GEMM sums at "
                                f"most {TRITON_MAX_SLICES} slices in one launch (TP 1 runs them all)")
        try:
            configs = kernel_configs(self.backend, self.kernel_configs)
        except (TypeError, ValueError) as e:
            raise ContractError(f"kernel_configs: {e}") from None
        object.__setattr__(self, "state_dtype", state)
        object.__setattr__(self, "model_dtype", model)
        object.__setattr__(self, "kernel_configs", configs)

    def _fields(self) -> dict[str, Any]:
        """Every field as JSON-ready values (the kernel configs as a dict of their fields)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["kernel_configs"] = dataclasses.asdict(self.kernel_configs)
        if self.row_parallel_slices == 1:  # the plain linear layer: the digests of older contracts stay
            del out["row_parallel_slices"]
        return out

    @property
    def fingerprint(self) -> str:
        """12 hex chars of sha256 over the canonical (sorted-key, compact) JSON of all fields."""
        canon = json.dumps(self._fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:12]

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __str__(self) -> str:
        return (
            f"contract v{self.version} {self.backend} chunk={self.chunk_size} state={self.state_dtype} "
            f"model={self.model_dtype}{f' slices={self.row_parallel_slices}' if self.row_parallel_slices > 1 else ''} "
            f"fp={self.fingerprint}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of all fields plus "fingerprint"."""
        d = self._fields()
        d["fingerprint"] = self.fingerprint
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "contract dict") -> Contract:
        """Inverse of ``to_dict``. A "fingerprint" key, if present, must match the recomputed one."""
        if not isinstance(d, Mapping):
            raise ContractError(f"{source}: expected a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names) - {"fingerprint"})
        if unknown:
            raise ContractError(f"{source}: unknown key(s) {', '.join(unknown)}; expected: {', '.join(names)}")
        if "chunk_size" not in d:
            raise ContractError(f"{source}: missing chunk_size")
        contract = cls(**{k: v for k, v in d.items() if k != "fingerprint"})
        if "fingerprint" in d and d["fingerprint"] != contract.fingerprint:
            raise ContractError(
                f"{source}: fingerprint {d['fingerprint']!r} does not match its fields ({contract.fingerprint!r})"
            )
        return contract

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        backend: str = "torch",
        model_dtype: str | torch.dtype | None = None,
        state_dtype: str | torch.dtype = "float32",
    ) -> Contract:
        """From a Hugging Face Mamba2 config.json: a dict, the file, or a directory holding it.

        chunk_size from "chunk_size" (HF's default 256 if absent); model_dtype from the argument,
        else "torch_dtype" / "dtype" (float32 if absent, as HF loads then).
        """
        if isinstance(config, Mapping):
            cfg, source = config, "HF config dict"
        else:
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            source = f"HF config {path}"
            try:
                cfg = json.loads(path.read_text())
            except OSError as e:
                raise ContractError(f"{source}: cannot read ({e.strerror or e})") from None
            except json.JSONDecodeError as e:
                raise ContractError(f"{source}: malformed JSON ({e.msg} at line {e.lineno})") from None
            if not isinstance(cfg, dict):
                raise ContractError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        # mamba_ssm-style configs keep Mamba2 layer kwargs in "ssm_cfg".
        ssm_cfg = cfg.get("ssm_cfg") if isinstance(cfg.get("ssm_cfg"), Mapping) else {}
        chunk = cfg.get("chunk_size", ssm_cfg.get("chunk_size", HF_DEFAULT_CHUNK_SIZE))
        if model_dtype is None:
            model_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        try:
            return cls(chunk_size=chunk, state_dtype=state_dtype, backend=backend, model_dtype=model_dtype)
        except ContractError as e:
            raise ContractError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, name_or_path: str | os.PathLike[str], **overrides: Any) -> Contract:
        """Load ``configs/contracts/<name>.yaml`` (bare name) or a YAML file path; ``overrides`` win."""
        import yaml  # only needed here; keep the package importable without it

        raw = os.fspath(name_or_path)
        is_name = (
            isinstance(name_or_path, str)
            and "/" not in raw
            and os.sep not in raw
            and not raw.endswith((".yaml", ".yml"))
        )
        path = CONTRACTS_DIR / f"{raw}.yaml" if is_name else Path(raw)
        try:
            text = path.read_text()
        except FileNotFoundError:
            if is_name:
                names = ", ".join(sorted(p.stem for p in CONTRACTS_DIR.glob("*.yaml"))) or "none"
                raise ContractError(f"no contract named {raw!r} in {CONTRACTS_DIR}; available: {names}") from None
            raise ContractError(f"contract file {path} not found") from None
        except OSError as e:
            raise ContractError(f"contract file {path}: cannot read ({e.strerror or e})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ContractError(f"contract file {path}: malformed YAML ({' '.join(str(e).split())})") from None
        source = f"contract file {path}"
        contract = cls.from_dict(data, source=source)  # validates the file as written, fingerprint included
        if not overrides:
            return contract
        merged = {k: v for k, v in data.items() if k != "fingerprint"} | overrides
        return cls.from_dict(merged, source=f"{source} with overrides")

    def diff(self, other: Contract) -> list[tuple[str, Any, Any]]:
        """Differing fields as (name, self value, other value); kernel configs per key."""
        out: list[tuple[str, Any, Any]] = []
        ours, others = self._fields(), other._fields()
        ours.setdefault("row_parallel_slices", 1)
        others.setdefault("row_parallel_slices", 1)
        for name, mine in ours.items():
            theirs = others[name]
            if name == "kernel_configs":
                for key in sorted(set(mine) | set(theirs)):
                    if mine.get(key) != theirs.get(key):
                        out.append((f"kernel_configs.{key}", mine.get(key), theirs.get(key)))
            elif mine != theirs:
                out.append((name, mine, theirs))
        return out


def check_compatible(trainer: Contract, sampler: Contract) -> None:
    """Raise ContractMismatchError naming every differing field with both values."""
    diffs = trainer.diff(sampler)
    if diffs:
        parts = "; ".join(f"{name} trainer={a!r} sampler={b!r}" for name, a, b in diffs)
        raise ContractMismatchError(f"contract mismatch: {parts}")
