"""The shape of the house: import layers that hold, no cycles, and a core that imports no integration.

Read from the source (every ``import`` statement, function-local ones too, except those under
``if TYPE_CHECKING:``), so a change that reaches upwards fails here before it tangles the tree:

- ``ops/`` (the step, the ops' forms, the backend resolver) imports nothing above it: not ``layers``,
  ``models`` or the commands; ``layers/`` sits on ``ops``, ``models/`` on ``layers/``; the engine,
  trainer, check and CLI on ``models/``;
- the C loops (``ops/native.py``) are reached only through the ops' CPU forms (``cpu.py``,
  ``cpu_<part>.py``) and the backend that picks them, never from a torch form;
- the core (``aligned_mamba``) never imports ``rollout``, ``trainer_hooks``, vLLM, Megatron or Ray;
- the module-level imports of ``aligned_mamba`` form no cycle;
- the Megatron hook (``trainer_hooks/megatron/``) stands in layers: the refusals, the installed hook,
  the aligned forwards and norms, then the patch, the hook, the flags; none imports Megatron at module
  level (it is imported when the hook is installed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "aligned_mamba"
INTEGRATIONS = ("rollout", "trainer_hooks", "vllm", "megatron", "ray")
# each layer, and the modules it may not import (prefixes of dotted names under aligned_mamba)
FORBIDDEN = {
    "ops": ("layers", "models", "engine", "baseline", "check", "cli", "train", "integrations", "verify"),
    "layers": ("models", "engine", "baseline", "check", "cli", "train", "integrations"),
    "models": ("engine", "baseline", "check", "cli", "train", "integrations"),
    "contract": ("ops.backend", "layers", "models", "engine", "check", "cli", "train", "integrations"),
    # the tensor-parallel API sits beside the contract: layers and models build on it, never the reverse at
    # module level (check_tp reads a family's config inside the call)
    "parallel": ("engine", "baseline", "check", "cli", "train", "integrations", "tp_reference", "verify"),
}
HOOK = ROOT / "trainer_hooks" / "megatron"
# each module of the hook package, and the modules of the package it may import at module level
HOOK_LAYERS = {
    "refusals": set(),
    "current": {"refusals"},
    "norms": {"current", "refusals"},
    "forwards": {"current", "norms", "refusals"},
    "spec": {"norms"},
    "patch": {"forwards", "norms", "refusals"},
    "hook": {"current", "patch", "norms", "refusals"},
    "arguments": {"hook", "refusals"},
    "logprobs": {"current"},
    # beside the hook: what runs Megatron's model (the trainer, its TP ranks, the weights, the CPU stand-ins)
    "cpu": set(),
    "weights": set(),
    "shards": {"weights"},
    "tp": {"refusals"},
    "trainer": {"hook", "logprobs", "spec", "shards", "weights"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, *, module_level: bool = False) -> set[str]:
    """Dotted names imported by ``path`` (relative imports resolved), TYPE_CHECKING blocks skipped."""
    tree = ast.parse(path.read_text())
    pkg = _module(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if module_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = pkg[: len(pkg) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if child.module:  # ``from . import x`` imports x, the package being already under way
                    out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)
            visit(child, top)

    visit(tree, True)
    return out


def _core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py"))


def test_the_core_imports_no_integration() -> None:
    bad = {}
    for path in _core_files():
        hits = sorted(n for n in _imports(path) if n.split(".")[0] in INTEGRATIONS)
        if hits:
            bad[_module(path)] = hits
    assert not bad, bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_imports_only_below_it(layer: str) -> None:
    target = CORE / layer
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    bad = {}
    for path in files:
        hits = sorted(n for n in _imports(path) if n.startswith("aligned_mamba.")
                      and any(n.removeprefix("aligned_mamba.").startswith(f) for f in FORBIDDEN[layer]))
        if hits:
            bad[_module(path)] = hits
    assert files and not bad, bad


def test_only_the_cpu_forms_reach_the_c_loops() -> None:
    ops = CORE / "ops"
    callers = {_module(p) for p in ops.rglob("*.py") if "aligned_mamba.ops.native" in _imports(p)}
    allowed = {_module(p) for p in ops.rglob("cpu*.py")} | {"aligned_mamba.ops.backend"}
    assert callers and callers <= allowed, sorted(callers - allowed)


def test_module_level_imports_form_no_cycle() -> None:
    modules = {_module(p): p for p in _core_files()}
    graph = {m: {n for n in _imports(p, module_level=True) if n in modules and n != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(n):] + [n])}")
            if n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)


def test_the_megatron_hook_stands_in_layers() -> None:
    files = {p.stem: p for p in HOOK.glob("*.py") if p.stem != "__init__"}
    assert files.keys() == HOOK_LAYERS.keys(), sorted(files)
    bad = {}
    for stem, path in files.items():
        names = _imports(path, module_level=True)
        inner = {n.split(".")[2] for n in names if n.startswith("trainer_hooks.megatron.")}
        hits = sorted(inner - HOOK_LAYERS[stem] - {stem}) + sorted(n for n in names if n.split(".")[0] == "megatron")
        if hits:
            bad[stem] = hits
    assert not bad, bad


def test_the_tree_has_one_place_per_thing() -> None:
    """One module per layer kind, one file per model family, the forms of the scan side by side."""
    assert {p.stem for p in (CORE / "layers").glob("*.py")} >= {"base", "mamba2", "norm"}
    assert {p.stem for p in (CORE / "models").glob("*.py")} >= {"causal_lm", "family", "hf_config", "registry",
                                                                "mamba2", "mamba_ssm", "nemotron_h"}
    assert not (ROOT / "trainer_hooks" / "megatron.py").exists()
    assert {p.stem for p in (CORE / "ops" / "ssd").glob("*.py")} >= {"naive", "chunk", "fused_recurrent",
                                                                      "triton_chunk", "triton_decode", "state"}
    for op in ("norm", "linear", "conv1d", "logprobs", "elementwise"):  # a reference, a torch form, a Triton form
        stems = {p.stem for p in (CORE / "ops" / op).glob("*.py")}
        # the row-parallel (tensor-parallel) form beside it, torch and Triton; the MLP's GEMM with the
        # squared ReLU in its epilogue (decode sizes); the gated norm over TP slices in Triton
        extra = {"linear": {"sliced", "triton_tree", "triton_relu2"}, "norm": {"triton_sliced"}}.get(op, set())
        assert {"naive", "triton"} <= stems and len(stems - {"__init__", "naive", "cpu", "triton"} - extra) == 1, \
            (op, stems)
    assert not [p.name for p in (CORE / "ops").glob("*.py") if "triton" in p.stem and p.stem != "triton_math"]
    assert not (CORE / "model").exists()
    for top in ("aligned_mamba", "trainer_hooks", "rollout", "configs", "tests"):
        assert (ROOT / top).is_dir(), top


def test_a_decode_step_through_the_mamba2_layer_goes_down_and_comes_back() -> None:
    """Run, not read: one decode step of the embedded default through its first Mamba2 layer
    (``benchmarks/walk_decode.py``). The calls from the layer go down into the ops and come back; a
    call into a file still on the stack below (a form calling back up into the layer's helpers, as
    the replay plans' lambdas did at ab96ee6: 7 such calls there) is a tangle. At most 6, the
    issue's bound; 1 today (the step plan's memo calling the decode form's table builder)."""
    from benchmarks.walk_decode import file_tree, walk

    lines, order, returns = file_tree(walk("torch"))
    assert order[0] == "aligned_mamba/layers/mamba2.py" and "aligned_mamba/ops/ssd/decode.py" in order, order
    assert returns <= 6, "\n".join(lines)
