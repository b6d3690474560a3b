"""``tests/interpreter/`` runs only where triton 3.9.0 is installed (``./run test`` runs it in
``.venv-interpret``); anywhere else its tests skip with that reason. Triton reads
``TRITON_INTERPRET`` when a kernel is defined, so it is set here, before the kernels are imported."""

import importlib.metadata
import os

import pytest

try:
    _TRITON = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    _TRITON = None

if _TRITON == "3.9.0":
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    ours = [item for item in items if str(item.fspath).startswith(here)]
    if _TRITON != "3.9.0":
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=f"needs triton 3.9.0 (found {_TRITON}); ./run test runs "
                                                    "tests/interpreter in .venv-interpret"))
        return
    import interpreted  # noqa: PLC0415

    interpreted.install()
