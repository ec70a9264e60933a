"""benchmarks/tp_forward_gpus.py (the multi-GPU TP run over NCCL) on the CPU over gloo: two ranks as
processes, the trainer's forward and the engine's schedule at TP 2 give TP 1's rows and logprobs, and
stock tensor parallelism at TP 2 differs from its TP 1 (the run's baseline); with ``--megatron``, Megatron-Core's
MambaModel hooked at TP 1 and 2 (and at TP 2 with sequence parallelism, the 103 packed tokens padded to 104) gives
the core's TP 1 rows and logprobs and stock Megatron at TP 2 differs from its TP 1 (the hybrid through Megatron at
TP 2: tests/integrations/test_megatron_tp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.engines("own")
def test_tp_forward_over_gloo(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tp_forward_gpus.py"), "--dist", "gloo",
                        "--backend", "torch", "--models", "tiny", "--sizes", "1,2", "--slices", "4",
                        "--seq-lens", "70,33", "--gen-len", "6", "--budget", "23", "--repeats", "1", "--megatron",
                        "--sequence-parallel",
                        "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    tp2 = res["models"]["tiny"]["tp2"]
    assert res["all_equal_with_a_differing_baseline"] and res["no_multicast"]["NCCL_NVLS_ENABLE"] == "0"
    assert tp2["rows"] == 103 and tp2["rows_differing"] == tp2["logprobs_differing"] == 0, tp2
    assert tp2["engine_tokens_equal"] and tp2["engine_rows_differing"] == tp2["engine_logprobs_differing"] == 0
    assert tp2["stock_rows_differing_from_stock_tp1"] > 0, tp2
    for k in ("tp1", "tp2"):
        c = res["models"]["tiny"][k]
        assert c["megatron_rows_differing_from_core_tp1"] == c["megatron_logprobs_differing_from_core_tp1"] == 0
        assert c["megatron_ms"] > 0 and c["megatron_stock_ms"] > 0
    assert tp2["megatron_stock_rows_differing_from_its_tp1"] > 0
    assert tp2["megatron_sp_rows_differing_from_core_tp1"] == tp2["megatron_sp_logprobs_differing_from_core_tp1"] == 0
    assert tp2["megatron_sp_ms"] > 0 and "megatron_sp_ms" not in res["models"]["tiny"]["tp1"]
