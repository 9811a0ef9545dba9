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
# The generic path over checkpoints as transformers saves them (issue 44), each mode one 10-minute call:
#   bash tools/gpu_model_check.sh moe-plan   # CPU-side parts (runs anywhere): `tiermem plan` of the Qwen3-Next-80B-A3B
#                                            # shape at NEXT_LAYERS (default 6: 10.5 B params, 176 GiB of state, in HBM
#                                            # and DRAM), of DeepSeek-V3 at DS_LAYERS (5: 3 dense, 2 sparse) with
#                                            # DS_EXPERTS routed experts (64: 9.7 B params; a layer of all 256 is 11.3 B,
#                                            # more than one group streams on this machine: its refusal is printed),
#                                            # and of Qwen3-30B-A3B at QWEN_LAYERS (12) through the template and the
#                                            # generic path
#   bash tools/gpu_model_check.sh next       # tiermem-train, placement auto, STEPS (default 3) steps of 64 x 4096
#   bash tools/gpu_model_check.sh dsv3       # tokens of the Qwen3-Next shape / the DeepSeek-V3 shape through the
#                                            # generic path: the last step's seconds and TFLOP/s on active parameters
#                                            # (the run's note says which linear-attention kernels Qwen3-Next ran)
#   bash tools/gpu_model_check.sh qwen3moe   # the Qwen3-30B-A3B shape through the template and the generic path:
#                                            # each one's steps and the generic step over the template's (1.10 wanted)
# Wheels under .whl/ (flash-linear-attention, causal-conv1d, carried as the device README says) are installed
# first, so that the hybrid layers run their fast kernels.
# Details under $OUT; a short table prints last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; free -g | head -2; df -h /tmp | tail -1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
LAYERS=${LAYERS:-3}
summary=()
case "${1:-plan}" in plan|oss)
  python3 tools/make_shape_run.py --shape gpt-oss-120b --layers "$LAYERS" --dir /tmp/oss --accum 64 \
    --steps "${STEPS:-2}" --nvme /tmp/nvme >/dev/null;;
*)
  python3 tools/make_shape_run.py --shape qwen3-next-80b-a3b --layers "${NEXT_LAYERS:-6}" --dir /tmp/next \
    --accum 64 --steps "${STEPS:-3}" --nvme /tmp/nvme >/dev/null
  python3 tools/make_shape_run.py --shape deepseek-v3 --layers "${DS_LAYERS:-5}" --experts "${DS_EXPERTS:-64}" \
    --dir /tmp/dsv3 --accum 64 --steps "${STEPS:-3}" --nvme /tmp/nvme >/dev/null
  python3 tools/make_shape_run.py --shape qwen3-30b-a3b --layers "${QWEN_LAYERS:-12}" --dir /tmp/qmoe --accum 64 \
    --steps "${STEPS:-3}" --nvme /tmp/nvme >/dev/null;;
esac
last_step() {  # a run's trainer_log.jsonl and config.json [path] -> its last step's seconds, TFLOP/s on active params
  python3 - "$1" "$2" "${3:-template}" <<'PY'
import json, sys
from trainer.model.select import model_from_dict
rows = [json.loads(line) for line in open(sys.argv[1]) if '"loss"' in line]
active = model_from_dict(json.load(open(sys.argv[2])), path=sys.argv[3]).num_params(active=True)
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
  python3 -m trainer.plan_cli /tmp/oss/train.yaml --probe h200 > "$OUT/plan_oss.txt" 2>&1; rc=$?
  cat "$OUT/plan_oss.txt"
  summary+=("tiermem plan gpt-oss-120B at $LAYERS layers (rc $rc, $(python3 -c "print(f'{$(date +%s.%N) - $s:.1f}')") s): \
$(grep -E "^predicted step" "$OUT/plan_oss.txt")")
  python3 tools/make_shape_run.py --shape gpt-oss-120b --dir /tmp/oss36 --accum 64 --steps 1 --nvme /tmp/nvme \
    >/dev/null
  python3 -m trainer.plan_cli /tmp/oss36/train.yaml --probe h200 > "$OUT/plan_oss36.txt" 2>&1
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
moe-plan)
  for run in next:generic dsv3:generic qmoe:template qmoe:generic; do
    name=${run%:*} path=${run#*:}
    python3 -m trainer.plan_cli /tmp/$name/train.yaml --probe h200 tiermem_model_path=$path > "$OUT/plan_${name}_$path.txt" 2>&1
    rc=$?
    cat "$OUT/plan_${name}_$path.txt"
    summary+=("tiermem plan $name $path (rc $rc): $(grep -E "^(model|predicted step)|error" \
      "$OUT/plan_${name}_$path.txt" | tr '\n' ' ')")
  done
  python3 tools/make_shape_run.py --shape deepseek-v3 --layers 4 --dir /tmp/dsv3full --accum 64 --steps 1 \
    --nvme /tmp/nvme >/dev/null
  python3 -m trainer.plan_cli /tmp/dsv3full/train.yaml --probe h200 > "$OUT/plan_dsv3full.txt" 2>&1
  summary+=("tiermem plan DeepSeek-V3, 4 layers of all 256 experts (rc $?): $(tail -1 "$OUT/plan_dsv3full.txt")")
  ;;
next|dsv3)
  python3 -m trainer.cli /tmp/$1/train.yaml > "$OUT/train_$1.txt" 2>&1; rc=$?
  grep -vE "^(example|Human|Assistant)" "$OUT/train_$1.txt" | tail -14
  cp /tmp/$1/out/trainer_log.jsonl "$OUT/log_$1.jsonl" 2>/dev/null
  summary+=("$1 (generic path, rc $rc): $(grep -E "^note: the linear attention" "$OUT/train_$1.txt")")
  summary+=("  $(last_step /tmp/$1/out/trainer_log.jsonl /tmp/$1/model/config.json generic)")
  rm -rf /tmp/$1/out
  ;;
qwen3moe)
  for path in ${PATHS:-template generic}; do
    python3 -m trainer.cli /tmp/qmoe/train.yaml tiermem_model_path=$path > "$OUT/train_qmoe_$path.txt" 2>&1; rc=$?
    grep -vE "^(example|Human|Assistant)" "$OUT/train_qmoe_$path.txt" | tail -12
    cp /tmp/qmoe/out/trainer_log.jsonl "$OUT/log_qmoe_$path.jsonl" 2>/dev/null
    summary+=("Qwen3-30B-A3B ${QWEN_LAYERS:-12} layers, 64x4096 tokens, $path (rc $rc): \
$(last_step /tmp/qmoe/out/trainer_log.jsonl /tmp/qmoe/model/config.json)")
    rm -rf /tmp/qmoe/out
  done
  summary+=("generic / template, last step: $(python3 - "$OUT" <<'PY'
import json, sys
last = {p: [json.loads(x) for x in open(f"{sys.argv[1]}/log_qmoe_{p}.jsonl") if '"loss"' in x][-1]["step_seconds"]
        for p in ("template", "generic")}
print(f"{last['generic'] / last['template']:.3f}")
PY
)")
  ;;
esac
echo "== summary"; printf '%s\n' "${summary[@]}"
