#!/usr/bin/env bash
# The whole pipeline on the CPU, on the packaged SmolLM2-135M-Instruct and packaged ShareGPT
# conversations. `make demo` runs it inside .venv; outputs land in out/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${EYAS_DEMO_OUT:-out/demo}
MODEL=packaged:smollm2-135m
N=${EYAS_DEMO_SAMPLES:-200}
mkdir -p "$OUT"
rm -rf "$OUT/prepared"   # prepare is fast and always rewritten; capture below resumes

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
start=$(date +%s)

step "1/3 prepare: $N ShareGPT conversations, SmolLM2 chat template, assistant-only loss mask"
eyas prepare --model "$MODEL" --data packaged:sharegpt --out "$OUT/prepared" --limit "$N" --max-len 384
eyas prepare --show 0 "$OUT/prepared" | head -c 1500; echo

step "2/3 capture: hidden states at layer ids 2, 15, 27 (+30, the label source) on the CPU"
eyas capture --model "$MODEL" --data "$OUT/prepared" --out "$OUT/store" --batch-tokens 4096

step "3/3 inspect --verify: checksums, shapes, layer ids, NaN/inf"
eyas inspect "$OUT/store" --verify

step "done in $(( $(date +%s) - start )) s"
echo "prepared samples: $OUT/prepared   hidden-state store: $OUT/store"
