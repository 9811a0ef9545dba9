#!/usr/bin/env bash
# A change's speed against the code before it, on the GPU machine, in one command: tools/bench_train.py
# (tiermem only) in OLD (a copy of the repo at the earlier commit) and in this tree, alternating, REPS times each
# (default 2).
#   bash tools/bench_before_after.sh OLD_DIR [bench_train args, e.g. --batch 4 --accum 4 --steps 4]
# Prints each run's median s/step and the ratio of the medians (this tree / OLD).
set -uo pipefail
old=$(cd "$1" && pwd) || exit 2; shift  # absolute: each run cds into its tree
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
tag=$(echo "$*" | tr -c 'a-zA-Z0-9' '_')
for i in $(seq ${REPS:-2}); do
  for which in old new; do
    dir=$PWD; [ $which = old ] && dir=$old
    (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} python3 tools/bench_train.py --only tiermem "$@" \
      --json "$OUT/ab_${which}_${i}${tag}.json" > "$OUT/ab_${which}_${i}${tag}.txt" 2>&1)
    printf '%s run %s: %s\n' $which $i "$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['tiermem']['step_s'], 3))" "$OUT/ab_${which}_${i}${tag}.json" 2>/dev/null || echo failed)"
  done
done
python3 - "$OUT" "$tag" <<'PY'
import glob, json, statistics, sys
out, tag = sys.argv[1], sys.argv[2]
s = {w: [json.load(open(f))["tiermem"]["step_s"] for f in sorted(glob.glob(f"{out}/ab_{w}_*{tag}.json"))] for w in ("old", "new")}
print(f"before {statistics.median(s['old']):.3f} s/step ({s['old']}), after {statistics.median(s['new']):.3f} "
      f"({s['new']}): after/before {statistics.median(s['new']) / statistics.median(s['old']):.3f}")
PY
