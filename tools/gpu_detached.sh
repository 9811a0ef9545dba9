#!/usr/bin/env bash
# A run longer than one device call (10 minutes), such as the 14B at the planner's recommended tokens a step:
# started in a process session of its own, it outlives the call that started it while the machine stays held
# (the next call must come within the machine's idle release, about 30 s); later calls watch it to its end.
#   bash tools/gpu_detached.sh start DIR CMD...     # CMD's output (timestamped) to DIR/log, its exit status to DIR/rc;
#                                                   # then watches it as `watch` does
#   bash tools/gpu_detached.sh watch DIR [SECONDS]  # wait up to SECONDS (default 560) for it to end; DIR copied
#                                                   # under $OUT; prints whether it ended and the log's tail
set -uo pipefail
mode=${1:?start or watch}; dir=${2:?a directory for the output of the run}; shift 2
case "$mode" in
start)
  [ $# -gt 0 ] || { echo "gpu_detached.sh start: no command" >&2; exit 2; }
  rm -rf "$dir"; mkdir -p "$dir"
  { printf 'cd %q || exit 1\n' "$PWD"; printf '%q ' "$@"; printf '\necho $? > %q.tmp && mv %q.tmp %q\n' \
    "$dir/rc" "$dir/rc" "$dir/rc"; } > "$dir/cmd.sh"
  setsid bash -c 'bash "$1/cmd.sh" 2>&1 | while IFS= read -r l; do echo "$(date +%T) $l"; done > "$1/log"' _ "$dir" \
    < /dev/null > /dev/null 2>&1 &
  exec bash "$0" watch "$dir" "${WAIT:-560}"
  ;;
watch)
  end=$((SECONDS + ${1:-560}))
  while [ ! -f "$dir/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  [ -n "${OUT:-}" ] && cp -r "$dir" "$OUT/" 2>/dev/null
  if [ -f "$dir/rc" ]; then echo "== ended, exit status $(cat "$dir/rc")"; else echo "== still running"; fi
  tail -n "${TAIL:-30}" "$dir/log" 2>/dev/null | cut -c1-600
  ;;
*) echo "gpu_detached.sh: start or watch, not $mode" >&2; exit 2 ;;
esac
