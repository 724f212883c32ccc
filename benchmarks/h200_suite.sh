#!/usr/bin/env bash
# One device call: CUDA checks of the fused path, the link probe, and decode of the 48-layer model
# in every mode (benchmarks/decode_h200.py); optionally the built-in server (SERVE=1).
# Run in the repo root on the H200 machine; everything lands in $OUT (<= 8 files).
#   OUT=out bash benchmarks/h200_suite.sh
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DECODE_DEADLINE_S="${DECODE_DEADLINE_S:-200}"
MODES="${MODES:-}"  # empty: decode_h200.py's default variants (every mode, host/device planning, graphs, overlap)
{
  date -u; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  nproc; free -g | head -2
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  for m in triton transformers aiohttp pandas pytest safetensors tokenizers numpy pydantic msgspec; do
    python3 -c "import $m; print('$m', getattr($m, '__version__', '?'))" 2>/dev/null || echo "$m MISSING"
  done
  git log --oneline -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-120}" python3 -m pytest ${TESTS:-tests/cuda/test_device_paging_cuda.py tests/cuda/test_fused_cuda.py tests/cuda/test_cuda_runtime.py} -v -p no:cacheprovider -o addopts= -s 2>&1 | tail -120 > "$OUT/cuda_tests.txt" \
    || echo "FAILED cuda tests (see cuda_tests.txt)"
  tail -5 "$OUT/cuda_tests.txt"
fi

if [ "${SKIP_LINKBW:-0}" != 1 ]; then
  timeout 45 python3 -m benchsuite linkbw --samples 3 --no-pageable --no-d2h --json-out "$OUT/linkbw.json" 2>&1 | tail -25 \
    || echo "FAILED linkbw"
fi

if [ "${SKIP_DECODE:-0}" != 1 ]; then
  timeout $((DECODE_DEADLINE_S + 45)) python3 benchmarks/decode_h200.py --out "$OUT/decode_h200.json" --layers "${LAYERS:-48}" \
    ${MODES:+--modes "$MODES"} --batches 1,4 --routings "${ROUTINGS:-model,qwen3-30b-a3b}" --prompt 8 --warmup 2 --steps 24 \
    --cell-cap-s "${CELL_CAP_S:-2.5}" --graphs 1,2,3,4 --deadline-s "$DECODE_DEADLINE_S" \
    --linkbw-json "$OUT/linkbw.json" 2>&1 | tee "$OUT/decode_h200.txt" || echo "FAILED decode_h200"
fi

if [ "${SERVE:-0}" = 1 ]; then
  # The built-in server over a weightless 48-layer directory (weights built in memory at load).
  python3 -m paged_experts.synth_memory --preset qwen3-30b-a3b-shape --layers 48 --out /tmp/q48 || echo "FAILED synth_memory"
  for spec in "resident:--mode resident" "paged32:--mode paged --resident-experts 32" \
              "paged64:--mode paged --resident-experts 64" "offload:--mode offload"; do
    name="${spec%%:*}"; flags="${spec#*:}"
    graphs=""; [ "$name" = resident ] && graphs="1,2,3,4"  # CUDA-graph decode, enabled from the environment
    PAGED_EXPERTS_CUDA_GRAPHS="$graphs" timeout "${SERVE_CELL_S:-100}" python3 benchmarks/serve_decode.py --model /tmp/q48 --concurrency 1 4 \
      --max-tokens "${SERVE_TOKENS:-32}" --prompt-tokens 16 --rounds 1 --out "$OUT/serve_$name.json" \
      -- --device cuda --dtype bfloat16 $flags > "$OUT/serve_$name.log" 2>&1 || echo "FAILED serve $name"
    tail -3 "$OUT/serve_$name.log"
  done
  mkdir -p "$OUT/tmp_serve" && mv "$OUT"/serve_* "$OUT/tmp_serve/" 2>/dev/null
  tar czf "$OUT/serve.tgz" -C "$OUT/tmp_serve" . && rm -rf "$OUT/tmp_serve"
fi
ls -la "$OUT"
