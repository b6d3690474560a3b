import triton, triton.language as tl
from ws_requirements import comp
from pallas_kernels.grouped_matmul.triton_lang import _dequantize_w4a16

@triton.jit
def kern4(ts_ptr, tend_ptr, te_ptr, x_ptr, w_ptr, s_ptr, out_ptr, M: tl.constexpr, E: tl.constexpr, K: tl.constexpr,
          N_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0); j = tl.program_id(1)
    row_start = tl.load(ts_ptr + t); row_end = tl.load(tend_ptr + t); expert = tl.load(te_ptr + t)
    x_d = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_d = tl.make_tensor_descriptor(w_ptr.to(tl.pointer_type(tl.int32)), shape=[E * N_OUT, K // 8], strides=[K // 8, 1], block_shape=[BLOCK_N, BLOCK_K // 8])
    s_d = tl.make_tensor_descriptor(s_ptr, shape=[E * N_OUT, K // 16], strides=[K // 16, 1], block_shape=[BLOCK_N, BLOCK_K // 16])
    n_k = tl.where(row_start < row_end, K // BLOCK_K, 0)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    w_row = expert * N_OUT + j * BLOCK_N
    for i in tl.range(0, n_k, warp_specialize=True):
        x = x_d.load([row_start, i * BLOCK_K])
        words = w_d.load([w_row, i * (BLOCK_K // 8)])
        sc = s_d.load([w_row, i * (BLOCK_K // 16)])
        wk = _dequantize_w4a16(words, sc, BLOCK_N, BLOCK_K)
        acc = tl.dot(wk, x.T, acc)
    local_m = tl.arange(0, BLOCK_M)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + (row_start + local_m)[None, :].to(tl.int64) * N_OUT + cols[:, None], acc.to(tl.bfloat16), mask=(row_start + local_m < row_end)[None, :])
sig = dict(ts_ptr="*i32", tend_ptr="*i32", te_ptr="*i32", x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16")
for bk, ns in ((256, 3), (128, 3)):
    try:
        r, k = comp(kern4, sig, dict(M=65536, E=384, K=2048, N_OUT=7168, BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk), 4, ns)
        print("w4a16 bk", bk, r, flush=True)
    except Exception as e:
        print("w4a16 bk", bk, "FAIL", type(e).__name__, str(e).splitlines()[-3:], flush=True)
