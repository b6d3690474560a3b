"""The shape of the code: imports flow one way (``moe_jax`` -> ``sharding``, ``pallas_kernels``),
no module imports itself through others, and the config loads no kernels or collectives."""

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moe_jax", "sharding", "pallas_kernels")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(tree: ast.Module, module: str, is_package: bool, modules: set[str], type_checking: bool) -> set[str]:
    """Every module of ``modules`` named by an import statement, at module level or in a
    function; under ``if TYPE_CHECKING:`` (never run) only if ``type_checking``."""
    names = set()

    def visit(node):
        if isinstance(node, ast.If) and is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            # ``from package import submodule`` names the submodule; ``from module import name``, the module.
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """``module -> modules of the three packages it imports``. An import of ``a.b.c`` is an
    edge to ``a.b.c`` alone: that Python runs the ``__init__`` of ``a`` and ``a.b`` first is
    how packages work, not a dependency of the importer on them."""
    sources = {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    graph = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = imported_names(tree, module, path.name == "__init__.py", set(sources), type_checking)
        graph[module] = {name for name in names if name in sources and name != module}
    return graph


def top(module: str) -> str:
    return module.split(".")[0]


def assert_acyclic(graph: dict[str, set[str]]):
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle: {' <- '.join(err.args[1])}") from None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"moe_jax.config", "moe_jax.resolve", "sharding.exchange.ragged"} <= set(graph)
    assert_acyclic(graph)


def test_no_cycle_through_type_checking_imports_either():
    """Annotations too: the config, the registries and resolution once formed a cycle only
    type-checking imports closed."""
    assert_acyclic(import_graph(type_checking=True))


def test_imports_flow_one_way():
    """``sharding`` and ``pallas_kernels`` never import ``moe_jax``, nor each other."""
    forbidden = {"sharding": {"moe_jax", "pallas_kernels"}, "pallas_kernels": {"moe_jax", "sharding"}, "moe_jax": set()}
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if top(target) in forbidden[top(module)]
    )
    assert not wrong, wrong


def test_the_config_imports_no_registry():
    """The config only names implementations; ``resolve`` checks the names against the registries.
    It shares one type with the kernels, ``WeightFormat``, from a module that holds nothing else."""
    assert import_graph()["moe_jax.config"] <= {"moe_jax.auto", "pallas_kernels.weight_format"}


def test_the_config_loads_no_kernels_or_collectives():
    """``import moe_jax.config`` (hence the package) leaves the kernels, the exchanges and the
    registries that import them unloaded (``pallas_kernels.weight_format`` holds an enum only);
    resolving loads the registries."""
    heavy = "('pallas_kernels', 'sharding', 'moe_jax.expert_gemm', 'moe_jax.exchange')"
    light = "('pallas_kernels', 'pallas_kernels.weight_format')"
    script = (
        "import sys\n"
        "import moe_jax.config\n"
        f"print(sorted(m for m in sys.modules if (m in {heavy} or m.split('.')[0] in {heavy}) and m not in {light}))\n"
        "import moe_jax\n"
        "moe_jax.resolve(moe_jax.MoEConfig(num_experts=4, top_k=2, hidden_size=16, expert_intermediate_size=16))\n"
        f"print(sorted(m for m in sys.modules if m in {heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", str(sorted(eval(heavy)))], out.stdout


def test_every_registered_implementation_is_in_the_harness_parametrization():
    """The cross-product tests come from the registries: every name of EXPERT_GEMM and EXCHANGE
    (and every weight format) is in ``tests/harness.py``'s combinations, every exchange runs
    either without a mesh or under one there, and no test module outside the harness writes out
    a registry's full list of names (a newly registered implementation would miss its tests)."""
    import harness  # noqa: PLC0415 (tests/ is on sys.path under pytest)
    import moe_jax  # noqa: PLC0415

    generated = {axis: {combination[i] for combination in harness.COMBINATIONS}
                 for i, axis in enumerate(("expert_gemm", "exchange", "weight_format"))}
    assert generated["expert_gemm"] == set(moe_jax.EXPERT_GEMM.names())
    assert generated["exchange"] == set(moe_jax.EXCHANGE.names())
    assert generated["weight_format"] == set(moe_jax.WeightFormat)
    assert set(harness.EP_EXCHANGES) | set(harness.LOCAL_EXCHANGES) == set(moe_jax.EXCHANGE.names())
    ids = {p.id for p in harness.combinations()}
    assert len(ids) == len(harness.COMBINATIONS) == len(set(harness.COMBINATIONS))

    full_lists = {"EXPERT_GEMM": set(moe_jax.EXPERT_GEMM.names()), "EXCHANGE": set(moe_jax.EXCHANGE.names()),
                  "expert-parallel exchanges": set(harness.EP_EXCHANGES)}
    written_out = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "harness.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                strings = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                written_out += [f"{path.relative_to(ROOT)}:{node.lineno}: {which}"
                                for which, names in full_lists.items() if len(names) > 1 and names <= strings]
    assert not written_out, "lists of every registered name (take them from tests/harness.py):\n" + "\n".join(written_out)
