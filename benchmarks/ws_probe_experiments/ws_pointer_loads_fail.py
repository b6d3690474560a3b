from ws_requirements import *
@triton.jit
def mm_ptr(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    pid_m = tl.program_id(0); pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM); rn = pid_n * BN + tl.arange(0, BN); rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K // BK, warp_specialize=WS):
        a = tl.load(a_ptr + rm[:, None] * K + (k * BK + rk)[None, :])
        b = tl.load(b_ptr + rn[:, None] * K + (k * BK + rk)[None, :])
        acc = tl.dot(a, b.T, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))
r, k = comp(mm_ptr, sig, dict(BM=128, BN=128, BK=64, WS=True), 4, 3)
print("ptr loads", r)
