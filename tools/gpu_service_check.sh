#!/usr/bin/env bash
# The service's GPU check, for the GPU machine (the `device` tool); each call fits its 10-minute limit:
#   bash tools/gpu_service_check.sh tests    # the CUDA tests and the service's tests
#   bash tools/gpu_service_check.sh more     # checkpoint + trainer CLI tests, the quickstart attached on the GPU
#   bash tools/gpu_service_check.sh planned  # issue 43: bench_service --planned, the 3B and the 8B (NVMe in
#                                            # /tmp/nvme) at 16x4096, with where each waited; the medians of steps
#                                            # 5-6 (the service splits its updates again from update 4); ~480 s
#   bash tools/gpu_service_check.sh bench    # bench_service at 16x4096 and 4x4096 tokens a step (OPTIM=1:
#                                            # first bench_optim, the service's crash-safe CPU AdamW variants)
#   (SHARE: the embedded run's gpu_share; ATTACHED_SHARE=0.7,1: one attached run per share;
#    CPU_GROUPS=spread,last: ... per share and the service's optimizer.cpu_groups)
# Details under $OUT; tables print last. Packages carried in (zarr, kvikio) may sit on PYTHONPATH: the
# tests' subprocesses keep it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; df -h /dev/shm | tail -1; nproc
if [ "${1:-tests}" = tests ]; then
  # three pytest processes at once (each test starts several Python processes; 16 cores)
  KILLS="kill or sigterm or bf16 or state_lost"
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py > "$OUT/pytest_cuda.log" 2>&1 &
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_service.py -k "$KILLS" > "$OUT/pytest_kills.log" 2>&1 &
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_service.py -k "not ($KILLS)" > "$OUT/pytest_rest.log" 2>&1 &
  wait
  for f in cuda kills rest; do echo "$f: $(grep -E "^FAILED|passed|failed|skipped" "$OUT/pytest_$f.log" | cut -c1-300)"; done
elif [ "$1" = planned ]; then
  for shape in 3b 8b; do
    rm -rf /dev/shm/tiermem* /dev/shm/bench* /tmp/nvme 2>/dev/null
    python3 tools/bench_service.py --batch 4 --accum 4 --planned --steps 6 --skip 4 --shape $shape \
      $([ $shape = 8b ] && echo --nvme /tmp/nvme) --json "$OUT/service_$shape.json" > "$OUT/service_$shape.txt" 2>&1
    echo "$shape rc $?"
  done
  rm -rf /tmp/nvme
  for shape in 3b 8b; do echo "-- $shape"; sed -n '/^run /,$p' "$OUT/service_$shape.txt" | cut -c1-330; done
elif [ "$1" = more ]; then
  python3 -m pytest -q -rf -p no:cacheprovider tests/test_checkpoint.py tests/test_train_cli.py \
    > "$OUT/pytest_more.log" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/pytest_more.log" | cut -c1-300
  printf 'name: qs-gpu\ntiers: {dram: {path: /dev/shm, budget: 2GiB}}\n' > /tmp/serve.yaml
  python3 -m tiermem.cli serve --config /tmp/serve.yaml --socket /tmp/qs.sock > "$OUT/serve.log" 2>&1 &
  sleep 5
  python3 -m trainer.cli configs/quickstart.yaml tiermem=null tiermem_server=/tmp/qs.sock plot_loss=false \
    output_dir=/tmp/qs > "$OUT/quickstart_attached.log" 2>&1
  echo "quickstart attached rc=$?"; grep -E "attached|eval_loss|done:" "$OUT/quickstart_attached.log" | tail -4
  python3 -m tiermem.cli top --once --socket /tmp/qs.sock > "$OUT/top_idle.txt" 2>&1; head -3 "$OUT/top_idle.txt"
  kill -TERM %1; wait; tail -3 "$OUT/serve.log"
else
  [ "${OPTIM:-0}" = 1 ] && python3 tools/bench_optim.py --threads 14 --reps 3 2>&1 | tee "$OUT/bench_optim.txt"
  python3 tools/bench_service.py --batch 4 --accum 4 --steps 5 ${SHARE:+--share $SHARE} ${ATTACHED_SHARE:+--attached-share $ATTACHED_SHARE} ${CPU_GROUPS:+--attached-cpu-groups $CPU_GROUPS} --json "$OUT/service_16x4096.json" 2>&1 | tee "$OUT/service_16x4096.txt"
  python3 tools/bench_service.py --batch 4 --accum 1 --steps 7 ${SHARE:+--share $SHARE} ${ATTACHED_SHARE:+--attached-share $ATTACHED_SHARE} ${CPU_GROUPS:+--attached-cpu-groups $CPU_GROUPS} --json "$OUT/service_4x4096.json" 2>&1 | tee "$OUT/service_4x4096.txt"
fi
