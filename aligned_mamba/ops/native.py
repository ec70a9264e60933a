"""The torch backend's position-invariant ops as single loops on the CPU (``native_cpu.c``).

A torch form such as ``elementwise._exp`` is some twenty whole-tensor operations; on the small
tensors of a decode step each costs its dispatch, not its arithmetic. ``native_cpu.c`` runs the
same IEEE operations element by element, in the same order, in one pass, so it gives the torch
forms' bits (tests/test_ops_native.py compares them, special values included) at a fraction of
the time. The torch forms stay the statement of the arithmetic: every function here returns None
where it does not apply (not a contiguous-able CPU tensor of float32/bfloat16, inputs that need a
gradient, or no library), and the caller then runs the torch form.

The library is compiled on first use with the system's C compiler (``cc``, or ``$CC``) into a
private directory, ``$XDG_CACHE_HOME/aligned_mamba`` (default ``~/.cache``), else
``aligned_mamba-<uid>`` in the system's temp directory: created 0700, and used only while it is
a real directory owned by this user and writable by no one else. Flags: ``-O3 -ffp-contract=off``
(no fused multiply-adds, no reordered sums; ``-fno-trapping-math`` lets selects vectorise and
changes no value), plus ``-mavx2 -mfma`` where the CPU has them. The build goes to a temporary
name and is renamed into place, with a record beside it (``.json``: the digest of the C source
and the flags, the file's size and SHA-256). Before it is loaded a cached library must be a
regular file owned by this user, match its record (so a truncated file, which would kill the
process with SIGBUS when mapped, is never loaded) and export every symbol used here; one that
does not is rebuilt, and where it cannot be, the torch forms run and one line is logged.
``ALIGNED_MAMBA_NATIVE=0`` turns it off; ``status()`` says why it is not used.
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
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_UNARY = {"exp": 0, "log": 1, "log1p": 2, "softplus": 3, "sigmoid": 4, "silu": 5}

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


def _threads() -> int:
    """The GEMMs' threads: two where torch runs two or more (a split over outputs: the same bits)."""
    return min(2, torch.get_num_threads())


def _ok(*ts: torch.Tensor | None) -> bool:
    grad = torch.is_grad_enabled()
    return all(t is None or (t.is_cpu and t.dtype in _DTYPES and not (grad and t.requires_grad)) for t in ts)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _scratch(n: int) -> torch.Tensor:
    return torch.empty(2 * max(2, 1 << max(0, (n - 1).bit_length())), dtype=torch.float32)


def unary(name: str, x: torch.Tensor, arg: float = 0.0) -> torch.Tensor | None:
    """``elementwise._<name>(x)`` for float32 x (softplus: ``arg`` the threshold), or None."""
    if x.dtype != torch.float32 or not _ok(x) or (lib := library()) is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.am_unary(_UNARY[name], x.data_ptr(), y.data_ptr(), x.numel(), arg)
    return y


def tree_sum(x: torch.Tensor) -> torch.Tensor | None:
    """``reduce.tree_sum`` for float32 x [..., n], or None."""
    if x.dtype != torch.float32 or not _ok(x) or (lib := library()) is None:
        return None
    x = x.contiguous()
    n = x.shape[-1]
    y = x.new_empty(x.shape[:-1])
    scratch = _scratch(n)  # held here: a temporary's memory would be freed before the call
    lib.am_tree_sum(x.data_ptr(), y.data_ptr(), y.numel(), n, scratch.data_ptr())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``norm.rms_norm(x, weight, eps, out_dtype)`` for x [M, d]; with ``residual`` [M, d] the fused
    add of ``Backend.add_norm`` first (returns (normed, residual + x), the sum in residual's dtype,
    normed from it rounded to out_dtype). None where it does not apply."""
    if out_dtype not in _DTYPES or not _ok(x, weight, residual) or (lib := library()) is None:
        return None
    M, d = x.shape
    x = x.contiguous()
    w = weight.to(out_dtype).contiguous()
    out = torch.empty(M, d, dtype=out_dtype)
    res = res_out = None
    if residual is not None:
        if residual.dtype != torch.promote_types(residual.dtype, x.dtype):
            return None  # the sum would be in another dtype than residual's
        res = residual.contiguous()
        res_out = torch.empty_like(res)
    scratch = _scratch(d)
    lib.am_rms_norm(x.data_ptr(), _DTYPES[x.dtype], _ptr(res), _ptr(res_out),
                    _DTYPES[res.dtype] if res is not None else 0, w.data_ptr(), out.data_ptr(), _DTYPES[out_dtype],
                    M, d, eps, scratch.data_ptr())
    return out, res_out


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   n_groups: int) -> torch.Tensor | None:
    """``norm.gated_rms_norm`` for y, z [M, d] of one dtype, or None."""
    if z.dtype != y.dtype or not _ok(y, z, weight) or (lib := library()) is None:
        return None
    M, d = y.shape
    y, z = y.contiguous(), z.contiguous()
    w = weight.to(y.dtype).contiguous()
    out = torch.empty_like(y)
    scratch = _scratch(d // n_groups)
    lib.am_gated_norm(y.data_ptr(), z.data_ptr(), w.data_ptr(), out.data_ptr(), _DTYPES[y.dtype], M, d, n_groups,
                      eps, scratch.data_ptr())
    return out


def tap_sum(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            activation: bool) -> torch.Tensor | None:
    """``conv1d._tap_sum`` (then SiLU if ``activation``) rounded to taps' dtype: taps [T, K, Cd],
    weight [Cd, K], bias [Cd] or None -> [T, Cd], or None."""
    if not _ok(taps, weight, bias) or (lib := library()) is None:
        return None
    T, K, Cd = taps.shape
    taps = taps.contiguous()
    w = weight.to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(T, Cd, dtype=taps.dtype)
    scratch = torch.empty(Cd)
    lib.am_tap_sum(taps.data_ptr(), _DTYPES[taps.dtype], w.data_ptr(), _ptr(b), out.data_ptr(), T, K, Cd,
                   int(activation), scratch.data_ptr())
    return out


def slot_stride(buf: torch.Tensor) -> int | None:
    """A slot-major buffer's slot stride, where each slot's block is contiguous; else None."""
    return buf.stride(0) if buf.dim() and buf.shape[0] and buf[0].is_contiguous() else None


def _slot_matrices(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, rows: int,
                   cols: int) -> tuple[int, int, int, torch.Tensor] | None:
    """For x [S, Hb, M, ...] whose item (s, j) takes the matrix w[index[s], j], w [slots, Hb, rows, cols]:
    (Hb, w's slot stride, its Hb stride, index as contiguous int64), where each [rows, cols] matrix is
    contiguous; else None."""
    if (x.dim() != 4 or w.dim() != 4 or index.shape != (x.shape[0],) or w.shape[1:] != (x.shape[1], rows, cols)
            or w.stride(3) != 1 or w.stride(2) != cols):
        return None
    return x.shape[1], w.stride(0), w.stride(1), index.to(torch.int64).contiguous()


def decode_put(buf_x: torch.Tensor, buf_dt: torch.Tensor, buf_B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
               B: torch.Tensor, C: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, A: torch.Tensor,
               dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> tuple[torch.Tensor, ...] | None:
    """Steps 1 and 2 of ``ssd.decode.replay_decode`` for sequences in ``slots`` [S] with tokens at
    chunk rows ``pos`` [S]: writes the tokens' x [S, H, P], raw dt [S, H] and B [S, G, N] into the
    buffers [slots, H | G, L, ...] (all one dtype with C [S, G, N]) and returns, float32: dtc [S, H, L]
    (softplus'd dt, +0.0 past the token), a [S, H, L] = torch.cumsum(dtc * A, -1) (its bits), the
    tokens' C [S, G, N] and x [S, H, P]. None, with nothing written, where it does not apply."""
    ts = (buf_x, buf_dt, buf_B, x, dt, B, C)
    if not _ok(*ts) or len({t.dtype for t in ts}) != 1 or (lib := library()) is None:
        return None
    strides = [slot_stride(b) for b in (buf_x, buf_dt, buf_B)]
    S = slots.numel()
    rows = [t.reshape(S, -1) for t in (x, dt, B, C)]  # views where the rows are contiguous
    lds = [_row_stride(t) for t in rows]
    if None in strides or None in lds:
        return None
    _, H, L, P = buf_x.shape
    G, N = buf_B.shape[1], buf_B.shape[3]
    slots, pos = slots.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous()
    bias, Af = dt_bias.to(torch.float32).contiguous(), A.to(torch.float32).contiguous()
    dtc, a, Cr, xt = torch.empty(S, H, L), torch.empty(S, H, L), torch.empty(S, G, N), torch.empty(S, H, P)
    lo, hi = (float(v) for v in dt_limit)
    limit = (lo, hi) != (0.0, float("inf"))
    xr, dtr, Br, Cn = rows
    lib.am_decode_put(buf_x.data_ptr(), buf_dt.data_ptr(), buf_B.data_ptr(), xr.data_ptr(), lds[0], dtr.data_ptr(),
                      lds[1], Br.data_ptr(), lds[2], Cn.data_ptr(), lds[3], _DTYPES[x.dtype], *strides,
                      slots.data_ptr(), pos.data_ptr(), S, H, G, L, P, N, bias.data_ptr(), Af.data_ptr(), int(limit),
                      lo if limit else 0.0, hi if limit else 0.0, dtc.data_ptr(), a.data_ptr(), Cr.data_ptr(),
                      xt.data_ptr())
    return dtc, a, Cr, xt


def decode_scores(a: torch.Tensor, dtc: torch.Tensor, CB: torch.Tensor, pos: torch.Tensor, G: int,
                  R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk.tile_outputs``' elementwise work for each tile's one live row (tiles of R rows): a, dtc
    [S, H, L] float32, CB [S * G, Q, L] (the C.B GEMM's output: Q = R whole tiles, or Q = 1 the live
    rows alone), pos [S] -> (tiles [S * H, Q, L], the intra GEMM's left operand, zero but for the live
    rows; e_in [S, H], the boundary state's decay). The library must be loaded (``decode_operands``
    returned operands)."""
    lib = library()
    S, H, L = a.shape
    a, dtc, CB = a.contiguous(), dtc.contiguous(), CB.contiguous()
    pos = pos.to(torch.int64).contiguous()
    Q = CB.shape[1]
    tiles, e_in = torch.empty(S * H, Q, L), torch.empty(S, H)
    lib.am_decode_scores(a.data_ptr(), dtc.data_ptr(), CB.data_ptr(), pos.data_ptr(), S, H, G, L, R, Q,
                         tiles.data_ptr(), e_in.data_ptr())
    return tiles, e_in


def decode_combine(inter: torch.Tensor, intra: torch.Tensor, e_in: torch.Tensor, D: torch.Tensor, xt: torch.Tensor,
                   pos: torch.Tensor, G: int, R: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tokens' rows y [S, H, P] float32 = (C.h_in * e_in + intra) + D x_t, from the GEMMs' outputs
    inter [S * G, Q, Hg * P] and intra [S * H, Q, P] (Q as in ``decode_scores``), e_in [S, H], D [H]
    or [H, P], xt [S, H, P] the tokens' x in float32; y rounded once to ``dtype``."""
    lib = library()
    S, H, P = xt.shape
    inter, intra, xt = inter.contiguous(), intra.contiguous(), xt.contiguous()
    Df = D.to(torch.float32).contiguous()
    pos = pos.to(torch.int64).contiguous()
    y = torch.empty(S, H, P, dtype=dtype)
    lib.am_decode_combine(inter.data_ptr(), intra.data_ptr(), e_in.data_ptr(), Df.data_ptr(), int(Df.dim() == 2),
                          xt.data_ptr(), pos.data_ptr(), S, H, G, P, R, inter.shape[1], y.data_ptr(), _DTYPES[dtype])
    return y


def lane_gemm(x: torch.Tensor, w: torch.Tensor, exact: bool, *,
              index: torch.Tensor | None = None) -> torch.Tensor | None:
    """``linear.lane_matmul``'s sums: x [..., M, Kp] float32, w [..., N, Kp] float32 or bfloat16 (both
    zero-padded to Kp, a multiple of 8; batch dims equal, or w without them) -> [..., M, N] float32.
    ``exact``: every product is exact (bfloat16 values), so fused multiply-adds give the same bits.
    index [S] int64: x [S, G, M, Kp] takes w [slots, G, N, Kp] at slots ``index`` (any slot and G
    strides, [N, Kp] contiguous), read in place. None where it does not apply."""
    if x.dtype != torch.float32 or not _ok(x, w) or (lib := library()) is None:
        return None
    M, Kp = x.shape[-2:]
    N = w.shape[-2]
    batch = x.shape[:-2]
    if index is not None:
        if (slotted := _slot_matrices(x, w, index, N, Kp)) is None:
            return None
        hb, sw, sh, index = slotted
    elif w.dim() > 2 and w.shape[:-2] != batch:
        return None
    else:
        w = w.contiguous()
        hb, sw, sh = 1, N * Kp if w.dim() > 2 else 0, 0
    x = x.contiguous().view(-1, M, Kp)
    nb = x.shape[0]
    out = torch.empty(*batch, M, N)
    lib.am_lane_gemm(x.data_ptr(), M * Kp, w.data_ptr(), sw, _ptr(index), hb, sh, int(w.dtype == torch.bfloat16),
                     out.data_ptr(), nb, M, N, Kp, int(exact), _threads())
    return out


def lane_gemm_kn(x: torch.Tensor, w: torch.Tensor, exact: bool, *, index: torch.Tensor | None = None,
                 klen: torch.Tensor | None = None) -> torch.Tensor | None:
    """``lane_gemm(x, w^T)`` with w as [..., K, N]: x [..., M, K] float32, w [..., K, N] float32 or
    bfloat16 (batch dims equal) -> [..., M, N] float32, the same bits (each output the same chain), with
    no transposed copy of w. K need not be a multiple of 8 (the rest counts as zero-padded). None where
    it does not apply.

    index [S] int64: x [S, H, M, K] takes w [slots, H, K, N] at slots ``index`` (any slot and head
    strides, [K, N] contiguous), read in place. klen (one per matrix, or with index one per slot):
    the terms stop at k = klen (the same bits where x is +0.0 from there on and w finite: the lanes
    add exact zeros there).
    """
    if x.dtype != torch.float32 or not _ok(x, w) or (lib := library()) is None:
        return None
    M, K = x.shape[-2:]
    N = w.shape[-1]
    if index is not None:
        if (slotted := _slot_matrices(x, w, index, K, N)) is None:
            return None
        hb, sw, sh, index = slotted
    elif w.shape[:-2] != x.shape[:-2]:
        return None
    else:
        w, hb, sw, sh = w.contiguous(), 1, K * N, 0
    batch = x.shape[:-2]
    x = x.contiguous()
    out = torch.empty(*batch, M, N)
    nb = out.numel() // max(1, M * N)
    if klen is not None:
        klen = klen.to(torch.int64).contiguous()
        if klen.numel() * hb != nb:
            return None
    lib.am_lane_gemm_kn(x.data_ptr(), M * K, w.data_ptr(), sw, _ptr(index), hb, sh, int(w.dtype == torch.bfloat16),
                        out.data_ptr(), nb, M, N, K, _ptr(klen), int(exact), _threads())
    return out


def _row_stride(t: torch.Tensor) -> int | None:
    """A matrix's row stride where its rows are contiguous; else None."""
    return t.stride(0) if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) else None


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``linear.linear(x, ...)`` in the lanes' form: x [M, K] (float32 or bfloat16, rows contiguous),
    w [N, Kp] the padded weight (Kp a multiple of 8), bias [N] or None -> [M, N] in x's dtype, the
    same bits in one call. None where it does not apply."""
    if not _ok(x, w, bias) or (lib := library()) is None or (ldx := _row_stride(x)) is None:
        return None
    M, K = x.shape
    N, Kp = w.shape
    w = w.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(M, N, dtype=x.dtype)
    scratch = torch.empty(M * Kp + M * N)
    lib.am_linear(x.data_ptr(), _DTYPES[x.dtype], ldx, w.data_ptr(), int(w.dtype == torch.bfloat16), _ptr(b),
                  _DTYPES[b.dtype] if b is not None else 0, out.data_ptr(), M, N, K, Kp,
                  int(x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16), scratch.data_ptr(), _threads())
    return out


def conv_step(windows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, activation: bool = True) -> torch.Tensor | None:
    """``conv1d.causal_conv1d_step`` with each slot's window [slots, K-1, Cd] updated in place: x [S, Cd]
    (rows contiguous; windows' dtype), slots [S] -> out [S, Cd] in x's dtype. None where it does not
    apply (nothing written then)."""
    if (not _ok(windows, x, weight, bias) or x.dtype != windows.dtype or (lib := library()) is None
            or (ldx := _row_stride(x)) is None or (sw := slot_stride(windows)) is None):
        return None
    S, Cd = x.shape
    K = windows.shape[1] + 1
    slots = slots.to(torch.int64).contiguous()
    w = weight.to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(S, Cd, dtype=x.dtype)
    scratch = torch.empty(K * Cd + Cd)
    lib.am_conv_step(windows.data_ptr(), sw, slots.data_ptr(), x.data_ptr(), ldx, _DTYPES[x.dtype], w.data_ptr(),
                     _ptr(b), out.data_ptr(), S, K, Cd, int(activation), scratch.data_ptr())
    return out
