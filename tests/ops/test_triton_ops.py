"""What spans the Triton op kernels (the GEMM, norms, conv1d and log-softmax): their pinned configs.

- interpreter (marked as the op kernels' tests are; no kernel runs): ``TritonKernelConfigs`` refuses,
  in one line, a value of any op's field that no kernel implements.

Each kernel's own tests live in its op's folder, forward, backward and GPU side by side:
tests/ops/linear/test_linear_gemm.py, tests/ops/norm/, tests/ops/conv1d/,
tests/ops/logprobs/test_logprobs_triton.py. Their sm_90 compile script is one for the four:
tests/ops/test_triton_ops_compile.py; their autograd Functions against fp64:
tests/ops/test_triton_backward.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402

_REFUSED = [("linear_warps", 2), ("linear_block_k", 256), ("linear_persistent", 1), ("linear_epi_split", 4),
            ("linear_decode_stages", 9), ("linear_decode_tma", "yes"), ("linear_mid_programs_per_sm", 0),
            ("linear_fill_programs", -1), ("linear_mid_max_m", -1), ("norm_block_per_warp", 3),
            ("conv_block_c", 100), ("logprobs_block_v", 64)]


@pytest.mark.parametrize("field,value", _REFUSED)
def test_configs_refuse_values_no_kernel_implements(field, value):
    with pytest.raises(ValueError, match=field) as e:
        TritonKernelConfigs(**{field: value})
    assert "\n" not in str(e.value)
