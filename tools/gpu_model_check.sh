#!/usr/bin/env bash
# gpt-oss in the template against the generic path on the GPU machine (the `device` tool); each mode fits one
# 10-minute call:
#   bash tools/gpu_model_check.sh plan   # CPU-side parts (runs anywhere): `tiermem plan` of gpt-oss-120B reduced to
#                                        # LAYERS layers (default 3: 10.8 B params, 181 GiB of state, what the H200
#                                        # machine's HBM + 125 GiB of RAM hold) at 64 x 4096 tokens a step, and of
#                                        # the whole 36-layer model (its one-line refusal here)
#   bash tools/gpu_model_check.sh oss    # the gpt-oss CUDA tests (flex attention with sinks against the
#                                        # materialised scores; the grouped stacked experts; SKIP_TESTS=1: none);
#                                        # then tiermem-train on that reduced shape, STEPS (default 2) steps of
#                                        # 64 x 4096 tokens, through each of PATHS (default "template generic";
#                                        # one path a call if both do not fit), printing the last step's seconds
#                                        # and its TFLOP/s on the active parameters (6 N_active tokens: each
#                                        # token's top-4 experts, the embedding and the head), the same figure
#                                        # for both paths
# Details under $OUT; a short table prints last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; free -g | head -2; df -h /tmp | tail -1
LAYERS=${LAYERS:-3}
summary=()
python3 tools/make_shape_run.py --shape gpt-oss-120b --layers "$LAYERS" --dir /tmp/oss --accum 64 \
  --steps "${STEPS:-2}" --nvme /tmp/nvme >/dev/null
last_step() {  # a run's trainer_log.jsonl and config.json -> its last step's seconds and TFLOP/s on active params
  python3 - "$1" "$2" <<'PY'
import json, sys
from trainer.model.config import model_config_from_dict
rows = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
active = model_config_from_dict(json.load(open(sys.argv[2]))).num_params(active=True)
r = rows[-1]
tokens = 64 * 4096
print(f"steps {' '.join('%.2f' % x['step_seconds'] for x in rows)} s; last step {r['step_seconds']:.2f} s = "
      f"{6 * active * tokens / r['step_seconds'] / 1e12:.0f} TFLOP/s on {active / 1e9:.2f} B active params; "
      f"losses {' '.join('%.3f' % x['loss'] for x in rows)}")
PY
}
case "${1:-plan}" in
plan)
  s=$(date +%s.%N)
  python3 -m trainer.plan_cli /tmp/oss/train.yaml > "$OUT/plan_oss.txt" 2>&1; rc=$?
  cat "$OUT/plan_oss.txt"
  summary+=("tiermem plan gpt-oss-120B at $LAYERS layers (rc $rc, $(python3 -c "print(f'{$(date +%s.%N) - $s:.1f}')") s): \
$(grep -E "^predicted step" "$OUT/plan_oss.txt")")
  python3 tools/make_shape_run.py --shape gpt-oss-120b --dir /tmp/oss36 --accum 64 --steps 1 --nvme /tmp/nvme \
    >/dev/null
  python3 -m trainer.plan_cli /tmp/oss36/train.yaml > "$OUT/plan_oss36.txt" 2>&1
  summary+=("tiermem plan gpt-oss-120B, 36 layers (rc $?): $(tail -1 "$OUT/plan_oss36.txt")")
  ;;
oss)
  if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py -k "sink or gpt_oss" > "$OUT/pytest_oss.log" 2>&1
    summary+=("test_cuda -k 'sink or gpt_oss': $(grep -E "passed|failed" "$OUT/pytest_oss.log" | tail -1)")
  fi
  for path in ${PATHS:-template generic}; do
    python3 -m trainer.cli /tmp/oss/train.yaml tiermem_model_path=$path > "$OUT/train_oss_$path.txt" 2>&1; rc=$?
    grep -vE "^(example|Human|Assistant)" "$OUT/train_oss_$path.txt" | tail -12
    cp /tmp/oss/out/trainer_log.jsonl "$OUT/log_oss_$path.jsonl" 2>/dev/null
    summary+=("gpt-oss-120B $LAYERS layers, 64x4096 tokens, $path (rc $rc): \
$(last_step /tmp/oss/out/trainer_log.jsonl /tmp/oss/model/config.json)")
    rm -rf /tmp/oss/out
  done
  ;;
esac
echo "== summary"; printf '%s\n' "${summary[@]}"
