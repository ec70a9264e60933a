"""Causal self-attention over packed sequences, its forms side by side.

One signature, ``(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, **options) -> out``:
q [Tq, H, D], k and v [Tk, G, D] (G key/value heads, H a multiple of G: grouped-query attention,
query head h reads key/value head h // (H // G)), cu_seqlens_q / cu_seqlens_k [S+1] int64 on the
CPU. Sequence i has n_k keys (positions 0 .. n_k - 1) and its n_q queries are its LAST n_q
positions (n_k - n_q .. n_k - 1): a prefill passes all of a sequence's tokens as queries, a decode
step its newest one, a chunk of a prefill the chunk's tokens (with every earlier token as a key).
Query t attends to keys 0 .. t.

- ``naive.attention_naive``: float64, the accuracy reference.
- ``blocked.attention_blocked``: the torch contract form (CPU); ``blocked.attention_stock``: the
  eager baseline.
- ``triton.attention_triton``: the triton backend's kernel (GPU), reading keys and values where a
  cache holds them; its bits are the GPU's own (the hardware class differs from the CPU's anyway).
- ``triton_backward``: that kernel's backward (dq, dk, dv in Triton, deterministic) and the autograd
  Functions the triton backend trains with (the forward is the sampler's launch, unchanged).
"""

from .blocked import KV_BLOCK, ROW_TILE, BlockedPlan, attention_blocked, attention_stock, blocked_plan
from .naive import attention_naive

__all__ = ["KV_BLOCK", "ROW_TILE", "BlockedPlan", "attention_blocked", "attention_naive", "attention_stock",
           "blocked_plan"]
