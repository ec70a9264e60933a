"""Causal GQA attention over packed sequences: naive (fp64), blocked (torch), triton (GPU) forms.

``(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, **options) -> out``: q [Tq, H, D], k, v [Tk, G, D]
(query head h reads key/value head h // (H // G)), cu_seqlens [S+1] int64 (CPU); a sequence's queries
are its last positions, query t attends to keys 0 .. t. Why: docs/design.md, "How the bits are kept".
"""

from .blocked import KV_BLOCK, ROW_TILE, BlockedPlan, attention_blocked, attention_stock, blocked_plan
from .naive import attention_naive

__all__ = ["KV_BLOCK", "ROW_TILE", "BlockedPlan", "attention_blocked", "attention_naive", "attention_stock",
           "blocked_plan"]
