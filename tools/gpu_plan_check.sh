#!/usr/bin/env bash
# The planner on the GPU machine (the `device` tool); each mode fits one 10-minute call:
#   bash tools/gpu_plan_check.sh small   # tests/test_cuda.py; the 3B shape at 4x4096 and 16x4096 tokens a step,
#                                        # auto placement against plain PyTorch (measured / predicted step);
#                                        # `tiermem plan` of the 14B shape (its time)
#   bash tools/gpu_plan_check.sh 8b      # tiermem-train on the Llama-8B shape, 32x4096 tokens a step, auto
#                                        # placement with only an NVMe path set (STEPS, default 6)
#   bash tools/gpu_plan_check.sh 14b     # tiermem-train on the Qwen2.5-14B shape across HBM, DRAM and NVMe,
#                                        # after a full `tiermem probe` (ACCUM, default 64; STEPS, default 4; SEQ,
#                                        # tokens a row, default 4096;
#                                        # PROBE=FILE: a saved full probe of the machine instead; PROBE=run: the
#                                        # run's own quick probe, as a user's run without a probe file; SKIP_PLAN=1:
#                                        # no separate `tiermem plan` first; host memory and the disk's links
#                                        # sampled every 2 s to mem14b.txt). A run longer than one call:
#                                        # `bash tools/gpu_detached.sh start DIR env ACCUM=... bash tools/gpu_plan_check.sh 14b`
#   bash tools/gpu_plan_check.sh moe     # the MoE tests on CUDA; tiermem-train on Qwen3-30B-A3B's dimensions
#                                        # with LAYERS (default 20) layers, auto placement over the three tiers
#                                        # (ACCUM, default 4, of 4 rows; STEPS, default 6); `tiermem plan` of
#                                        # the whole 48-layer model (its one-line refusal; SKIP_TESTS=1: neither)
#   bash tools/gpu_plan_check.sh compute # issue 17: tests/test_cuda.py; tools/profile_step.py on the 3B shape at
#                                        # 16x4096 tokens with --keep each of KEEPS (default "0 auto") and FLAGS
#                                        # (e.g. --compile); bench_train 3B 16x4096 keep auto FLAGS against plain
#                                        # PyTorch; tiermem-train on the 8B shape at 16x4096 tokens with
#                                        # tiermem_keep_activations KEEP8 (default auto), torch_compile COMPILE8
#                                        # (default auto), torch_compile_mode MODE8 (default the config's)
# Details under $OUT; a short table prints last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h /tmp | tail -1
summary=()
steps_of() {  # step lines of a tiermem-train log -> measured median of steps 3.. and the prediction
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
t = [r["step_seconds"] for r in rows]
steady = t[2:] or t
pred = rows[-1].get("predicted_step_seconds")
tf = statistics.median(r["tflops"] for r in rows[2:] or rows)
print(f"steps {' '.join(f'{x:.2f}' for x in t)}; steady median {statistics.median(steady):.2f} s, {tf:.0f} TFLOP/s; "
      f"predicted {pred:.2f} s (measured/predicted {statistics.median(steady) / pred:.3f}); "
      f"grad norms {' '.join('%.3f' % r['grad_norm'] for r in rows)}; "
      f"collector pauses {' '.join('%.2f' % r.get('gc_seconds', float('nan')) for r in rows)} s")
PY
}
case "${1:-small}" in
small)
  if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py > "$OUT/pytest_cuda.log" 2>&1
    summary+=("test_cuda: $(grep -E "passed|failed" "$OUT/pytest_cuda.log" | tail -1)")
  fi
  for acc in ${ACCS:-1 4}; do
    python3 tools/bench_train.py --shape 3b --batch 4 --accum $acc --steps 5 --json "$OUT/b3_$acc.json" \
      > "$OUT/b3_$acc.txt" 2>&1
    tail -8 "$OUT/b3_$acc.txt"
    summary+=("3B $((4 * acc))x4096: $(grep -E "^ratio|^tiermem predicted" "$OUT/b3_$acc.txt" | tr '\n' ' ')")
  done
  [ -n "${SKIP_14B:-}" ] && { echo "== summary"; printf '%s\n' "${summary[@]}"; exit 0; }
  python3 tools/make_shape_run.py --shape 14b --dir /tmp/run14b --accum 64 --steps 1 --nvme /tmp/nvme >/dev/null
  s=$(date +%s.%N)
  python3 -m trainer.plan_cli /tmp/run14b/train.yaml > "$OUT/plan14b.txt" 2>&1
  summary+=("tiermem plan 14B: $(python3 -c "print(f'{$(date +%s.%N) - $s:.1f}')") s")
  cat "$OUT/plan14b.txt"
  ;;
8b)
  python3 tools/make_shape_run.py --shape 8b --dir /tmp/run8b --accum 32 --steps "${STEPS:-6}" --nvme /tmp/nvme \
    >/dev/null
  python3 -m trainer.plan_cli /tmp/run8b/train.yaml > "$OUT/plan8b.txt" 2>&1; cat "$OUT/plan8b.txt"
  python3 -m trainer.cli /tmp/run8b/train.yaml > "$OUT/train8b.txt" 2>&1; rc=$?
  grep -vE "^(example|Human|Assistant)" "$OUT/train8b.txt" | tail -20
  cp /tmp/run8b/out/trainer_log.jsonl "$OUT/log8b.jsonl" 2>/dev/null
  summary+=("8B 32x4096 auto (rc $rc): $(steps_of /tmp/run8b/out/trainer_log.jsonl); allocator retries \
$(python3 -c "import json; print(json.load(open('/tmp/run8b/out/store_stats.json'))['alloc_retries'])")")
  ;;
14b)
  probe_set=", probe: $OUT/probe.json"
  if [ "${PROBE:-}" = run ]; then probe_set=""  # (the run's quick probe: its figures land in tiermem_plan.json)
  elif [ -n "${PROBE:-}" ]; then cp "$PROBE" "$OUT/probe.json"  # (a full probe of this machine, saved before)
  else
    python3 -m tiermem.cli probe --size 2GiB --nvme-path /tmp/nvme --save "$OUT/probe.json" --reps 2 > "$OUT/probe.txt" 2>&1
    cat "$OUT/probe.txt"
  fi
  python3 tools/make_shape_run.py --shape 14b --dir /tmp/run14b --accum "${ACCUM:-64}" --steps "${STEPS:-4}" --seq "${SEQ:-4096}" \
    --nvme /tmp/nvme --set "tiermem={tiers: {nvme: {path: /tmp/nvme}}$probe_set}" >/dev/null
  if [ -z "${SKIP_PLAN:-}" ]; then  # (the run prints the same plan at its start)
    python3 -m trainer.plan_cli /tmp/run14b/train.yaml > "$OUT/plan14b.txt" 2>&1; cat "$OUT/plan14b.txt"
  fi
  # host memory every 2 s while it trains and exports (used, free, shared; dirty and writeback page cache)
  (while sleep 2; do echo "$(date +%T) $(free -m | awk 'NR==2{print "used", $3, "free", $4, "shared", $5}') \
$(grep -E '^(Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\n' ' ') rss_mb $(ps -o rss= -C python3 | sort -n | tail -1 | awk '{print int($1/1024)}') \
$(python3 -c "import json; l = json.load(open('/tmp/run14b/out/tiermem_stats.json'))['store']['links']; \
print(*(f\"{k} {l[k]['bytes'] / 1e9:.2f} GB {l[k]['busy_s']:.2f} s\" for k in ('nvme->dram', 'dram->nvme')))" 2>/dev/null)"
  done) > "$OUT/mem14b.txt" &
  sampler=$!
  python3 -m trainer.cli /tmp/run14b/train.yaml > "$OUT/train14b.txt" 2>&1; rc=$?
  kill $sampler; tail -4 "$OUT/mem14b.txt"; dmesg 2>/dev/null | grep -iE "killed process|out of memory" | tail -3
  grep -vE "^(example|Human|Assistant)" "$OUT/train14b.txt" | tail -20
  cp /tmp/run14b/out/trainer_log.jsonl /tmp/run14b/out/store_stats.json /tmp/run14b/out/tiermem_plan.json "$OUT/" \
    2>/dev/null
  [ -f "$OUT/store_stats.json" ] || python3 -c "import json, sys; json.dump(json.load(open(sys.argv[1]))['store'], \
open(sys.argv[2], 'w'))" /tmp/run14b/out/tiermem_stats.json "$OUT/store_stats.json"  # (the live one)
  ls -la /tmp/run14b/out | tail -8; df -h /tmp | tail -1
  summary+=("14B auto (rc $rc): $(steps_of /tmp/run14b/out/trainer_log.jsonl)")
  summary+=("$(python3 - "$OUT/store_stats.json" "$OUT/probe.json" "$OUT/tiermem_plan.json" "$OUT/mem14b.txt" <<'PY'
import json, os, re, sys
links = json.load(open(sys.argv[1]))["links"]
if os.path.exists(sys.argv[2]):  # a full probe: its raw O_DIRECT rates alone
    rows = {r["link"].split(" (")[0]: r["raw"] for r in json.load(open(sys.argv[2]))["rows"]}
    raw, src = {"r": rows["NVMe -> arena"], "w": rows["arena -> NVMe"]}, "the full probe's"
else:  # the run's quick probe (tiermem_plan.json): raw O_DIRECT alone
    m = json.load(open(sys.argv[3]))["machine"]
    raw, src = {"r": m["nvme_read"] / 1e9, "w": m["nvme_write"] / 1e9}, "the run's quick probe's"
for name, k in (("nvme->dram", "r"), ("dram->nvme", "w")):
    l = links[name]
    print(f"{name}: {l['bytes'] / 1e9:.1f} GB in {l['busy_s']:.1f} s busy = {l['gbps_avg']:.2f} GB/s, "
          f"{l['gbps_avg'] / raw[k]:.2f} of {src} raw {raw[k]:.2f} GB/s alone;", end=" ")
# each stretch of disk traffic the 2 s samples saw: its bytes each way at the raw rates one after the other,
# over the stretch's length (the disk both ways against the raw disk; +-2 s of sampling)
samples = []
for line in open(sys.argv[4]):
    got = re.search(r"^(\d+):(\d+):(\d+) .*nvme->dram ([\d.]+) GB [\d.]+ s dram->nvme ([\d.]+) GB", line)
    if got:
        h, mi, se, r, w = got.groups()
        samples.append((int(h) * 3600 + int(mi) * 60 + int(se), float(r), float(w)))
runs, cur = [], None
for (t0, r0, w0), (t1, r1, w1) in zip(samples, samples[1:]):
    if (r1, w1) != (r0, w0):
        cur = cur if cur is not None and t0 - cur[1] <= 6 else [t0, t1, 0.0, 0.0]
        cur[1], cur[2], cur[3] = t1, cur[2] + r1 - r0, cur[3] + w1 - w0
        if not runs or runs[-1] is not cur:
            runs.append(cur)
for t0, t1, r, w in runs:
    serial = r / raw["r"] + w / raw["w"]
    print(f"disk stretch of {t1 - t0} s: read {r:.1f} GB, wrote {w:.1f} GB = {serial:.1f} s at the raw rates one "
          f"after the other ({serial / (t1 - t0):.2f});", end=" ")
PY
)")
  ;;
moe)
  if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py -k "moe or plain" > "$OUT/pytest_moe.log" 2>&1
    summary+=("test_cuda -k 'moe or plain': $(grep -E "passed|failed" "$OUT/pytest_moe.log" | tail -1)")
    python3 tools/make_shape_run.py --shape qwen3-30b-a3b --dir /tmp/q30 --accum 16 --steps 1 --nvme /tmp/nvme >/dev/null
    python3 -m trainer.plan_cli /tmp/q30/train.yaml > "$OUT/plan_q30.txt" 2>&1
    summary+=("tiermem plan Qwen3-30B-A3B (rc $?): $(cat "$OUT/plan_q30.txt")")
  fi
  python3 tools/make_shape_run.py --shape qwen3-30b-a3b --layers "${LAYERS:-20}" --dir /tmp/qmoe --batch 4 \
    --accum "${ACCUM:-4}" --steps "${STEPS:-6}" --nvme /tmp/nvme >/dev/null
  python3 -m trainer.plan_cli /tmp/qmoe/train.yaml > "$OUT/plan_moe.txt" 2>&1; cat "$OUT/plan_moe.txt"
  python3 -m trainer.cli /tmp/qmoe/train.yaml > "$OUT/train_moe.txt" 2>&1; rc=$?
  grep -vE "^(example|Human|Assistant)" "$OUT/train_moe.txt" | tail -20
  cp /tmp/qmoe/out/trainer_log.jsonl "$OUT/log_moe.jsonl" 2>/dev/null
  summary+=("Qwen3-MoE ${LAYERS:-20} layers auto (rc $rc): $(steps_of /tmp/qmoe/out/trainer_log.jsonl); \
$(grep -E "^predicted step" "$OUT/plan_moe.txt")")
  rm -rf /tmp/qmoe/out /tmp/q30
  ;;
compute)
  if [ -z "${SKIP_TESTS:-}" ]; then
    python3 -m pytest -q -rf -p no:cacheprovider tests/test_cuda.py > "$OUT/pytest_cuda.log" 2>&1
    summary+=("test_cuda: $(grep -E "passed|failed" "$OUT/pytest_cuda.log" | tail -1)")
  fi
  if [ -z "${SKIP_3B:-}" ]; then
    for keep in ${KEEPS:-0 auto}; do
      python3 tools/profile_step.py --shape 3b --batch 4 --accum 4 --keep $keep ${FLAGS:-} --json "$OUT/prof3b_$keep.json" \
        > "$OUT/prof3b_$keep.txt" 2>&1
      grep -vE "^(predicted|plan|  )" "$OUT/prof3b_$keep.txt" | tail -32
      summary+=("profile 3B 16x4096 keep $keep ${FLAGS:-}: $(grep -E "^3b shape" "$OUT/prof3b_$keep.txt" | sed 's/.*; step/step/') \
$(grep -E "^step compute" "$OUT/prof3b_$keep.txt" | sed 's/.*s; standalone/standalone/')")
    done
    python3 tools/bench_train.py --shape 3b --batch 4 --accum 4 --steps 5 --keep auto ${FLAGS:-} --json "$OUT/b3_keep.json" \
      > "$OUT/b3_keep.txt" 2>&1
    tail -8 "$OUT/b3_keep.txt"
    summary+=("3B 16x4096 keep auto ${FLAGS:-}: $(grep -E "^ratio|^tiermem predicted" "$OUT/b3_keep.txt" | tr '\n' ' ')")
  fi
  python3 tools/make_shape_run.py --shape 8b --dir /tmp/run8k --batch 4 --accum 4 --steps "${STEPS:-6}" --nvme /tmp/nvme \
    --set "tiermem_keep_activations=${KEEP8:-auto}" "torch_compile=${COMPILE8:-auto}" \
    ${MODE8:+"torch_compile_mode=$MODE8"} >/dev/null
  python3 -m trainer.cli /tmp/run8k/train.yaml > "$OUT/train8k.txt" 2>&1; rc=$?
  grep -vE "^(example|Human|Assistant)" "$OUT/train8k.txt" | tail -24
  cp /tmp/run8k/out/trainer_log.jsonl "$OUT/log8k.jsonl" 2>/dev/null
  cp /tmp/run8k/out/tiermem_plan.json "$OUT/plan8k.json" 2>/dev/null
  cp /tmp/run8k/out/tiermem_stats.json "$OUT/stats8k.json" 2>/dev/null  # (the optimizer's split of its last update)
  summary+=("8B 16x4096 keep ${KEEP8:-auto} torch_compile ${COMPILE8:-auto} ${MODE8:-} (rc $rc): $(steps_of /tmp/run8k/out/trainer_log.jsonl)")
  rm -rf /tmp/run8k/out
  ;;
esac
echo "== summary"; printf '%s\n' "${summary[@]}"
