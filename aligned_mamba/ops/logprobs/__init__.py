"""Log-softmax and per-token logprobs, the logprob both sides report, its forms side by side.

One signature: ``log_softmax(logits, temperature) -> [..., V]`` float32 logprobs of
fp32(logits) / fp32(T); ``token_logprobs`` picks the tokens' entries. The vocabulary sum's tree is
fixed for tensor parallelism (``sliced.log_softmax_sharded``: any power-of-two split of the
vocabulary gives the unsharded bits).

- ``naive.py``: float64, the accuracy reference;
- ``sliced.py``: the torch form (VOCAB_SLICES contiguous slices, each a fixed tree, joined by pairs);
- ``triton.py``: a blocked online sum in one kernel, its own fixed order, and its autograd Function.
The CPU runs the torch form (its exp, log and sums take their C loops, ``elementwise``).
"""

from .sliced import (
    VOCAB_SLICES,
    check_shards,
    check_temperature,
    check_token_inputs,
    log_softmax,
    log_softmax_backward,
    log_softmax_sharded,
    pair_tree,
    scale,
    sliced_sum,
    token_logprobs,
    token_logprobs_sharded,
)

__all__ = ["VOCAB_SLICES", "check_shards", "check_temperature", "check_token_inputs", "log_softmax",
           "log_softmax_backward", "log_softmax_sharded", "pair_tree", "scale", "sliced_sum", "token_logprobs",
           "token_logprobs_sharded"]
