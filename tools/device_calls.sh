#!/usr/bin/env bash
# The measurements queued for the next device session (benchmarks/NOTES.md, section 7, "Next"),
# one device call each, every step bounded by `timeout` so that a hang cannot eat the call's
# 600 s. Run on the GPU machine from the repository root, carrying `.whl` (the jax-triton wheel
# and `base_699d0b3.tgz`, `git archive 699d0b3 moe_jax pallas_kernels sharding | gzip`):
#
#   GIT_COMMIT=<sha> bash tools/device_calls.sh CALL /tmp/CALL; tar czf "$OUT/CALL.tgz" -C /tmp CALL
#   (branch: GIT_COMMIT=<the tree's sha> GIT_DIRTY=0 BASE=<main's commit> ... branch /tmp/branch)
#
# (the device tool brings back only a few files from $OUT, so a call's folders come back packed)
# CALL (in the order to run them; the GPU check itself is `tools/gpu_check.sh`, its own call):
#   layer     the Kimi K2 layer before (699d0b3's library) and after, same machine, then where
#             the 8192-token layer's time goes, as MoEConfig.kimi_k2 makes it and as NVIDIA's
#             export loads (bf16 shared expert and router); the router's top-k by formulation
#             (sort, padded for XLA's TopK kernel, k argmaxes) (~500 s)
#   probes    the W4A8 probe at 65536 and 8192 rows against the table kernels and the dense anchor,
#             then on irregular routing (every tile kind and its edges) (~300 s)
#   training  the bf16 training step and its GEMMs beside torch, with the steps that swap one part
#             (the weight gradient: native or Pallas; the input gradient's padding rows: kernel or
#             XLA's select), each step's kernels by time (--profile), then the native weight
#             gradient's tile sweep (~500 s)
#   w4a8      the Kimi K2 layer with and without W4A8 at prefill (prefill_activations='fp8') beside
#             torch's bf16 layer, then where the 8192-token layer's time goes both ways (~400 s)
#   ncu       Nsight Compute of the down projection at 65536 rows: the table kernel, the probe's
#             W4A16 and W4A8 (tensor pipe, issue slots, stalls; ~200 s)
#   wgrad     the native weight gradient (rows by TMA): its Kimi-size tests against float64, its
#             tile sweep beside the Pallas table tile and torch at 32768 and 8192 rows (~300 s)
#   layer_grads  the whole layer's training step (4096 tokens x 8, profiled) with main's library
#             (BASE=<sha>: .whl/base_<sha>.tgz, its own tree) and this tree's, alternating ROUNDS
#             times (default 2; ~75 s a round); WEIGHTS (default "nvfp4 bf16": bf16 and frozen
#             NVFP4 experts), EXPERTS (default 48; 384 is Kimi K2 on one GPU: NVFP4 only fits)
#   profile_ab the Kimi K2 layer's profile at 8192 tokens (where its GPU time goes, each XLA fusion
#             with its JAX op) with main's library (BASE=<sha>: .whl/base_<sha>.tgz, its own tree)
#             and this tree's, alternating ROUNDS times (default 2; ~70 s a profile): a change to
#             the layer's passes outside the expert kernels, measured where it acts (~300 s)
#   many_rows the NVFP4 expert MLP over fewer, larger experts (65536 rows over 48, 32, 24, 16, 8
#             and 6 experts: 1365-10923 rows per expert) through the W4A16 kernels and through
#             bf16 copies of the weights (triton_lang.dequantized_forward): where the copies pay
#             (tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT; ~250 s)
#   targets   the prefill-and-training issue's required figures in one call, meant for an H200 (its
#             targets are set on one): the routed GEMMs at 384 experts x 65536 rows against the dense
#             anchor (bf16 and NVFP4 table tiles, torch), the Kimi K2 layer at 32, 256 and 8192 tokens
#             (W4A16 and W4A8, torch, the floor), then the bf16 and frozen-NVFP4 training steps
#             (48 experts x 32768 rows, torch, the anchor) (~450 s; its steps' limits 560 s)
#   branch    a branch against main in one call: layer_grads (BASE, ROUNDS default 1; on an H100
#             bf16 weights only unless WEIGHTS says), then tools/gpu_check.sh at this tree's
#             commit (GIT_COMMIT) into "$out/gc" in what is left of CALL_S (default 585 s), or
#             not at all when less is left than it takes (340 s on an H200, 470 on an H100 at 2
#             workers): a check cut off at a commit that a later checkout recreates under
#             another hash is worth nothing. On an H200 it fits in one call (~200 + ~390 s).
# Each step's output goes to "$OUT/<step>"; a step that fails or runs out of time leaves what it
# wrote and the next step still runs; the script exits non-zero if any step failed.
set -u
call=${1:?usage: GIT_COMMIT=<sha> bash tools/device_calls.sh layer|probes|training|w4a8|ncu|wgrad|layer_grads|profile_ab|many_rows|targets|branch OUT}
out=${2:?usage: GIT_COMMIT=<sha> bash tools/device_calls.sh layer|probes|training|w4a8|ncu|wgrad|layer_grads|profile_ab|many_rows|targets|branch OUT}
case "$call" in
  layer|probes|training|w4a8|ncu|wgrad|layer_grads|profile_ab|many_rows|targets|branch) ;;
  *) echo "device_calls: unknown call '$call' (layer, probes, training, w4a8, ncu, wgrad, layer_grads, profile_ab, many_rows, targets, branch)"
     exit 2 ;;
esac
export GIT_COMMIT=${GIT_COMMIT:-unknown}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: a step may run from another tree
if ! python -c "import jax_triton" 2>/dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_calls: cannot install the jax-triton wheel from .whl/"; exit 2; }
fi
export PYTHONPATH=/tmp/site:$PWD
failed=0

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under timeout, its output in $out/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name (limit ${seconds} s): $*"
  local start=$SECONDS
  timeout --kill-after=20 "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc after $((SECONDS - start)) s"
  tail -n 5 "$out/$name.log"
  [ "$rc" -eq 0 ] || failed=1
}

base_tree() {  # the base library (BASE=<sha>: .whl/base_<sha>.tgz) in a tree of its own, /tmp/base
  base=${BASE:?"BASE=<main's commit>, whose library is .whl/base_<commit>.tgz"}
  mkdir -p /tmp/base && tar xzf ".whl/base_$base.tgz" -C /tmp/base && cp -r benchmarks /tmp/base/
}

layer_grads_ab() {  # layer_grads_ab ROUNDS WEIGHTS
  # train_step.py puts the tree it sits in first on sys.path: the base runs from a tree of its own
  base_tree
  # shellcheck disable=SC2086  # WEIGHTS is a list of words
  for i in $(seq "$1"); do
    step "layer_grads_base_$i" 110 env -C /tmp/base PYTHONPATH=/tmp/site python benchmarks/train_step.py \
      --out "$out/base_$i" --rows 32768 --layer --layer-weights $2 --experts "${EXPERTS:-48}" \
      --skip-bf16-steps --skip-gemms --xla-rows --profile 3 --budget-s 80 --commit "$base"
    step "layer_grads_$i" 110 python benchmarks/train_step.py --out "$out/tree_$i" --rows 32768 --layer \
      --layer-weights $2 --experts "${EXPERTS:-48}" --skip-bf16-steps --skip-gemms --xla-rows \
      --profile 3 --budget-s 80
  done
}

case "$call" in
  layer)
    # layer.py puts the tree it sits in first on sys.path, so the base runs from a tree of its own
    # (its page names the library it imported; 2f15176's call measured main twice without this)
    mkdir -p /tmp/base && tar xzf .whl/base_699d0b3.tgz -C /tmp/base && cp -r benchmarks /tmp/base/
    step layer_base_699d0b3 130 env -C /tmp/base PYTHONPATH=/tmp/site python benchmarks/layer.py \
      --out "$out/layer_base_699d0b3" --tokens 32 256 1024 8192 --iters 10 --impls "nvfp4 triton" "nvfp4 pallas" \
      --skip-torch
    step layer 170 python benchmarks/layer.py --out "$out/layer" --tokens 32 256 1024 8192 --iters 10
    step profile_8192 80 python benchmarks/profile_layer.py --out "$out/profile_8192" --tokens 8192 \
      --expert-gemm triton --calls 20
    step export_8192 60 python benchmarks/profile_layer.py --out "$out/export_8192" --tokens 8192 \
      --expert-gemm triton --shared-format bf16 --router-dtype bfloat16 --calls 10
    step router_topk 90 python benchmarks/router_topk.py --out "$out/router_topk"
    ;;
  probes)
    step fp8 190 python benchmarks/fp8_probe.py --out "$out/fp8" --rows 65536 8192 --budget-s 180 --kernels \
      "table w4a16" "bf16 table" "probe bf16" "probe fp8" "probe w4a16" "probe w4a8" "probe w4a8 s4"
    step probe_edges 90 python benchmarks/fp8_probe.py --out "$out/probe_edges" --rows 65536 --routing irregular \
      --shapes down --kernels "table w4a16" "probe fp8" "probe w4a8" "probe w4a16" --budget-s 80
    ;;
  training)
    step train_step 260 python benchmarks/train_step.py --out "$out/train_step" --rows 32768 --budget-s 220 \
      --profile 3
    step wgrad_native 240 python benchmarks/weight_grad_sweep.py "$out/wgrad_native.json" --kernel native
    ;;
  w4a8)
    step layer_w4a8 200 python benchmarks/layer.py --out "$out/layer_w4a8" --tokens 32 256 8192 --iters 10 \
      --impls "nvfp4 triton" "nvfp4 triton, W4A8 at prefill (prefill_activations='fp8')"
    step profile_w4a8_8192 90 python benchmarks/profile_layer.py --out "$out/profile_w4a8_8192" --tokens 8192 \
      --expert-gemm triton --prefill-activations fp8 --calls 20
    step profile_w4a16_8192 90 python benchmarks/profile_layer.py --out "$out/profile_w4a16_8192" --tokens 8192 \
      --expert-gemm triton --calls 20
    ;;
  ncu)  # one kernel launch each, in this order: table W4A16, probe W4A16, probe W4A8
    step ncu_down 240 ncu --clock-control none --kernel-name regex:"^_kernel" --launch-count 3 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --csv --page details \
      --log-file "$out/ncu_down.csv" python benchmarks/fp8_probe.py --out "$out/ncu_run" --rows 65536 --shapes down \
      --once --kernels "table w4a16" "probe w4a16" "probe w4a8"
    ;;
  profile_ab)
    # profile_layer.py puts the tree it sits in first on sys.path, as train_step.py does
    base_tree
    for i in $(seq "${ROUNDS:-2}"); do
      step "profile_base_$i" 120 env -C /tmp/base PYTHONPATH=/tmp/site GIT_COMMIT="$base" python \
        benchmarks/profile_layer.py --out "$out/base_$i" --tokens 8192 --expert-gemm triton --calls 20
      step "profile_$i" 120 python benchmarks/profile_layer.py --out "$out/tree_$i" --tokens 8192 \
        --expert-gemm triton --calls 20
    done
    ;;
  many_rows)
    for experts in 48 32 24 16 8 6; do
      step "many_rows_$experts" 75 python benchmarks/prefill_sweep.py --out "$out/experts_$experts" --runs 10 \
        --only mlp --experts "$experts" --rows 65536
    done
    ;;
  targets)
    step prefill 200 python benchmarks/prefill_sweep.py --out "$out/prefill" --runs 10 --tables-only \
      --only anchor bf16 nvfp4
    step layer 190 python benchmarks/layer.py --out "$out/layer" --tokens 32 256 8192 --iters 10 \
      --impls "nvfp4 triton" "nvfp4 triton, W4A8 at prefill (prefill_activations='fp8')"
    step train_step 170 python benchmarks/train_step.py --out "$out/train_step" --rows 32768 --nvfp4 \
      --xla-rows --skip-gemms --budget-s 130
    ;;
  layer_grads)
    layer_grads_ab "${ROUNDS:-2}" "${WEIGHTS:-nvfp4 bf16}"
    ;;
  branch)
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" in
      *H200*) weights="nvfp4 bf16" need=340 ;;
      *) weights=bf16 need=470 ;;
    esac
    layer_grads_ab "${ROUNDS:-1}" "${WEIGHTS:-$weights}"
    left=$((${CALL_S:-585} - SECONDS))  # since the script began
    if [ "$left" -lt "$need" ]; then
      echo "== gpu_check: not run, $left s left of CALL_S and it takes $need"; failed=1
    else
      echo "== gpu_check at $GIT_COMMIT in $left s"
      GPU_CHECK_BUDGET_S=$left GPU_CHECK_PASS1_S=$((left - 45)) bash tools/gpu_check.sh "$out/gc" || failed=1
    fi
    ;;
  wgrad)
    step wgrad_tests 90 python -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_kimi_size_gpu.py -k weight_grad
    step wgrad_native 240 python benchmarks/weight_grad_sweep.py "$out/wgrad_native.json" --kernel native
    ;;
esac
exit $failed
