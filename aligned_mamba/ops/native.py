"""The loader of the ops' CPU forms: ``native_cpu.c`` built, verified and loaded on first use.

The loops give the torch forms' bits in one pass (tests/ops/test_native.py). A ``cpu.py`` wrapper returns None where
they do not apply (not a CPU float32/bfloat16 tensor, a gradient recorded, no library): the torch form then runs.
Built with ``$CC`` (default ``cc``) into a private cache directory; ``ALIGNED_MAMBA_NATIVE=0`` turns it off,
``status()`` says why it is not used. The build's flags and checks: docs/design.md, "How the bits are kept".
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("native_cpu.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c11",
          "-pthread")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
UNARY = {"exp": 0, "log": 1, "log1p": 2, "softplus": 3, "sigmoid": 4, "silu": 5}

_lib: ctypes.CDLL | None = None
_path: Path | None = None  # the file loaded
_status: str | None = None  # None: not tried yet
_SYMBOLS = ("am_unary", "am_tree_sum", "am_rms_norm", "am_gated_norm", "am_tap_sum", "am_decode_put",
            "am_decode_scores", "am_decode_combine", "am_lane_gemm_kn", "am_lane_gemm", "am_linear", "am_conv_step")
log = logging.getLogger("aligned_mamba")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aligned_mamba"


def _isa_flags() -> tuple[str, ...]:
    """-mavx2 -mfma where this CPU has both (the lanes then fill one register; the bits are the same)."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return ()
    return ("-mavx2", "-mfma") if {"avx2", "fma"} <= set(flags) else ()


def _private_dir(d: Path) -> None:
    """Create ``d`` 0700 if missing; raise OSError (the reason) unless it is a directory (not a
    link) owned by this user that no one else can write."""
    try:
        d.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{d} is not a directory")
    if st.st_uid != os.getuid():
        raise OSError(f"{d} is owned by uid {st.st_uid}, not this user")
    if st.st_mode & 0o022:
        raise OSError(f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def _own_file(p: Path) -> os.stat_result | None:
    """The stat of ``p`` if it is a regular file owned by this user that no one else can write."""
    try:
        st = os.lstat(p)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None
    return st


def _digest(p: Path) -> str:
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _verified(so: Path, record: dict[str, object]) -> str | None:
    """None if ``so`` is the library ``record`` describes (owner, size, digest of the file, of the
    source and flags), else why not."""
    st = _own_file(so)
    if st is None:
        return "missing, not a regular file, or not this user's"
    meta_path = so.with_suffix(".json")
    if _own_file(meta_path) is None:
        return "no record beside it"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return "an unreadable record"
    if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in record.items()):
        return "built from another source or flags"
    if meta.get("size") != st.st_size:
        return f"size {st.st_size}, recorded {meta.get('size')} (truncated?)"
    if meta.get("sha256") != _digest(so):
        return "its digest differs from the record"
    return None


def _load(so: Path) -> ctypes.CDLL:
    """dlopen ``so`` (already verified) and check that it exports every symbol used here."""
    lib = ctypes.CDLL(str(so))
    missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise OSError(f"{so.name} lacks {', '.join(missing)}")
    return lib


def _compile(cc: str, flags: tuple[str, ...], d: Path, so: Path, record: dict[str, object]) -> None:
    """Build into a temporary name in ``d``, then rename the library and its record into place
    (atomic: a concurrent build leaves complete files)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
    os.close(fd)
    tmp_meta = None
    try:
        try:
            subprocess.run([cc, *flags, "-o", tmp, str(_SOURCE)], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            lines = exc.stderr.strip().splitlines()
            raise OSError(f"{cc} failed: {lines[-1] if lines else exc}") from None
        os.chmod(tmp, 0o700)
        meta = {**record, "size": os.path.getsize(tmp), "sha256": _digest(Path(tmp))}
        fd, tmp_meta = tempfile.mkstemp(suffix=".json", dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, so)
        os.replace(tmp_meta, so.with_suffix(".json"))
    finally:
        for t in (tmp, tmp_meta):
            if t is not None and os.path.exists(t):
                os.unlink(t)


def _build() -> ctypes.CDLL:
    global _path
    cc = os.environ.get("CC", "cc")
    src = _SOURCE.read_bytes()
    flags = (*_FLAGS, *_isa_flags())
    key = hashlib.sha256(src + " ".join((cc, *flags)).encode()).hexdigest()[:16]
    record: dict[str, object] = {"source_sha256": hashlib.sha256(src).hexdigest(), "cc": cc, "flags": list(flags)}
    why: list[str] = []
    for d in (_cache_dir(), Path(tempfile.gettempdir()) / f"aligned_mamba-{os.getuid()}"):
        try:
            _private_dir(d)
        except OSError as exc:
            why.append(str(exc))
            continue
        so = d / f"native_cpu-{key}.so"
        bad = _verified(so, record)
        if bad is not None:
            if so.exists() or so.is_symlink():
                log.info("aligned_mamba: native CPU library %s not used (%s); rebuilding", so, bad)
            try:
                _compile(cc, flags, d, so, record)
            except OSError as exc:
                why.append(str(exc))
                continue
            bad = _verified(so, record)
            if bad is not None:
                why.append(f"{so}: {bad} after the build")
                continue
        lib = _load(so)
        _path = so
        return lib
    raise OSError("; ".join(why) or "no usable cache directory")


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.am_unary.argtypes = [i, p, p, i64, f]
    lib.am_tree_sum.argtypes = [p, p, i64, i64, p]
    lib.am_rms_norm.argtypes = [p, i, p, p, i, p, p, i, i64, i64, f, p]
    lib.am_gated_norm.argtypes = [p, p, p, p, i, i64, i64, i64, f, p]
    lib.am_tap_sum.argtypes = [p, i, p, p, p, i64, i64, i64, i, p]
    lib.am_decode_put.argtypes = [p, p, p, p, i64, p, i64, p, i64, p, i64, i, i64, i64, i64, p, p, *[i64] * 6,
                                  p, p, i, f, f, p, p, p, p]
    lib.am_decode_scores.argtypes = [p, p, p, p, *[i64] * 6, p, p]
    lib.am_decode_combine.argtypes = [p, p, p, p, i, p, p, *[i64] * 6, p, i]
    lib.am_lane_gemm_kn.argtypes = [p, i64, p, i64, p, i64, i64, i, p, i64, i64, i64, i64, p, i, i]
    lib.am_lane_gemm.argtypes = [p, i64, p, i64, p, i64, i64, i, p, i64, i64, i64, i64, i, i]
    lib.am_linear.argtypes = [p, i, i64, p, i, p, i, p, i64, i64, i64, i64, i, p, i]
    lib.am_conv_step.argtypes = [p, i64, p, p, i64, i, p, p, p, i64, i64, i64, i, p]
    for fn in (lib.am_linear, lib.am_conv_step, lib.am_lane_gemm, lib.am_lane_gemm_kn, lib.am_unary, lib.am_tree_sum,
               lib.am_rms_norm, lib.am_gated_norm, lib.am_tap_sum, lib.am_decode_put, lib.am_decode_scores,
               lib.am_decode_combine):
        fn.restype = None


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first call; None where it is off or cannot be built."""
    global _lib, _status
    if _status is None:
        if os.environ.get("ALIGNED_MAMBA_NATIVE", "1") == "0":
            _status = "off (ALIGNED_MAMBA_NATIVE=0)"
        else:
            try:
                lib = _build()
                _declare(lib)
                _lib, _status = lib, "on"
            except (OSError, AttributeError) as exc:
                _status = f"unavailable ({exc}); the torch forms run"
                log.warning("aligned_mamba: native CPU ops %s", _status)
    return _lib


class off:
    """Within: ``library()`` returns None, so every op runs its torch form (for statements of the
    arithmetic and for tests that compare the two)."""

    def __enter__(self) -> None:
        global _lib
        library()
        self._saved, _lib = _lib, None

    def __exit__(self, *exc: object) -> None:
        global _lib
        _lib = self._saved


def library_path() -> Path | None:
    """The file the library was loaded from (None where it is not loaded)."""
    library()
    return _path if _lib is not None else None


def status() -> str:
    """"on", or why the native ops are not used."""
    library()
    return _status or "on"


# -- the calling convention every cpu.py shares ---------------------------------------------------------


def ok(*ts: torch.Tensor | None) -> bool:
    """Whether the loops may take these tensors: CPU, float32 or bfloat16, no gradient recorded."""
    grad = torch.is_grad_enabled()
    return all(t is None or (t.is_cpu and t.dtype in DTYPES and not (grad and t.requires_grad)) for t in ts)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def row_stride(t: torch.Tensor) -> int | None:
    """A matrix's row stride where its rows are contiguous; else None."""
    return t.stride(0) if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) else None


def slot_stride(buf: torch.Tensor) -> int | None:
    """A slot-major buffer's slot stride, where each slot's block is contiguous; else None."""
    return buf.stride(0) if buf.dim() and buf.shape[0] and buf[0].is_contiguous() else None


def scratch(n: int) -> torch.Tensor:
    """Float32 work space for a fixed-tree sum of n terms (held by the caller for the call)."""
    return torch.empty(2 * max(2, 1 << max(0, (n - 1).bit_length())), dtype=torch.float32)
