#!/usr/bin/env bash
# The GPU benchmark of the Triton kernels and the engine: one script, parts that each run alone.
#
#   bench/gpu.sh                 # all parts, about 5 minutes on one H200
#   bench/gpu.sh correctness     # 1. each kernel vs its reference in bf16/fp16 (+ CUDA-graph check)
#   bench/gpu.sh kernels         # 2. prefill TFLOP/s and decode TB/s vs SDPA flash / cuDNN
#   bench/gpu.sh kernels-quick   #    a subset of 2 (~30 s)
#   bench/gpu.sh sweep           #    tile configurations of prefill and decode (~60 s; not in the default set)
#   bench/gpu.sh fp8             #    FP8 linear vs bf16 F.linear at Llama-3-8B shapes
#   bench/gpu.sh engine          # 3. TTFT and decode step vs transformers (sdpa, static+compile)
#   bench/gpu.sh engine-nocompile#    3 without torch.compile (saves 1-2 minutes)
#
# BENCH_CPU_SMOKE=1 bench/gpu.sh [part...] runs the same code paths on the CPU at toy sizes (Triton
# interpreter; the engine part becomes --dry-run): a check of the harness, not a measurement.
#
# Results: a table per part on stdout; JSON lines with GPU, commit and date in $OUT/results.jsonl
# (bench/out/ without OUT), for bench/RESULTS.md. Each part has its own time limit (PART_TIMEOUT_*;
# 90 + 90 + 30 + 90 s = the 5-minute budget; the first run also JIT-compiles every kernel),
# so one slow part cannot eat the others' time; a part that fails or times out is reported and the
# script goes on. Exit status: 0 if every part passed.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
unset TRITON_INTERPRET
export OUT="${OUT:-$PWD/bench/out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
# tandem must import as a package: the editable install maps tandem.kernels -> kernels/
if ! "$PY" -c "import tandem.kernels" 2>/dev/null; then
  echo "tandem is not installed; installing it in editable mode without dependencies" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >&2 || exit 2
fi

ENGINE_ARGS=(--compile)
if [ "${BENCH_CPU_SMOKE:-0}" != "0" ]; then ENGINE_ARGS=(--dry-run); fi
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(correctness kernels fp8 engine)
status=0
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || status=1
}
for part in "${parts[@]}"; do
  case "$part" in
    correctness)      run correctness "${PART_TIMEOUT_CORRECTNESS:-90}" "$PY" bench/gpu_correctness.py ;;
    kernels)          run kernels "${PART_TIMEOUT_KERNELS:-90}" "$PY" bench/gpu_kernels.py ;;
    kernels-quick)    run kernels-quick 60 "$PY" bench/gpu_kernels.py --quick ;;
    sweep)            run sweep 120 "$PY" bench/gpu_kernels.py --sweep ;;
    fp8)              run fp8 "${PART_TIMEOUT_FP8:-30}" "$PY" bench/gpu_fp8.py ;;
    engine)           run engine "${PART_TIMEOUT_ENGINE:-90}" "$PY" bench/gpu_engine.py "${ENGINE_ARGS[@]}" ;;
    engine-nocompile) run engine-nocompile 80 "$PY" bench/gpu_engine.py ;;
    *) echo "unknown part $part (correctness kernels kernels-quick sweep fp8 engine engine-nocompile)" >&2; exit 2 ;;
  esac
done
echo "results: $OUT/results.jsonl"
exit $status
