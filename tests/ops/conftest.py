"""tests/ops setup: a module's tests of one op side by side, whatever runs them.

A module that imports ``interpreted`` runs its ``interpreter`` tests on CPU tensors through the Triton
interpreter; where it also holds ``gpu`` or ``compile`` tests it cannot skip itself whole in a GPU
session (``interpreted.require()`` at its top), so its ``interpreter`` tests call ``require()`` one
by one here: skipped where the session compiles Triton, the others run.
"""

import interpreted
import pytest


@pytest.fixture(autouse=True)
def _interpreter_tests_need_the_interpreter(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("interpreter") and getattr(request.module, "interpreted", None) is interpreted:
        interpreted.require()
