"""A memory estimate before a run, so that what cannot fit is refused in one line, not OOM-killed.

Covers ``aligned-mamba check`` on the CPU, whose peak is the trainer's one packed forward over every case.
``SCAN_TILES`` is fitted on the default model: 105-108 KiB per token at 8k and 32k tokens (torch 2.13 CPU).
"""

from __future__ import annotations

from pathlib import Path

from .errors import AlignedMambaError

SCAN_TILES = 12  # [H, L] fp32 tiles alive per token in the torch scan (10 measured, rounded up)
RUNTIME_BYTES = 400 << 20  # the interpreter, torch and the model code of one process
FIT = 0.9  # refuse above this share of the available memory


def available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def forward_bytes_per_token(*, hidden: int, heads: int, head_dim: int, groups: int, state: int, chunk: int,
                            vocab: int, dtype_bytes: int) -> int:
    """Peak bytes per token of one packed forward on the torch backend (one layer's work alive)."""
    d_inner = heads * head_dim
    in_proj = 2 * d_inner + 2 * groups * state + heads
    scan = SCAN_TILES * heads * chunk * 4
    rows = 4 * (in_proj + 4 * d_inner + 6 * hidden)
    logits = vocab * (dtype_bytes + 4 + 4 + 8)
    return scan + rows + logits


def check_fits(need: int, what: str, hint: str) -> None:
    """Refuse (one line: the estimate, the limit, what to lower) when ``need`` bytes cannot fit."""
    have = available_bytes()
    if have is None or need <= FIT * have:
        return
    raise AlignedMambaError(f"{what} needs about {need / 2**30:.1f} GiB and {have / 2**30:.1f} GiB is available: "
                            f"{hint}")
