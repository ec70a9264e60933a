"""The vLLM engines several integration modules share (tests/integrations/engines.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

_open: list = []  # the session's Engines, once a test has asked for it


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator:
    from engines import Engines

    modules = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items
               if getattr(item, "module", None) is not None}
    reg = Engines(tmp_path_factory.mktemp("engines"), modules)
    _open.append(reg)
    yield reg
    _open.remove(reg)
    reg.close()


@pytest.fixture(scope="module", autouse=True)
def _close_engines_after_their_last_module(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for reg in _open:
        reg.done(request.module.__name__.rsplit(".", 1)[-1])
