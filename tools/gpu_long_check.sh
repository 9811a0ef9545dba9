#!/usr/bin/env bash
# The Qwen3-8B shape with YaRN RoPE trains one row of 204,800 tokens a step (issue 39), for the GPU machine (the
# `device` tool), one 10-minute call:
#   bash tools/gpu_long_check.sh          # tools/long_check.py: a random-weight Qwen3-8B (config.json only, a
#                                         # tokenizer that needs no download), chat rows cut to 204,800 tokens,
#                                         # tiermem-train on configs/llamafactory/qwen3_full_sft_256k.yaml as it is
#                                         # (rope_scaling: yarn, factor 5), STEPS steps (default 2: ~121 s each as
#                                         # planned on the H200 machine's file, plus start and the 16 GB export)
#   bash tools/gpu_long_check.sh --tiny   # the same on the CPU at a tiny size (anywhere)
# Also: --layers N (a shallower model), STEPS, DIR (model, data and run: /tmp/long-check), NVME (/tmp/nvme).
# The run's whole output under $OUT/long_check.txt (lines of the example row's text left out here); the table, and
# OK or FAILED with why, print last. Exit code 1 when a step's loss or grad norm is not finite or the run failed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; free -g | head -2; df -h /tmp | tail -1
nvme=()
case " $* " in *" --tiny "*) ;; *) mkdir -p "${NVME:-/tmp/nvme}"; nvme=(--nvme "${NVME:-/tmp/nvme}");; esac
dir=${DIR:-/tmp/long-check}
python3 tools/long_check.py --dir "$dir" --steps "${STEPS:-2}" "${nvme[@]}" "$@" 2>&1 | tee "$OUT/long_check.txt" | \
  awk 'length($0) < 400'
rc=${PIPESTATUS[0]}
cp "$dir/out/trainer_log.jsonl" "$dir/out/tiermem_plan.json" "$OUT/" 2>/dev/null
rm -rf "$dir/out"  # (the exported 16 GB: the disk's room for the next command)
exit "$rc"
