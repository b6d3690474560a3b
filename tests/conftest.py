"""Test set-up: 8 virtual CPU devices (before jax is imported), XLA:CPU's cheapest code
generation, one compilation cache for the run, the GPU markers, and the collected test ids for
the GPU check.

Code generation (on a machine without a GPU): ``--xla_backend_optimization_level=0`` has LLVM skip its optimizations (it
changes no floating-point semantics: XLA:CPU does not enable fast math either way). The suite's
programs are tiny and compiled once, so compiling them fast matters and running them fast does
not: on tests/test_nonfinite_gradients.py it cut the CPU time by a quarter (106 -> 78 s).
(``--xla_llvm_disable_expensive_passes=true`` saved nothing there: 107 s.)

The cache: XLA compiling is most of the CPU suite's time, and many programs are compiled more
than once in a run: by both xdist workers, by ``jax.jit`` wrappers made afresh in each call, by
the subprocesses that run the examples and the benchmarks' smoke modes. JAX's persistent
compilation cache turns each repeat into a read. Its directory is made fresh by the first
process (pytest itself, or the xdist controller), reaches the workers and subprocesses through
the environment (``JAX_COMPILATION_CACHE_DIR``), and is removed when that process ends, so no
run reads another's programs. Every program is cached, however fast it compiled.
"""

import os
import shutil
import tempfile

# The optimization level only where there is no NVIDIA GPU: it would reach the GPU compiler too,
# and the GPU tests run full-size programs.
_NO_GPU = not os.path.exists("/dev/nvidiactl")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
     *(["--xla_backend_optimization_level=0"] if _NO_GPU else []),
     # XLA:CPU ends the process when a device thread reaches a collective too late (40 s by
     # default): 8 virtual devices on 2 busy cores did, in the expert-parallel gradient tests.
     *(["--xla_cpu_collective_call_terminate_timeout_seconds=1200",
        "--xla_cpu_collective_timeout_seconds=1200"] if _NO_GPU else [])]
).strip()
_OWN_CACHE_DIR = None
# Likewise the cache: the GPU check runs each program once, and its Triton kernels need not
# take a path the CPU suite never exercised.
if _NO_GPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-jax-tests-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


def _cuda_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    # The slow tests first (in their order), so that xdist's workers do not end on them, one
    # worker idle while the other runs a long test. A test with its own timeout marker needs more
    # than the GPU check's per-test limit (the serving soaks, ~130 s each on the H200): first too.
    # Then the tests that compile every exchange buffer size, so that a worker clears its jit
    # caches for them once (_worst_case_buffer_alone), not at each switch between the two kinds.
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None and item.get_closest_marker("timeout") is None,
                                 item.get_closest_marker("buffer_buckets") is None))
    gpus = len(_cuda_devices())
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("count", 1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {gpus}"))


# The tests marked large_gpu_memory on one xdist worker, one after another. A worker's GPU allocator
# keeps what it once held, so two of them on two workers of one 80 GB card run out of memory (seven
# did in one GPU check on an H100). xdist's own groups (``xdist_group``, --dist loadgroup) rename the
# tests they hold, and with pytest 9 not even that; so under --dist loadgroup the controller gives
# its workers a file (pytest_configure_node), each worker writes the marked tests' ids into it as
# it finishes collecting, and the scheduler, made once every worker has, reads it.
_LARGE_GPU_MEMORY_IDS = "moe_jax_large_gpu_memory_ids"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, for each worker: where the large_gpu_memory test ids go."""
    if node.config.getoption("dist") == "loadgroup":
        if not hasattr(node.config, "_moe_jax_large_ids"):
            directory = tempfile.mkdtemp(prefix="moe-jax-large-gpu-memory-")
            node.config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
            node.config._moe_jax_large_ids = os.path.join(directory, "ids.txt")
        node.workerinput[_LARGE_GPU_MEMORY_IDS] = node.config._moe_jax_large_ids


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under --dist loadgroup: xdist's group scheduling with the large_gpu_memory tests as one
    more group (each other test its own unit of work; xdist sends the largest group first)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling  # noqa: PLC0415 (xdist is optional)

    path = getattr(config, "_moe_jax_large_ids", None)

    class LargeGpuMemoryTogether(LoadGroupScheduling):
        _large = None

        def _split_scope(self, nodeid):
            if self._large is None:  # read once every worker has collected (and written it)
                if path is None or not os.path.exists(path):
                    raise RuntimeError(f"--dist loadgroup: no worker wrote the large_gpu_memory test ids ({path})")
                with open(path, encoding="utf-8") as f:
                    self._large = set(f.read().split("\n")) - {""}
            return "large_gpu_memory" if nodeid in self._large else super()._split_scope(nodeid)

    return LargeGpuMemoryTogether(config, log)


@pytest.hookimpl(tryfirst=True)  # before xdist tells the controller that collection is done
def pytest_collection_finish(session):
    """With MOE_JAX_COLLECTED_IDS=PATH, write the ids of the tests this run will run (after -m and
    -k), one a line: tools/gpu_check.sh gets them as the run starts, so a pass its time limit cuts
    off still says what it did not reach, and a continuation runs the rest of the same list
    (whatever optional packages its own collection would see). Under xdist every worker collects
    the same list (xdist checks that); the first writes it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    large_ids = getattr(session.config, "workerinput", {}).get(_LARGE_GPU_MEMORY_IDS)
    if large_ids:
        with open(f"{large_ids}.{worker}", "w", encoding="utf-8") as f:
            f.writelines(f"{item.nodeid}\n" for item in session.items if item.get_closest_marker("large_gpu_memory"))
        os.replace(f"{large_ids}.{worker}", large_ids)  # every worker collected the same tests
    path = os.environ.get("MOE_JAX_COLLECTED_IDS")
    xdist_controller = worker is None and (session.config.getoption("numprocesses", None) or 0) != 0
    if not path or xdist_controller or worker not in (None, "gw0"):
        return
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.writelines(f"{item.nodeid}\n" for item in session.items)
    os.replace(f"{path}.tmp", path)


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test run; its seed is shown with a failure.

    Set MOE_JAX_SEED to replay a failure.
    """
    seed = int(os.environ.get("MOE_JAX_SEED") or np.random.SeedSequence().entropy % (2**32))
    request.node.add_report_section("call", "seed", f"MOE_JAX_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def cpu_devices():
    """The 8 virtual CPU devices (also on a GPU machine, where they are not the default)."""
    return jax.devices("cpu")


#: Whether an exchange was traced with its worst-case buffer alone since the jit caches were
#: last cleared.
_ONE_BUFFER_TRACED = False


def _worst_case_alone(typical: int, worst: int) -> tuple[int, ...]:
    """``buffer_buckets`` with no bucket but the worst case (its argument checks included)."""
    global _ONE_BUFFER_TRACED
    from sharding.exchange.layout import buffer_buckets  # noqa: PLC0415 (after the XLA flags above)

    _ONE_BUFFER_TRACED = True
    return buffer_buckets(typical, worst, factors=())


@pytest.fixture(autouse=True)
def _worst_case_buffer_alone(request, monkeypatch):
    """On a machine without an NVIDIA GPU, each expert-parallel exchange compiles its worst-case
    buffer alone, unless the test is marked ``buffer_buckets``. (On a GPU machine every test
    compiles the buckets, as users' programs do: the GPU check runs each program once, and
    collectives in the switch's branches run on NCCL there.)

    An exchange picks its buffer among a few static sizes at run time
    (``sharding.exchange.layout.buffer_buckets``, a ``lax.switch`` in
    ``sharding.exchange.common.switch_on_size``), and each branch holds the whole exchange and
    the expert computation, so a layer on a mesh compiled two or three copies of itself: about
    half its compile time (benchmarks/NOTES.md, section 8). The choice changes no output: a
    bucket is taken only if it holds every row, the worst case holds every routing, and a
    capacity caps every bucket alike; ``padded``'s ``rows_sent``, which counts its buffer's
    padding, is the one statistic that differs. The marked tests run every bucket: each one
    taken, the overflow into the last, gradients through the switch and what communicates
    inside it (tests/test_exchange_buckets.py, tests/test_expert_parallel.py,
    tests/test_exchange_traffic.py). Subprocesses run the library as it is (a test comparing its
    programs with theirs bit for bit is marked).

    jit's caches do not know which sizes traced a program (two ``jax.jit`` of the same function
    share traces), so a marked test clears them if a single-size program may be among them
    (the marked tests run early, see ``pytest_collection_modifyitems``: once per worker).
    """
    global _ONE_BUFFER_TRACED
    if request.node.get_closest_marker("buffer_buckets") is not None:
        if _ONE_BUFFER_TRACED:
            jax.clear_caches()
            _ONE_BUFFER_TRACED = False
        return
    if not _NO_GPU:
        return
    import moe_jax  # noqa: PLC0415 (after the XLA flags above)

    for name in moe_jax.EXCHANGE.names():
        module = sys.modules[moe_jax.EXCHANGE[name].run.__module__]
        if hasattr(module, "buffer_buckets"):
            monkeypatch.setattr(module, "buffer_buckets", _worst_case_alone)
