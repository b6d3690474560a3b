#!/usr/bin/env bash
# Every test that runs on a GPU, on every visible GPU count, the demo, and one markdown record of
# it all, in one device call (10 minutes) on one H200.
#
# Usage, on the GPU machine, from anywhere in the repo (the device machine's copy has no .git,
# so the commit comes in through the environment):
#
#   GIT_COMMIT=<sha> [GIT_DIRTY=1] bash tools/gpu_check.sh "$OUT"
#
# Steps, each bounded by `timeout` so that a hang cannot eat the whole device call:
#   1. device.txt   GPU name, driver and memory (nvidia-smi); python, jax, jaxlib, flax, optax,
#                   triton versions; how many GPUs JAX sees.
#   2. demo.txt     `python3 -m moe_jax.cli demo` with no flags on one GPU, in the background
#                   beside pass 1 (its throughput then is not a measurement).
#   3. pass 1       pytest on one GPU (CUDA_VISIBLE_DEVICES=0), `-m "gpu or gpu_check" tests`:
#                   every test with a `gpu` marker (the native kernels, the Kimi K2 size and
#                   full-size layer tests, the serving soaks; gpu(count=2/4) ones skip with their
#                   reason) and every test marked `gpu_check` (it runs on the default backend and
#                   can behave differently on a GPU: the layer and router suites, a few NVFP4
#                   arithmetic tests). The rest runs the same code on the GPU machine as on CPU
#                   (Pallas interpret mode, lowering/cross-compiling for abstract GPUs, argument
#                   checks, host logic, tests on the 8 virtual CPU devices): CI runs it. The first
#                   worker writes the collected ids -> pass1_collected.txt, pytest_1gpu.xml,
#                   pytest_1gpu.txt.
#   4. pass 2       with >= 2 visible GPUs: `pytest -m gpu tests` on all of them, so the
#                   gpu(count=2) tests run and gpu(count=4) ones skip with their reason
#                   -> pytest_2gpu.xml, pytest_2gpu.txt. With one GPU the record says why not.
#   5. gpu_check.md rendered by tools/gpu_check_record.py from the files above; copy it to
#                   benchmarks/results/gpu_check.md. The script exits non-zero when any test
#                   failed or errored, a pass did not finish, or the demo failed.
#
# Overrides (all optional; every GPU_CHECK_* variable in effect is written into the record):
#   GPU_CHECK_PASS1="paths/args"   pytest paths (and args) of pass 1 (default: tests)
#   GPU_CHECK_MARKS="expr"         pass 1's marker expression (default: "gpu or gpu_check"; "" for all)
#   GPU_CHECK_PASS2="paths/args"   pytest selection of pass 2, run with -m gpu (default: tests)
#   GPU_CHECK_PASSES="1 2"         which passes to run (e.g. "2" for pass 2 in a call of its own)
#   GPU_CHECK_WORKERS=4            pytest-xdist workers per pass (0: no xdist). Default 4, or 2 where a
#                                  GPU has less than 100 GiB (an H100's 80): a worker that has run a
#                                  Kimi K2-size bf16 test keeps ~30 GB of GPU memory in its allocator,
#                                  so four need more than an H100 holds. Not more than 4: the tests
#                                  are compile- and host-bound, and 4 workers already slow each test
#                                  1.4-1.9x against running alone; at 5 (6e4061a) every file's tests
#                                  took 1.2-1.6x their 4-worker time (benchmarks/NOTES.md, section 7)
#   GPU_CHECK_BLAS_THREADS=N       NumPy's BLAS threads per pytest process (default: CPU cores /
#                                  workers, 4 on the H200 machine; 0: leave OPENBLAS_NUM_THREADS and
#                                  OMP_NUM_THREADS alone): four workers' float64 references with a
#                                  thread per core each would oversubscribe the cores
#   GPU_CHECK_BUDGET_S=540         seconds for the whole script (the device call allows 600; pass 1's
#                                  kill grace of 30 s and the record still fit)
#   GPU_CHECK_PASS1_S=450          upper bound for pass 1; the budget caps it too (~500 s after the
#                                  ~10 s device report; the demo runs beside it); pass 1 took 348 s
#                                  (0d59986) and 282 s (ef655ca) on one H200, ~545 s at bdd1fac on an
#                                  H100 at 2 workers (GPU_CHECK_BUDGET_S=590 GPU_CHECK_PASS1_S=550 may
#                                  then hold it in one call)
#   GPU_CHECK_DEMO_S=150           upper bound for the demo
#   GPU_CHECK_TEST_S=240           per-test limit, when pytest-timeout is installed (a test's own
#                                  timeout marker wins)
#   GPU_CHECK_SKIP_DEMO=1          do not run the demo (the record then says FAILED: the demo did not run;
#                                  0 or unset: run it)
#   GPU_CHECK_CONTINUE=DIR         finish a pass 1 that an earlier call at the same code left unfinished
#                                  (its time limit cut it off): DIR is that call's output folder (carry it
#                                  to the device machine: copied into the working tree untracked, e.g.
#                                  `cp -r <files_at>/gc gc_prev`, it travels with the tree; an H100 at 2
#                                  workers needs this second call, 2f15176's check). Pass 1 then runs
#                                  only the tests of DIR's pass1_collected.txt (the first call's
#                                  collection, not this call's: optional packages can change it) that
#                                  DIR's junit XML lacks; the record holds both calls and passes only if
#                                  together they ran every collected test and all passed. DIR may itself
#                                  be a continuation (a slow H100 once ran 345 of 467 tests in two calls,
#                                  5c326f2's check): its earlier calls come along (earlier_passes.spec,
#                                  call1_*, call2_*, ...) and this call runs what none of them ran.
#   PYTHON=python3                 the interpreter
set -uo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: GIT_COMMIT=<sha> [GIT_DIRTY=1] bash tools/gpu_check.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
out="$(cd "$1" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
start=$(date +%s)
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Several pytest workers share one GPU: none may take 75% of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

budget=${GPU_CHECK_BUDGET_S:-540}
# The smallest GPU's memory in MiB (none without nvidia-smi: the CPU tests of this script).
gpu_mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)"
default_workers=4
if [[ "$gpu_mib" =~ ^[0-9]+$ ]] && (( gpu_mib < 102400 )); then default_workers=2; fi
workers=${GPU_CHECK_WORKERS:-$default_workers}
left() { echo $(( budget - ($(date +%s) - start) )); }
min() { if (( $1 < $2 )); then echo "$1"; else echo "$2"; fi; }
max() { if (( $1 > $2 )); then echo "$1"; else echo "$2"; fi; }

# --- provenance ------------------------------------------------------------------------
commit="${GIT_COMMIT:-}"
if [[ -z "$commit" ]]; then commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"; fi
if [[ -n "${GIT_DIRTY:-}" ]]; then
  case "$GIT_DIRTY" in 0|no|false) dirty=0 ;; *) dirty=1 ;; esac
elif [[ -z "${GIT_COMMIT:-}" ]] && git rev-parse HEAD >/dev/null 2>&1; then
  if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then dirty=1; else dirty=0; fi
else
  dirty=unknown
fi
overrides="$(env | grep -E '^GPU_CHECK_[A-Z0-9_]+=' | sort | sed -E "s/=(.*)/='\1'/" | tr '\n' ' ')"
command="${overrides}${GIT_COMMIT:+GIT_COMMIT=$GIT_COMMIT }${GIT_DIRTY:+GIT_DIRTY=$GIT_DIRTY }bash tools/gpu_check.sh OUT"

# --- 1. device ---------------------------------------------------------------------------
{
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 \
      | sed 's/^/gpu: /' || echo "gpu: nvidia-smi failed"
  else
    echo "gpu: none (nvidia-smi not found)"
  fi
  timeout -k 10 120 "$PY" - <<'EOF' 2>&1
import importlib.metadata as metadata
import platform

print("python:", platform.python_version())
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "triton", "numpy"):
    try:
        print(f"{name}: {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        if "cuda" not in name:
            print(f"{name}: not installed")
import jax

try:
    gpus = jax.devices("gpu")
except RuntimeError as err:
    gpus = []
    print("jax gpu backend:", str(err).splitlines()[0])
print("jax_gpu_count:", len(gpus))
print("jax_devices:", ", ".join(f"{d.device_kind} (SM {getattr(d, 'compute_capability', '?')})" for d in gpus)
      or ", ".join(sorted({d.platform for d in jax.devices()})))
EOF
} > "$out/device.txt"
ngpu="$(sed -n 's/^jax_gpu_count: //p' "$out/device.txt" | tail -1)"
ngpu="${ngpu:-0}"
echo "== device ($ngpu GPU(s) visible to JAX)"; cat "$out/device.txt"

# --- 2. demo, in the background beside pass 1 ------------------------------------------------
# Its ~35 s (start-up and compiles, mostly host-bound) would otherwise come off pass 1's time; it
# shares the GPU with the tests, so its throughput line is not a measurement (the record says so).
record_args=()
demo_pid=
if [[ -n "${GPU_CHECK_SKIP_DEMO:-}" && "$GPU_CHECK_SKIP_DEMO" != 0 ]]; then
  echo "demo skipped (GPU_CHECK_SKIP_DEMO=$GPU_CHECK_SKIP_DEMO)" > "$out/demo.txt"
else
  echo "== moe-jax demo (no flags, one GPU), beside pass 1"
  (
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$(min "${GPU_CHECK_DEMO_S:-150}" "$(max 30 "$(left)")")" \
      "$PY" -m moe_jax.cli demo > "$out/demo.txt" 2>&1
    rc=$?
    echo "throughput above: measured beside the GPU check's tests, not a benchmark" >> "$out/demo.txt"
    echo "demo rc=$rc" >> "$out/demo.txt"
    exit "$rc"
  ) &
  demo_pid=$!
fi
# The demo's exit status, once it has ended (its own timeout bounds the wait).
finish_demo() {
  [[ -n "$demo_pid" ]] || return 0
  wait "$demo_pid"
  local rc=$?
  echo "== moe-jax demo: rc $rc"
  tail -12 "$out/demo.txt"
  record_args+=(--demo-rc "$rc")
}

# --- pytest passes -------------------------------------------------------------------------
pytest_opts=(-p no:cacheprovider -q --tb=short -o junit_family=xunit1 -o junit_logging=no)
# loadgroup: the tests marked large_gpu_memory run on one worker (tests/conftest.py).
if [[ "$workers" != 0 ]]; then pytest_opts+=(-n "$workers" --dist loadgroup); fi
blas_threads=${GPU_CHECK_BLAS_THREADS:-$(max 1 $(( $(nproc) / $(max 1 "$workers") )))}
blas_env=()
if [[ "$blas_threads" != 0 ]]; then blas_env=(OPENBLAS_NUM_THREADS="$blas_threads" OMP_NUM_THREADS="$blas_threads"); fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  # thread method: a test stuck inside a CUDA call is still stopped, by ending its worker, which
  # xdist reports as a crash with no traceback (the record says so). A test that needs longer
  # carries its own @pytest.mark.timeout.
  pytest_opts+=(--timeout="${GPU_CHECK_TEST_S:-240}" --timeout-method=thread)
fi

# The arguments as one shell line, for the record: single quotes around those that need them.
shell_line() {
  local arg words=()
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=+,@%-]+$ ]]; then words+=("$arg"); else words+=("'${arg//\'/\'\\\'\'}'"); fi
  done
  echo "${words[*]}"
}

# run_pass NAME LABEL SECONDS [env assignments --] pytest args...
run_pass() {
  local name=$1 label=$2 limit=$3; shift 3
  local envs=("${blas_env[@]}")
  while [[ $# -gt 0 && "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  local t0 rc
  t0=$(date +%s)
  echo "== pytest: $label (limit ${limit}s)"
  # SIGINT first: pytest then still writes the junit XML of the tests it finished.
  env "${envs[@]}" timeout -s INT -k 30 "$limit" "$PY" -m pytest "${pytest_opts[@]}" \
    --junitxml="$out/pytest_$name.xml" "$@" > "$out/pytest_$name.txt" 2>&1
  rc=$?
  tail -5 "$out/pytest_$name.txt"
  # Keep the log small enough to come back from the device machine.
  if [[ $(wc -c < "$out/pytest_$name.txt") -gt 8000000 ]]; then
    tail -c 8000000 "$out/pytest_$name.txt" > "$out/pytest_$name.tmp" && mv "$out/pytest_$name.tmp" "$out/pytest_$name.txt"
  fi
  local spec="$label|$rc|$(( $(date +%s) - t0 ))|pytest_$name.xml|pytest_$name.txt|${envs[*]} $PY -m pytest ${pytest_opts[*]} --junitxml=pytest_$name.xml $(shell_line "$@")"
  printf '%s\n' "$spec" > "$out/pass_$name.spec"  # what a GPU_CHECK_CONTINUE call reads back
  record_args+=(--pass "$spec")
}

# Pass 1: by marker, over every test file (tests/test_gpu_check_selection.py checks the rule).
# tests/conftest.py puts the tests with their own timeout marker (the serving soaks, ~100 s and
# ~45 s estimated at 79698bd's speed, on one worker) first, so that they run beside the rest
# instead of after it. xdist's load scheduling then packs the rest within 1% of longest-first
# (a replay of its scheduler with 79698bd's durations: 521 s against 517 s before this change's
# cuts, 443 s against 439 s after them).
pass1="${GPU_CHECK_PASS1:-tests}"
marks="${GPU_CHECK_MARKS-gpu or gpu_check}"
passes="${GPU_CHECK_PASSES:-1 2}"
if [[ -n "${GPU_CHECK_CONTINUE:-}" && " $passes " == *" 1 "* ]]; then
  prev="$(cd "$GPU_CHECK_CONTINUE" && pwd)" || exit 2
  commit1="$(sed -n 's/^- commit: `\([^`]*\)`.*/\1/p' "$prev/gpu_check.md" 2>/dev/null | head -1)"
  if [[ -z "$commit1" || ! -s "$prev/pass_1gpu.spec" || ! -s "$prev/pytest_1gpu.xml" || ! -s "$prev/pass1_collected.txt" ]]; then
    echo "GPU_CHECK_CONTINUE=$GPU_CHECK_CONTINUE: expected an earlier call's output" \
      "(gpu_check.md, pass_1gpu.spec, pytest_1gpu.xml, pass1_collected.txt)" >&2
    exit 2
  fi
  if [[ -e "$prev/call1_pytest_1gpu.xml" && ! -s "$prev/earlier_passes.spec" ]]; then
    echo "GPU_CHECK_CONTINUE=$GPU_CHECK_CONTINUE: a continuation without earlier_passes.spec (an older" \
      "gpu_check.sh made it): write its earlier calls' pass specs there, one a line, as pass_1gpu.spec has its own" >&2
    exit 2
  fi
  # The earlier calls' passes: those DIR continued (its earlier_passes.spec, their files alongside),
  # then DIR's own, each call's junit XML and log as callN_*. Its commit goes into the record: the
  # calls' commits must not differ in code (the device copy has no git to check that; whoever
  # commits the record does).
  calls=0
  if [[ -s "$prev/earlier_passes.spec" ]]; then
    cp "$prev/earlier_passes.spec" "$out/earlier_passes.spec"
    while IFS='|' read -r _ _ _ xml log _; do
      cp "$prev/$xml" "$prev/$log" "$out/" || exit 2
      calls=$((calls + 1))
    done < "$prev/earlier_passes.spec"
  else
    : > "$out/earlier_passes.spec"
  fi
  calls=$((calls + 1))
  for f in pytest_1gpu.xml pytest_1gpu.txt; do cp "$prev/$f" "$out/call${calls}_$f"; done
  IFS='|' read -r label1 rc1 s1 _ _ cmd1 < "$prev/pass_1gpu.spec"
  if (( calls == 1 )); then label1="$label1, first call"; fi
  printf '%s\n' "$label1 (commit $commit1)|$rc1|$s1|call${calls}_pytest_1gpu.xml|call${calls}_pytest_1gpu.txt|$cmd1" \
    >> "$out/earlier_passes.spec"
  earlier_xmls=()
  while IFS= read -r spec; do
    IFS='|' read -r _ _ _ xml _ <<< "$spec"
    record_args+=(--earlier-pass "$spec")
    earlier_xmls+=("$out/$xml")
  done < "$out/earlier_passes.spec"
  # The first call's list, not a collection of this call's: whatever optional packages are
  # installed here (705 against 683 tests when tokamax was present), the same tests are covered.
  cp "$prev/pass1_collected.txt" "$out/pass1_collected.txt"
  record_args+=(--collected pass1_collected.txt)
  mapfile -t pass1_left < <("$PY" tools/gpu_check_record.py --remaining "$out/pass1_collected.txt" "${earlier_xmls[@]}")
  echo "== continuing pass 1 of $prev: ${#pass1_left[@]} of $(wc -l < "$out/pass1_collected.txt") collected tests left"
  ordinals=(first second third fourth fifth sixth seventh eighth ninth)
  if (( ${#pass1_left[@]} )); then
    run_pass 1gpu "1 GPU (CUDA_VISIBLE_DEVICES=0), ${ordinals[calls]:-next} call" \
      "$(min "${GPU_CHECK_PASS1_S:-450}" "$(max 60 "$(( $(left) - 30 ))")")" \
      CUDA_VISIBLE_DEVICES=0 -- -m "$marks" "${pass1_left[@]}"
  fi
elif [[ " $passes " == *" 1 "* ]]; then
  # shellcheck disable=SC2086  # word splitting of the paths is intended
  run_pass 1gpu "1 GPU (CUDA_VISIBLE_DEVICES=0)" "$(min "${GPU_CHECK_PASS1_S:-450}" "$(max 60 "$(( $(left) - 30 ))")")" \
    CUDA_VISIBLE_DEVICES=0 MOE_JAX_COLLECTED_IDS="$out/pass1_collected.txt" -- -m "$marks" $pass1
  if [[ -s "$out/pass1_collected.txt" ]]; then
    record_args+=(--collected pass1_collected.txt)
  else
    echo "pass 1 wrote no pass1_collected.txt (tests/conftest.py writes it from the first worker):" \
      "the record cannot say which tests it did not reach, and no call can continue it" >&2
  fi
else
  record_args+=(--not-run "1 GPU (pass 1)|not selected (GPU_CHECK_PASSES='$passes')")
fi

finish_demo  # before pass 2, which takes every GPU
if [[ " $passes " != *" 2 "* ]]; then
  record_args+=(--not-run "all GPUs (pass 2)|not selected (GPU_CHECK_PASSES='$passes')")
elif (( ngpu >= 2 && $(left) - 15 < 60 )); then
  record_args+=(--not-run "all $ngpu GPUs (pass 2)|$(left) s of the ${budget} s budget left; run it in its own call: GPU_CHECK_PASSES=2 GPU_CHECK_SKIP_DEMO=1")
elif (( ngpu >= 2 )); then
  # shellcheck disable=SC2086
  run_pass 2gpu "all $ngpu GPUs" "$(( $(left) - 15 ))" -- -m gpu ${GPU_CHECK_PASS2:-tests}
else
  record_args+=(--not-run "all GPUs (pass 2)|JAX sees $ngpu GPU(s); the multi-GPU pass needs at least 2")
fi

# --- record ------------------------------------------------------------------------------
"$PY" tools/gpu_check_record.py "$out" --commit "$commit" --dirty "$dirty" --command "$command" \
  --seconds "$(( $(date +%s) - start ))" "${record_args[@]}"
