"""The expert MLP op (``pallas_kernels.grouped_matmul.expert_mlp``) on its own: its forward and its
``jax.vjp`` against the float64 reference (``reference.expert_mlp`` and ``reference.expert_mlp_vjp``,
the chain rule written out in NumPy on the weights the kernels read).

Backend ``PALLAS`` in the Pallas interpreter on CPU, and its GPU twin with backend
``triton_lang.W4A16_BACKEND`` (W4A16, SM80-SM90). Weight formats: bf16 (trainable), NVFP4
(frozen: zero cotangent), NVFP4 with gate's and up's own global scales (``[E, 2]``, frozen), and
float masters with ``quantize=moe_jax.nvfp4.quantize`` (qat: the masters get the gradient of
their quantization). Every case has padding rows past ``sum(group_sizes)`` (no gradient) and an
expert without rows (a zero weight gradient). With many rows per expert the NVFP4 input gradients
go through one bf16 copy of the weights (``tuning.dequantize_for_input_grad``): the
``many_rows`` cases. Tolerances, relative Frobenius error: the output
1e-2 (bf16 rounding), the gradients 2e-2 (the kept gate/up product and the SwiGLU gradient are
rounded to bf16, where the reference keeps float64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import float_scatters
from test_grouped_matmul import _gpu_capability

from moe_jax import nvfp4
from pallas_kernels.grouped_matmul import PALLAS, expert_mlp, reference, tuning
from pallas_kernels.grouped_matmul.expert_mlp import token_rows

OUTPUT_TOLERANCE = 1e-2
GRADIENT_TOLERANCE = 2e-2
FORMATS = ["bf16", "nvfp4", "nvfp4_own_scales", "qat"]
TRAINABLE = ("bf16", "qat")


def _normal(rng, shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)


def _weights(rng, fmt: str, e: int, h: int, f: int):
    """``(w_gate_up [E, 2F, H], w_down [E, H, F], quantize)`` as the op takes them for ``fmt``.
    ``nvfp4_own_scales``: gate and up quantized separately, up 3-10x larger than gate, so that
    either half's scale applied to both would be far off."""
    w_gate_up, w_down = _normal(rng, (e, 2 * f, h)), _normal(rng, (e, h, f))
    match fmt:
        case "bf16":
            return w_gate_up.astype(jnp.bfloat16), w_down.astype(jnp.bfloat16), None
        case "nvfp4":
            return nvfp4.quantize(w_gate_up), nvfp4.quantize(w_down), None
        case "nvfp4_own_scales":
            gate, up = jnp.split(w_gate_up, 2, axis=1)
            up = up * jnp.asarray(rng.uniform(3, 10, (e, 1, 1)), jnp.float32)
            return nvfp4.concat_rows(nvfp4.quantize(gate), nvfp4.quantize(up)), nvfp4.quantize(w_down), None
        case "qat":  # float32 masters: their gradients come back in float32
            return w_gate_up, w_down, nvfp4.quantize
    raise AssertionError(fmt)


def _relative_error(got, want) -> float:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} non-finite values"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def token_row_transpose(row_token, defined: int, tokens: int, rng) -> jnp.ndarray:
    """int32 ``[T, k]``: each token's defined rows (``m < defined``) in a random order, ``k`` one
    more than the most any token has; the empty entries -1, past the rows, or padding rows (``m >=
    defined``, where a layer's exchanges put the rows of tokens routed elsewhere): all mean none."""
    # On the host: indexing a device array element by element is a transfer each (minutes on a GPU).
    token_m = np.asarray(row_token)[:defined]
    rows = [np.flatnonzero(token_m == t) for t in range(tokens)]
    width = max(map(len, rows)) + 1
    none = [-1, len(row_token), 2**31 - 1] + ([defined, len(row_token) - 1] if len(row_token) > defined else [])
    table = [list(rng.permutation(r)) + [none[(t + j) % len(none)] for j in range(width - len(r))]
             for t, r in enumerate(rows)]
    return jnp.asarray(np.array(table, np.int64), jnp.int32)


def _check(rng, fmt: str, groups: tuple[int, ...], padding: int, h: int, f: int, tokens: int = 0,
           transposed: bool = False, **kernel_args):
    """The fused forward, and ``jax.vjp``'s output and cotangents, against the float64 reference.
    With ``tokens``: the op reads its rows by index (``row_token_m``) from that many token rows,
    tokens repeated and unordered as a layer's top-k makes them; ``dx`` is then per token, and with
    ``transposed`` summed through each token's rows (``token_row_tk``)."""
    w_gate_up, w_down, quantize = _weights(rng, fmt, len(groups), h, f)
    m = sum(groups) + padding
    x_in = jnp.asarray(rng.standard_normal((tokens or m, h)), jnp.bfloat16)
    row_token = jnp.asarray(rng.integers(0, tokens, m), jnp.int32) if tokens else None
    x = x_in if row_token is None else x_in[row_token]
    dy = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    group_sizes = jnp.asarray(groups, jnp.int32)
    token_row = token_row_transpose(row_token, sum(groups), tokens, rng) if transposed else None
    op = functools.partial(expert_mlp, quantize=quantize, row_token_m=row_token, token_row_tk=token_row, **kernel_args)

    # The reference reads the weights the kernels read: qat masters through their quantization.
    read = (lambda w: w) if quantize is None else quantize

    @jax.jit
    def forward_and_vjp(x, group_sizes, w_gate_up, w_down, dy):
        y, pull = jax.vjp(lambda *args: op(args[0], group_sizes, *args[1:]), x, w_gate_up, w_down)
        return op(x, group_sizes, w_gate_up, w_down), y, pull(dy), (read(w_gate_up), read(w_down))

    y_fused, y, (dx, dw_gate_up, dw_down), (w_gate_up_ref, w_down_ref) = forward_and_vjp(x_in, group_sizes, w_gate_up,
                                                                                        w_down, dy)
    want_y = reference.expert_mlp(x, w_gate_up_ref, w_down_ref, group_sizes)
    want_dx, want_dw_gate_up, want_dw_down = reference.expert_mlp_vjp(x, w_gate_up_ref, w_down_ref, group_sizes, dy)
    s = want_y.shape[0]
    assert y.dtype == y_fused.dtype == jnp.bfloat16 and y.shape == (m, h)
    errors = {"y (fused)": _relative_error(y_fused[:s], want_y), "y (under vjp)": _relative_error(y[:s], want_y)}
    assert max(errors.values()) <= OUTPUT_TOLERANCE, errors
    if row_token is None:
        errors = {"dx": _relative_error(dx[:s], want_dx)}
        assert not np.any(np.asarray(dx[s:].astype(jnp.float32))), "padding rows got a gradient"
    else:  # each token's rows summed; a token only padding rows read gets none
        want_dx_t = np.zeros((tokens, h))
        np.add.at(want_dx_t, np.asarray(row_token[:s]), want_dx)
        assert dx.shape == x_in.shape and dx.dtype == x_in.dtype, (dx.shape, dx.dtype)
        unread = np.setdiff1d(np.arange(tokens), np.asarray(row_token[:s]))
        assert not np.any(np.asarray(dx[unread].astype(jnp.float32))), f"tokens {unread} got a gradient"
        errors = {"dx (per token)": _relative_error(dx, want_dx_t)}
    if fmt in TRAINABLE:
        for name, got, want, master in (("dw_gate_up", dw_gate_up, want_dw_gate_up, w_gate_up),
                                        ("dw_down", dw_down, want_dw_down, w_down)):
            assert got.dtype == master.dtype and got.shape == master.shape, (name, got.dtype, got.shape)
            empty = [e for e, size in enumerate(groups) if size == 0]
            assert not np.any(np.asarray(got[np.asarray(empty)].astype(jnp.float32))), f"{name}: experts {empty}"
            errors[name] = _relative_error(got, want)
    else:  # frozen NVFP4: a zero cotangent (float0 for the integer codes)
        for leaf in jax.tree.leaves((dw_gate_up, dw_down)):
            assert leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf.astype(jnp.float32)))
    assert max(errors.values()) <= GRADIENT_TOLERANCE, errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_interpret_forward_and_vjp_match_float64_reference(rng, fmt):
    _check(rng, fmt, groups=(9, 0, 14, 6), padding=8, h=64, f=64, backend=PALLAS, compute_capability=90,
           interpret=True)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_interpret_rows_read_by_index_match_float64_reference(rng, fmt):
    """``row_token_m``: 31 rows of 16 tokens (PALLAS gathers them in XLA; the W4A16 kernels read
    them in place, the GPU twin below)."""
    _check(rng, fmt, groups=(9, 0, 14, 6), padding=2, h=64, f=64, tokens=16, backend=PALLAS, compute_capability=90,
           interpret=True)


_READ_BY_INDEX = []


def _reading_rows_by_index(kernel):
    """``PALLAS``' ``kernel`` taking ``row_token_m`` as the native kernels do (the rows gathered
    here in XLA), recording whether it was given."""
    def by_index(x, *args, row_token_m=None, **kwargs):
        _READ_BY_INDEX.append(row_token_m is not None)
        return kernel(token_rows(x, row_token_m), *args, **kwargs)
    return by_index


#: ``PALLAS`` as a backend whose kernels read rows by index (``forward_reads_rows_by_index``).
ROWS_BY_INDEX = PALLAS._replace(name="PALLAS, rows by index", forward=_reading_rows_by_index(PALLAS.forward),
                                matmul=_reading_rows_by_index(PALLAS.matmul), forward_reads_rows_by_index=True)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_interpret_a_backend_reading_rows_by_index_gets_the_tokens(rng, fmt):
    """A backend that reads rows by index gets the tokens and ``row_token_m`` in its forward and
    in the gate/up matmul under differentiation (no ``[M, H]`` copy in XLA; the down matmul reads
    SwiGLU's rows as they are); forward and gradients against float64."""
    _READ_BY_INDEX.clear()
    _check(rng, fmt, groups=(9, 0, 14, 6), padding=2, h=64, f=64, tokens=16, backend=ROWS_BY_INDEX,
           compute_capability=90, interpret=True)
    assert _READ_BY_INDEX.count(True) == 2, _READ_BY_INDEX  # the fused forward, the gate/up matmul


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("backend", [PALLAS, ROWS_BY_INDEX], ids=["gathered", "by_index"])
def test_interpret_rows_read_by_index_with_their_transpose_match_float64_reference(rng, fmt, backend):
    """``token_row_tk`` (each token's rows, in any order, with empty entries on both sides of
    ``[0, M)``): the gradient of the tokens summed by a gather, against float64."""
    _check(rng, fmt, groups=(9, 0, 14, 6), padding=2, h=64, f=64, tokens=16, transposed=True, backend=backend,
           compute_capability=90, interpret=True)


def test_token_rows_transpose_sums_by_a_gather(rng):
    """With ``token_row_tk`` no floating-point scatter is left in the gradient (the sum of each
    token's rows is a gather); without it, the transpose of the gather is one (the check can fail)."""
    tokens, h, m = 16, 8, 40
    row_token = jnp.asarray(rng.integers(0, tokens, m), jnp.int32)
    token_row = token_row_transpose(row_token, m, tokens, rng)
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    grads = {}
    for name, transpose in (("scatter", None), ("gather", token_row)):
        fn = jax.jit(lambda x, t=transpose: jax.vjp(lambda x: token_rows(x, row_token, t), x)[1](dy)[0])
        grads[name] = np.asarray(fn(x), np.float64)
        scatters = float_scatters(fn.lower(x).as_text(dialect="hlo"))
        assert ((tokens, h) in scatters) == (transpose is None), (name, scatters)
    want = np.zeros((tokens, h))
    np.add.at(want, np.asarray(row_token), np.asarray(dy, np.float64))
    np.testing.assert_allclose(grads["gather"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads["scatter"], want, rtol=1e-6, atol=1e-6)


def test_token_row_transpose_is_checked():
    x = jnp.zeros((4, 8), jnp.bfloat16)
    row_token = jnp.zeros((6,), jnp.int32)
    args = (x, jnp.asarray([6], jnp.int32), jnp.zeros((1, 16, 8), jnp.bfloat16), jnp.zeros((1, 8, 8), jnp.bfloat16))
    kwargs = dict(backend=PALLAS, compute_capability=90, interpret=True)
    with pytest.raises(ValueError, match=r"^token_row_tk: given without row_token_m"):
        expert_mlp(*args, token_row_tk=jnp.zeros((4, 2), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match=r"^token_row_tk: int32\[3, 2\], expected int32 \[T, k\] with T = 4"):
        expert_mlp(*args, row_token_m=row_token, token_row_tk=jnp.zeros((3, 2), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match=r"^token_row_tk: float32\[4, 2\], expected int32"):
        expert_mlp(*args, row_token_m=row_token, token_row_tk=jnp.zeros((4, 2), jnp.float32), **kwargs)


def _many_rows(experts: int, rows: int = tuning.DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT) -> tuple[int, ...]:
    """Group sizes past ``rows`` per expert on average (by default
    :data:`tuning.DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT`), one expert empty and one a row over
    twice that."""
    groups = [rows + 5] * experts
    groups[1], groups[-1] = 0, 2 * rows + 1
    return tuple(groups)


def test_interpret_many_rows_per_expert_vjp_matches_float64_reference(rng):
    """The input gradients through the bf16 copy, with gate's and up's own global scales."""
    _check(rng, "nvfp4_own_scales", groups=_many_rows(3), padding=8, h=64, f=64, backend=PALLAS,
           compute_capability=90, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["few_rows", "many_rows", "by_index", "by_index_transposed", "copied_by_index"])
@pytest.mark.parametrize("fmt", [fmt for fmt in FORMATS if fmt != "bf16"])  # the native kernels take NVFP4 only
def test_gpu_triton_lang_forward_and_vjp_match_float64_reference(rng, fmt, rows):
    """``by_index``: the tokens' gradient by a scatter-add; ``by_index_transposed``: by each
    token's rows (``token_row_tk``, some entries naming padding rows, which the kernels leave
    unwritten); ``copied_by_index``: so many rows per expert that the forward goes through bf16
    copies of the weights (``tuning.dequantize_for_forward``), its gate/up reading rows by index."""
    triton_lang = pytest.importorskip("pallas_kernels.grouped_matmul.triton_lang", reason="needs triton")
    cc = _gpu_capability()
    if cc not in triton_lang.INPUT_GRAD_TILES:
        pytest.skip(f"SM{cc} has no W4A16 input-gradient kernel (W4A16 backward: SM80-SM90)")
    groups = _many_rows(8) if rows == "many_rows" else (150, 0, 3, 70, 1, 0, 40, 9)
    if rows == "copied_by_index":
        if cc not in tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT:
            pytest.skip(f"SM{cc}'s NVFP4 forward never goes through copies (no bf16 tiles)")
        groups = _many_rows(8, tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT[cc])
        assert tuning.dequantize_for_forward(num_rows=sum(groups), num_experts=8, hidden=256, intermediate=128,
                                             compute_capability=cc)
    # by_index: the gate/up kernel reads 273 rows from 61 tokens in place (row_token_m).
    by_index = rows.startswith("by_index")
    _check(rng, fmt, groups=groups, padding=37, h=256, f=128, tokens=61 if by_index else 0,
           transposed=rows == "by_index_transposed", backend=triton_lang.W4A16_BACKEND, compute_capability=cc)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ["few_rows", "many_rows", "by_index", "many_rows_by_index",
                                  "many_rows_by_index_transposed"])
def test_gpu_triton_lang_bf16_forward_and_vjp_match_float64_reference(rng, rows):
    """``triton_lang.BF16_BACKEND``: the native bf16 tiles forward, the input gradients through the
    Pallas kernel at few rows per expert and the native kernel's many-rows tile at many
    (``BF16_MANY_ROWS_PER_EXPERT``), the weight gradient likewise (the Pallas kernel, then from
    ``tuning.NATIVE_WEIGHT_GRAD_ROWS_PER_EXPERT`` the native one, rows by TMA); ``by_index``: the
    rows read from 61 tokens (the many-rows tiles reading them in the gate/up product under
    differentiation); ``_transposed``: the tokens' gradient summed through each token's rows
    (``token_row_tk``, some entries naming padding rows)."""
    triton_lang = pytest.importorskip("pallas_kernels.grouped_matmul.triton_lang", reason="needs triton")
    cc = _gpu_capability()
    if cc not in triton_lang.BF16_TILES:
        pytest.skip(f"SM{cc} has no native bf16 tiles (measured on SM90 only)")
    many = rows.startswith("many_rows")
    groups = _many_rows(8, triton_lang.BF16_MANY_ROWS_PER_EXPERT) if many else (150, 0, 3, 70, 1, 0, 40, 9)
    if many:
        assert triton_lang.bf16_many_rows_tile(triton_lang.Op.MATMUL, num_rows=sum(groups) + 37, num_experts=8,
                                               compute_capability=cc, transpose_w=True) is not None
    native_dw = sum(groups) + 37 >= tuning.NATIVE_WEIGHT_GRAD_ROWS_PER_EXPERT * len(groups)
    assert native_dw == many  # which weight gradient each case runs
    _check(rng, "bf16", groups=groups, padding=37, h=256, f=128, tokens=61 if "by_index" in rows else 0,
           transposed=rows.endswith("_transposed"), backend=triton_lang.BF16_BACKEND, compute_capability=cc)


def test_bad_arguments_raise_naming_the_argument():
    w_gate_up, w_down = (nvfp4.NVFP4Tensor(packed=jnp.zeros((2, n, k // 2), jnp.uint8),
                                           scales=jnp.ones((2, n, k // 16), jnp.float8_e4m3fn),
                                           global_scale=jnp.ones((2,), jnp.float32)) for n, k in ((128, 64), (64, 64)))
    x, group_sizes = jnp.zeros((4, 64), jnp.bfloat16), jnp.asarray([1, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"^backend: str, expected a Backend"):
        expert_mlp(x, group_sizes, w_gate_up, w_down, backend="pallas", compute_capability=90)
    with pytest.raises(ValueError, match=r"^row_token_m: int64\[4\], expected int32 \[M\]"):
        expert_mlp(x, group_sizes, w_gate_up, w_down, backend=PALLAS, compute_capability=90,
                   row_token_m=np.arange(4))
    with pytest.raises(ValueError, match=r"^x_mh: bfloat16\[0, 64\], expected \[T, H\] with T >= 1 rows"):
        expert_mlp(x[:0], group_sizes, w_gate_up, w_down, backend=PALLAS, compute_capability=90,
                   row_token_m=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"^w_gate_up: NVFP4 weights, expected float masters with quantize"):
        expert_mlp(x, group_sizes, w_gate_up, w_down, backend=PALLAS, compute_capability=90, quantize=nvfp4.quantize)
    triton_lang = pytest.importorskip("pallas_kernels.grouped_matmul.triton_lang", reason="needs triton")
    with pytest.raises(ValueError, match=r"^interpret: True, expected False"):
        expert_mlp(x, group_sizes, w_gate_up, w_down, backend=triton_lang.W4A16_BACKEND, compute_capability=90,
                   interpret=True)

