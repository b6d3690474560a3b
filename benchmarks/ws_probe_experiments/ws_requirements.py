import re, sys, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def mm_desc(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr):
    a_d = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_d = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_d = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pid_m = tl.program_id(0); pid_n = tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        a = a_d.load([pid_m * BM, k * BK])
        b = b_d.load([pid_n * BN, k * BK])
        acc = tl.dot(a, b.T, acc)
    c_d.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))

@triton.jit
def mm_desc_persistent(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr, NUM_SMS: tl.constexpr):
    a_d = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_d = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_d = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    num_m = tl.cdiv(M, BM); num_n = tl.cdiv(N, BN); k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True, warp_specialize=WS):
        pid_m = tile // num_n; pid_n = tile % num_n
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(k_tiles):
            a = a_d.load([pid_m * BM, k * BK])
            b = b_d.load([pid_n * BN, k * BK])
            acc = tl.dot(a, b.T, acc)
        c_d.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))

def comp(fn, sig, consts, nw, ns, cc=90):
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig.get(a, "").startswith("*")})
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": nw, "num_stages": ns})
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    return dict(ws="ttg.warp_specialize" in ttgir, partitions=len(re.findall(r"partition\d+\(", ttgir)),
                setmaxnreg=len(re.findall(r"setmaxnreg", ptx)), shared=k.metadata.shared, nw=k.metadata.num_warps,
                tma="cp.async.bulk.tensor" in ptx, wgmma="wgmma" in ptx, regs=getattr(k, "n_regs", None)), k

sig = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", M="i32", N="i32", K="i32")
if __name__ == "__main__":
    triton.set_allocator = getattr(triton, "set_allocator", None)
    for ws in (False, True):
        for nw in (4, 8):
            try:
                r, k = comp(mm_desc, sig, dict(BM=128, BN=128, BK=64, WS=ws), nw, 3)
                print("nonpersistent ws", ws, "nw", nw, r)
            except Exception as e:
                print("nonpersistent ws", ws, "nw", nw, "FAIL", type(e).__name__, str(e)[:300])
            try:
                r, k = comp(mm_desc_persistent, sig, dict(BM=128, BN=128, BK=64, WS=ws, NUM_SMS=132), nw, 3)
                print("persistent ws", ws, "nw", nw, r)
            except Exception as e:
                print("persistent ws", ws, "nw", nw, "FAIL", type(e).__name__, str(e)[:300])
