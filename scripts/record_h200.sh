#!/usr/bin/env bash
# Every GPU measurement of the suite in one pass, as recorded under data/ on the H200.
#
#   scripts/record_h200.sh OUT_DIR [STEP ...]
#
# Writes OUT_DIR/data/... (copy over data/ after reading it) and OUT_DIR/logs/STEP.log, and
# after every step packs both into OUT_DIR/record_h200.tar.gz (one file to bring back).
# Steps run in this order unless named; each has its own time limit, and one that fails or
# runs out of time is logged and the next one runs. The sweep-throughput step runs on the
# CPU cores beside the correctness steps (it never touches the GPU); the timing benchmarks
# run after it, alone. Needs papermill, nbformat, ipykernel, ipywidgets, distributed and
# filelock for the suite and sweep steps (make gpu-wheels brings them to a machine without
# a package index). LIMIT_<step>=SECONDS (dashes as underscores) changes one step's limit.
set -uo pipefail
out=${1:?usage: scripts/record_h200.sh OUT_DIR [STEP ...]}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gpu-tests capacity sweep kernels interrupt-cost suite capacity-renorm model-pools)
py=${PYTHON:-python}
mkdir -p "$out/data" "$out/logs"

run_step() {  # name, seconds, command...  (LIMIT_<step>=S overrides a step's limit, e.g. LIMIT_suite=500)
  local name=$1 limit=$2; shift 2
  local override="LIMIT_${name//-/_}"; limit=${!override:-$limit}
  local start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$out/logs/steps.txt"
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  echo "   $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$out/logs/steps.txt"
  tar -czf "$out/record_h200.tar.gz.part" -C "$out" data logs && mv "$out/record_h200.tar.gz.part" "$out/record_h200.tar.gz"
}

want() { printf '%s\n' "${steps[@]}" | grep -qx "$1"; }

sweep_pid=
if want sweep; then
  ( { "$py" -c 'import Cython; print("Cython", Cython.__version__)'; "$py" -m graphborrow build; } >"$out/logs/build.log" 2>&1
    run_step sweep 420 "$py" benchmarks/sweep_dask.py --workers 16,4,1 --out "$out/data/sweep_dask_h200_host.json" ) &
  sweep_pid=$!
fi
if want gpu-tests; then
  run_step gpu-tests 140 "$py" -m pytest -q -m gpu -rA -p no:cacheprovider --continue-on-collection-errors \
    tests/core/test_borrow_device.py tests/eagle/test_eagle_device.py tests/eagle/test_fused_verify_gpu.py \
    tests/core/test_borrow_interrupts.py tests/sim/test_sim_cuda_ops.py tests/studies/test_capacity_study.py tests/planning/test_capacity.py
  cp "$out/logs/gpu-tests.log" "$out/data/gpu_tests_h200.txt"
fi
want capacity && run_step capacity 120 "$py" benchmarks/capacity_gpu.py --out "$out/data/capacity_h200.json" --budget-s 90
[ -n "$sweep_pid" ] && wait "$sweep_pid"
want kernels && run_step kernels 110 "$py" benchmarks/verify_kernels.py --out "$out/data/verify_kernels_h200.json" \
  --budget-s 80
want interrupt-cost && run_step interrupt-cost 40 "$py" benchmarks/interrupt_cost.py --device cuda \
  --out "$out/data/interrupt_cost_h200.json"
if want suite; then
  run_step suite 150 "$py" -m graphborrow suite --device cuda --out "$out/suite" ${SUITE_ONLY:+--only $SUITE_ONLY} \
    -p HIDDEN 4096 -p INTERMEDIATE 14336 -p VOCAB 128256 -p PREFILL_TOKENS 8192 \
    -p LADDER "[64, 32, 16, 8, 4, 2, 1]" -p DRAFT_TOKENS 8
  mkdir -p "$out/data/notebooks_h200"
  find "$out/suite" -name '*.json' -path '*results*' -exec cp {} "$out/data/notebooks_h200/" \; 2>/dev/null
  mkdir -p "$out/logs/suite" && cp "$out"/suite/*.ipynb "$out"/suite/*.log "$out/logs/suite/" 2>/dev/null
  tar -czf "$out/record_h200.tar.gz" -C "$out" data logs
fi
want capacity-renorm && run_step capacity-renorm 60 "$py" benchmarks/capacity_gpu.py \
  --out "$out/data/capacity_h200_renorm.json" --top-k 50 --top-p 0.9 --batches 1,4,32,128 --budget-s 40
if want model-pools; then  # needs transformers (make gpu-wheels brings it); writes in place so the command stays portable
  run_step model-pools 420 "$py" benchmarks/model_pools.py --out data/models_h200
  mkdir -p "$out/data/models_h200" && cp data/models_h200/* "$out/data/models_h200/"
  tar -czf "$out/record_h200.tar.gz" -C "$out" data logs
fi
cat "$out/logs/steps.txt"
