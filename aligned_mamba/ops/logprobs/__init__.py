"""Log-softmax and per-token logprobs, the logprob both sides report: float32 of fp32(logits) / fp32(T), [..., V].

Forms: naive.py (float64), sliced.py (the torch form, its vocabulary tree fixed for tensor parallelism), triton.py
(a blocked online sum, its own order). Why: docs/design.md, "How the bits are kept", Logprobs.
"""

from .sliced import (
    VOCAB_SLICES,
    check_shards,
    check_temperature,
    check_token_inputs,
    check_token_shapes,
    id_range,
    log_softmax,
    log_softmax_backward,
    log_softmax_sharded,
    pair_tree,
    scale,
    sliced_sum,
    token_logprobs,
    token_logprobs_sharded,
)

__all__ = ["VOCAB_SLICES", "check_shards", "check_temperature", "check_token_inputs", "check_token_shapes",
           "id_range", "log_softmax", "log_softmax_backward", "log_softmax_sharded", "pair_tree", "scale", "sliced_sum",
           "token_logprobs", "token_logprobs_sharded"]
