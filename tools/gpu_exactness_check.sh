#!/usr/bin/env bash
# Exactness on the GPU, for the GPU machine (the `device` tool); each call fits its 10-minute limit:
#   bash tools/gpu_exactness_check.sh passes  # the multi-pass CUDA tests (8-layer Llama-3B shape, bf16 and fp32);
#                                             # OLD=DIR: first the bf16 one against an older tree (a copy of the
#                                             # repo at another commit, with this test file copied in)
#   bash tools/gpu_exactness_check.sh cuda    # the rest of tests/test_cuda.py
#   bash tools/gpu_exactness_check.sh bench   # the 3B shape at 64x4096 tokens a step: 1 pass against 4 passes
#   bash tools/gpu_exactness_check.sh long    # long rows (issue 39): a layer in sequence chunks against the whole
#                                             # layer (8B shape, 32k tokens), activations in DRAM against the CPU loop
# Details under $OUT; a short table prints last. Packages carried in (zarr, kvikio) may sit on PYTHONPATH.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h /tmp | tail -1
if [ "${1:-passes}" = passes ]; then
  if [ -n "${OLD:-}" ]; then
    (cd "$OLD" && PYTHONPATH=$PWD:${PYTHONPATH#*:} timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_cuda.py -k "several_passes and True" > "$OUT/pytest_old.log" 2>&1)
    echo "old tree, bf16 1/2/4 passes: $(grep -E "passed|failed" "$OUT/pytest_old.log" | tail -1)"
    grep -E "^E .*(vs|differ)" "$OUT/pytest_old.log" | head -3 | cut -c1-300
  fi
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py -k several_passes > "$OUT/pytest_passes.log" 2>&1
  echo "multi-pass tests: $(grep -E "passed|failed" "$OUT/pytest_passes.log" | tail -1)"
  grep -E "^E .*(vs|differ)" "$OUT/pytest_passes.log" | head -3 | cut -c1-300
elif [ "$1" = long ]; then
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py -k "long_row or activations_in_dram" \
    > "$OUT/pytest_long.log" 2>&1
  echo "long-row tests: $(grep -E "passed|failed" "$OUT/pytest_long.log" | tail -1)"
  grep -E "^(FAILED|E .*(error|assert))" "$OUT/pytest_long.log" | head -5 | cut -c1-300
elif [ "$1" = cuda ]; then
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py -k "not several_passes and not long_row and not \
    activations_in_dram" > "$OUT/pytest_cuda.log" 2>&1
  echo "rest of test_cuda: $(grep -E "passed|failed" "$OUT/pytest_cuda.log" | tail -1)"
  grep -E "^FAILED" "$OUT/pytest_cuda.log" | cut -c1-300
else
  for p in 1 4; do
    python3 tools/bench_train.py --only tiermem --batch 4 --accum 16 --steps 3 --warmup 1 --passes $p \
      --json "$OUT/passes_$p.json" 2>&1 | tee "$OUT/passes_$p.txt"
  done
  python3 - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/passes_{p}.json"))["tiermem"] for p in (1, 4))
print(f"3B shape, 64x4096 tokens a step: 1 pass {a['step_s']:.2f} s, 4 passes {b['step_s']:.2f} s "
      f"({b['step_s'] / a['step_s']:.3f}x); compute {a['compute_s']:.2f} -> {b['compute_s']:.2f} s; losses equal: "
      f"{a['losses'] == b['losses']}")
PY
fi
