"""The declared dependency bounds against the pins CI installs; no network, no pip resolution.

A plain ``pip install moe-jax`` resolves within pyproject.toml's bounds, while ``./run`` and CI
install exactly requirements/pins.txt. These tests keep the two consistent: every pin lies
inside the bounds (so what CI tests is installable), and the bounds stop at the tested release
series (so pip cannot pick an untested jax such as 0.12).
"""

import ast
import importlib.metadata
import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = [Requirement(r) for r in PYPROJECT["dependencies"]]
EXTRAS = {name: [Requirement(r) for r in reqs] for name, reqs in PYPROJECT["optional-dependencies"].items()}
EVERY = CORE + [r for reqs in EXTRAS.values() for r in reqs]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements" / "pins.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one exact pin a line
        assert spec.operator == "==", f"pins.txt: {line!r} is not an exact pin"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


PINS = _pins()


def _named(name: str, reqs=EVERY) -> list[Requirement]:
    return [r for r in reqs if canonicalize_name(r.name) == canonicalize_name(name)]


@pytest.mark.parametrize("name", sorted(PINS))
def test_every_pin_satisfies_every_bound_on_it(name):
    reqs = _named(name)
    assert reqs, f"pins.txt pins {name}, which pyproject.toml does not name"
    for req in reqs:
        assert req.specifier.contains(PINS[name], prereleases=True), (
            f"pins.txt has {name}=={PINS[name]}, outside pyproject.toml's {req}"
        )


@pytest.mark.parametrize("name", ["jax", "jaxlib"])
def test_jax_is_bounded_below_the_untested_0_12(name):
    reqs = _named(name)
    assert _named(name, CORE), f"{name} is not a core dependency"
    for req in reqs:
        for untested in ("0.12.0", "0.12.0.1", "1.0"):
            assert not req.specifier.contains(untested, prereleases=True), f"{req} admits {untested}"
        assert any(s.operator in ("<", "<=", "==") for s in req.specifier), f"{req}: no upper bound"


@pytest.mark.parametrize("name", ["jax", "jaxlib", "flax", "optax"])
def test_tested_series_have_an_upper_bound(name):
    reqs = _named(name)
    assert reqs
    for req in reqs:
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{req}: no upper bound"


def test_cuda_extras_bound_jax_like_the_core():
    (core_jax,) = _named("jax", CORE)
    for extra in ("cuda12", "cuda13"):
        (req,) = _named("jax", EXTRAS[extra])
        assert req.extras == {extra}
        assert req.specifier == core_jax.specifier, f"extra {extra}: {req} differs from {core_jax}"


def test_core_dependencies_the_library_needs():
    names = {canonicalize_name(r.name) for r in CORE}
    # safetensors and tqdm: the checkpoint loader and the demo's progress bar.
    assert {"jax", "jaxlib", "flax", "numpy", "ml-dtypes", "safetensors", "tqdm"} <= names
    assert "optax" not in names, "optax is for the examples only: keep it in an extra"
    assert _named("optax", EXTRAS["examples"]) and _named("optax", EXTRAS["test"])


def _top_level_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", ["moe_jax", "sharding", "pallas_kernels"])
def test_the_installed_packages_never_import_optax(package):
    users = [p.relative_to(ROOT) for p in sorted((ROOT / package).rglob("*.py")) if "optax" in _top_level_imports(p)]
    assert not users, f"{users} import optax, which is not a core dependency (only the 'examples'/'test' extras)"


def test_this_environment_is_inside_the_core_bounds():
    # The environment the suite runs in (./run installs pins.txt) must be one pip could resolve.
    for req in CORE:
        found = importlib.metadata.version(req.name)
        assert req.specifier.contains(found, prereleases=True), f"installed {req.name} {found}, outside {req}"


def test_the_gpu_extras_bring_the_native_kernels():
    """``pip install 'moe-jax[cuda12]'`` (or cuda13) gives the whole GPU capability: without
    triton and jax-triton, auto on SM100/SM120 could not pick the FP4 tensor-core kernels."""
    for extra in ("cuda12", "cuda13"):
        for name in ("triton", "jax-triton"):
            (req,) = _named(name, EXTRAS[extra])
            (native,) = _named(name, EXTRAS["triton"])
            assert req == native, f"extra {extra}: {req} differs from the 'triton' extra's {native}"
