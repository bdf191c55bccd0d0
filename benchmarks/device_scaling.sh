#!/usr/bin/env bash
# Scaling scenario on a many-core machine (written for 16 cores), from a fresh checkout, in <= ~8 min.
#
#   OUT=/some/dir bash benchmarks/device_scaling.sh        # OUT defaults to ./benchmarks/results
#
# 1. makes sure .venv works (make .venv/.installed, else python3 -m venv + pip install -e .[test]);
#    matplotlib is installed if missing (plots are skipped when that fails),
# 2. runs benchmarks/run_load.py --scenario scaling at S = 1,2,4,8,12 (front-ends ceil(S/2);
#    driver processes + engine sim pinned to cores/4 cores, the server to the rest),
# 3. writes into $OUT: machine.txt, scaling.log, scaling-*.json / .md (the table) / .png, cleanup.txt.
# Every step has a timeout; the harness stops every server it starts (SIGTERM) even when timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/results}"
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }

{ echo "nproc: $(nproc)"; lscpu | grep -E 'Model name|^CPU\(s\)|NUMA node\(s\)'; free -g | head -2; uname -r; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

PY=.venv/bin/python
if ! "$PY" -c 'import shardserver, aiohttp, tinker, numpy, simdjson, tqdm' 2>/dev/null; then
  echo "[$(elapsed) s] installing .venv"
  timeout 300 make .venv/.installed PYTHON="${PYTHON:-python3}" \
    || { rm -rf .venv; timeout 300 bash -c 'python3 -m venv .venv && .venv/bin/pip install --quiet -e ".[test]"'; }
fi
"$PY" -c 'import matplotlib' 2>/dev/null || timeout 120 "$PY" -m pip install --quiet matplotlib \
  || echo "matplotlib unavailable: no plots"
echo "[$(elapsed) s] environment ready"

# Scale the load to the time left (the whole script must end by ~480 s).
LEFT=$(( 470 - $(elapsed) ))
PER=1024
if [ "$LEFT" -lt 300 ]; then PER=512; fi
if [ "$LEFT" -lt 150 ]; then PER=256; fi
RUN_LIMIT=$(( LEFT > 60 ? LEFT - 20 : 40 ))
echo "[$(elapsed) s] scaling runs: requests_per_shard=$PER, limit ${RUN_LIMIT} s"
timeout -k 30 "$RUN_LIMIT" "$PY" benchmarks/run_load.py --scenario scaling --shards 1,2,4,8,12 \
  --set "requests_per_shard=$PER" --set time_limit_s=120 --out "$OUT" --no-progress 2>&1 | tee "$OUT/scaling.log"
RC=${PIPESTATUS[0]}

{ echo "run_load exit code: $RC"
  echo "shardserver processes left: $(grep -l '^shardserver:' /proc/[0-9]*/cmdline 2>/dev/null | wc -l)"
  echo "/dev/shm segments left: $(ls /dev/shm 2>/dev/null | grep -c '^shardserver-')"
  echo "total time: $(elapsed) s"; } | tee "$OUT/cleanup.txt"
exit "$RC"
