"""``tests/interpreter/`` runs only where triton 3.9.0 is installed (``./run test`` runs it with
triton 3.9.0 from ``.triton-interpret`` first on its path); anywhere else its tests skip with that
reason. Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so it is set here, before the
kernels are imported."""

import importlib.metadata
import os

import interpreted
import pytest

try:
    _TRITON = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    _TRITON = None

if _TRITON == interpreted.TRITON_VERSION:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    ours = [item for item in items if str(item.fspath).startswith(here)]
    if _TRITON != interpreted.TRITON_VERSION:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=f"needs triton {interpreted.TRITON_VERSION} (found {_TRITON}); ./run test runs "
                                                    "tests/interpreter with triton 3.9.0 from .triton-interpret"))
        return
    interpreted.install()
