#!/usr/bin/env bash
# The trainer's GPU check, for the GPU machine (the `device` tool), one call:
#   bash tools/gpu_train_check.sh [quick]
# Runs the trainer tests there (the CUDA ones included), the quickstart on the GPU through the real CLI,
# then tools/bench_train.py at 4x4096 and 16x4096 tokens a step (tiermem vs plain PyTorch). Details
# under $OUT; the benchmark tables print last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_train_parity.py tests/test_train_cli.py tests/test_train_units.py tests/test_data.py 2>&1 | tee "$OUT/pytest.log" | tail -4
python3 -m trainer.cli configs/quickstart.yaml plot_loss=false output_dir=/tmp/qs > "$OUT/quickstart.log" 2>&1
echo "quickstart rc=$?"; grep -E "eval_loss|done:" "$OUT/quickstart.log" | tail -3
python3 -m trainer.cli configs/quickstart_pt.yaml plot_loss=false output_dir=/tmp/qs_pt > "$OUT/quickstart_pt.log" 2>&1
echo "quickstart_pt rc=$?"; tail -1 "$OUT/quickstart_pt.log"
[ "${1:-}" = quick ] && exit 0
python3 tools/bench_train.py --batch 4 --accum 1 --json "$OUT/bench_4x4096.json" 2>&1 | tee "$OUT/bench_4x4096.txt"
python3 tools/bench_train.py --batch 4 --accum 4 --json "$OUT/bench_16x4096.json" 2>&1 | tee "$OUT/bench_16x4096.txt"
