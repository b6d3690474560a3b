"""CI proof, no GPU needed: every SM120 and SM100 tile configuration compiles and fits.

Each table entry is lowered for an abstract RTX PRO 6000 (SM120) or B200 (SM100) and compiled
with triton 3.6 for that target; the kernel must get the architecture-specific target, use a
tensor-core MMA, and fit the chip's shared memory per block. ``benchmarks/sm_crosscompile.py``
records the same compilations (registers, shared memory) under ``benchmarks/results/``.
"""

import platform

import pytest

# The test extra installs triton wherever its wheels exist (Linux x86-64, as on CI); there a
# missing triton is a broken install and must fail, not skip.
if not (platform.system() == "Linux" and platform.machine() == "x86_64"):
    pytest.skip("triton 3.6 wheels exist for Linux x86-64 only", allow_module_level=True)

from pallas_kernels.grouped_matmul import crosscompile  # noqa: E402

MMA_PREFIX = {120: "mma.sync.aligned.m16n8k16", 100: "tcgen05.mma"}


@pytest.mark.parametrize(
    "capability, key",
    [(cc, key) for cc in (120, 100) for key in crosscompile.table_keys(cc)],
    ids=lambda p: p if isinstance(p, int) else "-".join(part.value for part in p),
)
def test_table_entry_compiles_and_fits(capability, key):
    record = crosscompile.compile_config(capability, key)
    assert record.target == f"sm_{capability}a"
    assert any(m.startswith(MMA_PREFIX[capability]) for m in record.mma), record.mma
    assert 0 < record.shared_bytes <= record.shared_limit, record
    assert 0 < record.registers <= 255, record


@pytest.mark.parametrize(
    "capability, kernel",
    [(cc, kernel) for cc in (120, 100) for kernel in crosscompile.BACKWARD_KERNELS],
    ids=lambda p: p if isinstance(p, int) else "-".join(getattr(part, "value", part) for part in p),
)
def test_backward_kernel_compiles_and_fits(capability, kernel):
    """The training kernels (input and weight gradients) for SM120 and SM100, as above."""
    record = crosscompile.compile_backward(capability, *kernel)
    assert record.target == f"sm_{capability}a"
    assert any(m.startswith(MMA_PREFIX[capability]) for m in record.mma), record.mma
    assert 0 < record.shared_bytes <= record.shared_limit, record
    assert 0 < record.registers <= 255 and record.spill_bytes == 0, record
