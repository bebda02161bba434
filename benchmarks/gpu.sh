#!/usr/bin/env bash
# The GPU evidence run: unattended, on a machine with nothing but this repository and ../shared.
#
#   bash benchmarks/gpu.sh [--device cuda|cpu] [--out DIR] [--config FILE] [--merged DIR|none]
#                          [--quick] [--set k=v]...
#
# Sets up (make setup), runs the engine benchmark (python -m benchmarks.engine) in a private workspace
# under DIR (it splits MBPP there) on the embedded pair, eager and compiled (the step loop's pass
# as engine.compile compiles it; bf16 on a GPU), then a short bench of the distilled draft if this
# checkout has one (--merged, default artifacts/merged).
# Everything lands in DIR (default: gpu-evidence-<date>): engine.json/.md, bench/, logs, and
# summary.txt. Each step has a time limit so the whole run fits in 10 minutes; a step that fails
# or runs out of time is recorded in summary.txt and the run goes on.
# `--device cpu` runs the same steps on the CPU (the suite runs it with --quick).
set -uo pipefail

DEVICE=cuda
OUT=""
CONFIG=configs/default.yaml
QUICK=0
MERGED=artifacts/merged
SETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --merged) MERGED="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --set) SETS+=("--set" "$2"); shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu.sh: --device must be cuda or cpu" >&2; exit 2 ;; esac

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-evidence-$(date -u +%Y%m%d-%H%M)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ART="$OUT/artifacts"
SUMMARY="$OUT/summary.txt"
PY="${PY:-.venv/bin/python}"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, record the outcome.
step() {
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s; log $name.log)"
  return $rc
}

note "phoenix gpu.sh $(date -u +%FT%TZ) device=$DEVICE config=$CONFIG quick=$QUICK"
note "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$SUMMARY" 2>&1 \
    || note "nvidia-smi: not available"
fi
grep -m1 'model name' /proc/cpuinfo >> "$SUMMARY" 2>/dev/null

if [ ! -x "$PY" ]; then
  step setup 300 make setup || { note "setup failed: stopping"; exit 1; }
fi

DEV=(--set "models.device=$DEVICE")
[ "$DEVICE" = cuda ] && DEV+=(--set models.dtype=bfloat16)
ARGS=(--config "$CONFIG" --artifacts "$ART" "${DEV[@]}" "${SETS[@]}")

if [ "$QUICK" = 1 ]; then
  ENGINE=(--prompts 2 --tokens 8 --parts generate --self-draft 2)
  LIMIT=300
else
  ENGINE=(--prompts 4 --tokens 64 --steps 40 --parts steps generate server)
  LIMIT=420
fi
# The distilled draft of this checkout, when there is one, is measured too.
if [ "$MERGED" != none ] && [ -f "$MERGED/config.json" ]; then
  mkdir -p "$ART" && rm -rf "$ART/merged" && cp -r "$MERGED" "$ART/merged"
fi
step engine "$LIMIT" "$PY" -m benchmarks.engine "${ENGINE[@]}" "${ARGS[@]}"
cp "$ART/perf/engine.json" "$ART/perf/engine.md" "$OUT/" 2>/dev/null

if [ -f "$ART/merged/config.json" ]; then
  step bench 150 "$PY" -m pipeline bench "${ARGS[@]}" --draft distilled \
    --set bench.prompts=10 --set bench.max_new_tokens=64
  cp -r "$ART/bench" "$OUT/bench" 2>/dev/null
else
  note "bench: skipped (no distilled draft: --merged $MERGED)"
fi
rm -rf "$ART/cache/models"  # converted weights: large, and rebuilt from the package
note "done: $OUT"
