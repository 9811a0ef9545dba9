#!/usr/bin/env bash
# The store's GPU check, for the GPU machine (the `device` tool), one call:
#   bash tools/gpu_store_check.sh        (with .whl carried: ../shared/tools/offline-wheels.sh .whl)
# Installs the carried wheels (kvikio, zarr), runs the whole test suite there (the CUDA tests included),
# then `tiermem probe` with 2 GiB transfers on the disk and a 64 GiB arena setup. Details under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h . /dev/shm | tee "$OUT/df.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -8
mkdir -p .probe-disk
python3 -m tiermem.cli probe --size 2GiB --arena-size 64GiB --nvme-path .probe-disk --save "$OUT/probe.json"
rm -rf .probe-disk
# a tmpfs mounted with huge=always (where we may mount one): how fast a shared arena can be set up
mkdir -p /mnt/tiermem-huge && mount -t tmpfs -o huge=always,size=80G tmpfs /mnt/tiermem-huge 2>/dev/null \
  && python3 -c "
from tiermem.tiers.dram import DramArena
import time; t0 = time.perf_counter()
a = DramArena.create('huge-probe', 64 << 30, '/mnt/tiermem-huge', pin=True)
print(f'64 GiB arena on a huge=always tmpfs: {time.perf_counter() - t0:.2f} s (touch {a.touch_seconds:.2f} s, register {a.register_seconds:.2f} s)')
a.close()" ; umount /mnt/tiermem-huge 2>/dev/null
