"""The files one decode batch enters inside the Mamba2 layer, in order (run, not read).

Runs the embedded default model on the CPU through ``SamplerEngine``: two requests are prefilled,
then the next step (a decode of both) is traced inside the first Mamba2 layer's ``advance`` with
``sys.setprofile``. Prints the project files in the order the layer's frames run in (consecutive
repeats merged), and how often the walk returns to a file it had already left.

    python -m benchmarks.walk_decode [--backend torch|cpu] [--frames]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import aligned_mamba
from aligned_mamba.contract import Contract
from aligned_mamba.engine import SamplerEngine
from aligned_mamba.layers.mamba2 import Mamba2Mixer
from aligned_mamba.models import load_source
from aligned_mamba.models.registry import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(aligned_mamba.__file__)))


def walk(backend: str) -> list[tuple[int, str, str]]:
    """(depth, file relative to the repository, function) of every project call made during one
    decode step of the first Mamba2 layer, in order; depth counts project frames only."""
    config, tensors = load_source("tiny")
    contract = Contract.from_yaml("default", backend=backend)
    model = build_model(config, tensors, contract)
    engine = SamplerEngine(model, num_slots=2, max_batch_tokens=64, graphs=False)
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8]):
        engine.add_request(prompt, 4)
    engine.step()  # both prompts

    mixer = next(b.mixer for b in model.blocks if isinstance(b.mixer, Mamba2Mixer))
    calls: list[tuple[int, str, str]] = []
    stack: list[Any] = []  # the project frames under the layer's advance

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if not stack and not (event == "call" and code is Mamba2Mixer.advance.__code__
                              and frame.f_locals.get("self") is mixer):
            return
        path = os.path.abspath(code.co_filename)
        if not path.startswith(ROOT + os.sep) or "site-packages" in path or not os.path.exists(path):
            return
        if event == "call":
            calls.append((len(stack), os.path.relpath(path, ROOT), code.co_qualname))
            stack.append(frame)
        elif event == "return" and stack and stack[-1] is frame:
            stack.pop()

    sys.setprofile(profile)
    try:
        engine.step()  # one decode row per request
    finally:
        sys.setprofile(None)
    return calls


def file_tree(calls: list[tuple[int, str, str]], every: bool = False) -> tuple[list[str], list[str], int]:
    """(printed lines of the file-level call tree, files in the order first entered, calls back into a file
    still on the stack below the caller) of ``walk``'s calls; ``every``: a line per call, not per file change."""
    files: list[str] = []  # the file of each frame on the stack
    order: list[str] = []
    lines: list[str] = []
    returns = 0
    for depth, path, name in calls:
        del files[depth:]
        crosses = not files or files[-1] != path
        again = crosses and path in files
        returns += again
        if path not in order:
            order.append(path)
        line = f"{'  ' * depth}{path}  {name}{'   <- back into a file left' if again else ''}"
        if (crosses or every) and (not lines or line != lines[-1]):
            lines.append(line)
        files.append(path)
    return lines, order, returns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--frames", action="store_true", help="print every call, not only those into another file")
    args = ap.parse_args()
    lines, order, returns = file_tree(walk(args.backend), args.frames)
    print("\n".join(lines))
    print(f"backend {args.backend}: {len(order)} files, entered in this order: {', '.join(order)}")
    print(f"{returns} calls back into a file the walk had left (still on the stack below)")


if __name__ == "__main__":
    main()
