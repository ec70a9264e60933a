"""The aligned norms Megatron builds in place of its own (``TENorm``, ``ExtendedRMSNorm``): the
shared RMSNorm ops, constructor-compatible with the modules they replace."""

from __future__ import annotations

from typing import Any

import torch

from aligned_mamba.ops.backend import Backend

from .current import hook_for
from .refusals import AlignmentRefused


def _init_device(config: Any) -> torch.device | str | int:
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


class AlignedRMSNorm(torch.nn.Module):
    """The core's layer and final RMSNorm on the shared op, in the params dtype; weight [hidden_size].
    Constructor-compatible with Megatron's ``TENorm(config, hidden_size, eps)``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype,
                                                    device=_init_device(config)))
        # on sequence-parallel rows each rank's gradient is a part: Megatron's finalize_model_grads sums the
        # parameters marked so over the TP group (as its own norms mark theirs)
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] any float dtype -> [..., hidden] in the params dtype."""
        return aligned_rms_norm(hook_for(self).backend(x.device), x, self.weight, self.eps, self.config.params_dtype)


def aligned_rms_norm(backend: Backend, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """x [..., hidden] as it comes (an fp32 residual unrounded) -> the backend's RMSNorm in ``dtype``. A 2-d x
    goes to the op unviewed, so its gradient terms reach x in the core's order (``forwards.mamba_layer_forward``)."""
    if x.dim() == 2:
        return backend.rms_norm(x, weight, eps, dtype)
    shape = x.shape
    return backend.rms_norm(x.reshape(-1, shape[-1]), weight, eps, dtype).reshape(shape)


class AlignedGatedRMSNorm(torch.nn.Module):
    """Mamba2's gated RMSNorm on the shared op: norm_g(y * silu(z)) * weight, the gate in the norm after
    the scan. Constructor-compatible with mamba_ssm's ``RMSNormGated`` as MambaMixer builds it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if norm_before_gate:
            raise AlignmentRefused("gated norm with norm_before_gate=True: Mamba2 (HF, vLLM) gates before the norm")
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size:
            raise AlignmentRefused(f"gated norm: hidden size {hidden_size} is not a multiple of group size "
                                   f"{self.group_size}")
        self.norm_before_gate = False
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """y, z [..., hidden] -> [..., hidden] in y's dtype."""
        if z is None:
            raise AlignmentRefused("gated norm called without z: the gate would have been applied inside the scan "
                                   "(Megatron's fused training path); the aligned forward gates in the norm")
        shape = y.shape
        d = shape[-1]
        backend = hook_for(self).backend(y.device)
        out = backend.gated_rms_norm(y.reshape(-1, d), z.reshape(-1, d), self.weight.to(y.dtype), self.eps,
                                     d // self.group_size)
        return out.reshape(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """Distributed checkpointing: the weight sharded along dim 0 over the TP group (as ExtendedRMSNorm)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"))
