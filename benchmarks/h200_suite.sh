#!/usr/bin/env bash
# One device call: CUDA checks of the fused path, the link probe, and decode of the 48-layer model
# in every mode (benchmarks/decode_h200.py); optionally the built-in server (SERVE=1) and the
# llama.cpp CUDA comparison (LLAMA=1: build, Q8_0 GGUF, llama-batched-bench per --n-cpu-moe N).
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

if [ "${KERNELS:-0}" = 1 ]; then
  # One MoE layer's routing + expert kernels alone (torch vs moe_triton) and moe_triton's tile
  # sweep; the best batch-1 tiles are exported for everything below (recorded in decode_h200.json).
  timeout "${KERNELS_S:-150}" python3 benchmarks/moe_kernels_h200.py --out "$OUT/moe_kernels.json" --batches 1,4 \
    2>&1 | tee "$OUT/moe_kernels.txt" || echo "FAILED moe_kernels"
  TILES=$(sed -n 's/.*PAGED_EXPERTS_MOE_TILES=//p' "$OUT/moe_kernels.txt" | tail -1)
  if [ -n "$TILES" ]; then export PAGED_EXPERTS_MOE_TILES="$TILES"; echo "tiles: $TILES"; fi
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-120}" python3 -m pytest ${TESTS:-tests/cuda/test_device_paging_cuda.py tests/cuda/test_fused_cuda.py tests/cuda/test_cuda_runtime.py} -v -p no:cacheprovider -o addopts= -s 2>&1 | tail -120 > "$OUT/cuda_tests.txt" \
    || echo "FAILED cuda tests (see cuda_tests.txt)"
  tail -5 "$OUT/cuda_tests.txt"
fi

if [ "${SKIP_LINKBW:-0}" != 1 ]; then
  timeout 45 python3 -m benchsuite linkbw --samples 3 --no-pageable --no-d2h --json-out "$OUT/linkbw.json" 2>&1 | tail -25 \
    || echo "FAILED linkbw"
fi

if [ -n "${PROFILE:-}" ]; then  # PROFILE=variant,variant: where a decode step's GPU time goes
  # Chrome traces (one per variant, with a per-stream busy/span summary in profile.txt) as one file
  timeout "${PROFILE_S:-120}" python3 benchmarks/profile_step.py --layers "${PROFILE_LAYERS:-8}" --variants "$PROFILE" \
    --batch "${PROFILE_BATCH:-1}" --steps 5 --rows 30 --out "$OUT/profile.txt" --trace-dir /tmp/traces 2>&1 \
    | grep -E '^===|^  ' || echo "FAILED profile"
  tar czf "$OUT/traces.tgz" -C /tmp traces 2>/dev/null
fi

if [ "${SKIP_DECODE:-0}" != 1 ]; then
  timeout $((DECODE_DEADLINE_S + 45)) python3 benchmarks/decode_h200.py --out "$OUT/decode_h200.json" --layers "${LAYERS:-48}" \
    ${MODES:+--modes "$MODES"} --batches 1,4 --routings "${ROUTINGS:-model,qwen3-30b-a3b}" --prompt 8 --warmup 2 --steps 24 \
    --cell-cap-s "${CELL_CAP_S:-2.5}" --graphs 1,2,3,4 --deadline-s "$DECODE_DEADLINE_S" \
    --linkbw-json "$OUT/linkbw.json" 2>&1 | tee "$OUT/decode_h200.txt" || echo "FAILED decode_h200"
fi

T0=$SECONDS
if [ "${LLAMA:-0}" = 1 ]; then
  # llama.cpp's CUDA build (~4.5 min) on cores 4-15 while the built-in server cells use cores 0-3.
  taskset -c 4-15 nice -n 10 python3 benchmarks/llamacpp_h200.py build --jobs 12 --out /tmp/llamacpp_h200 \
    > "$OUT/llama_build_stdout.log" 2>&1 &
  BUILD_PID=$!
fi

if [ "${SERVE:-0}" = 1 ]; then
  # The built-in server over a weightless 48-layer directory (weights built in memory at load),
  # CUDA-graph decode for batch 1..4 (resident, and paged planned on the device: 4 x top_k <= K).
  python3 -m paged_experts.synth_memory --preset qwen3-30b-a3b-shape --layers 48 --out /tmp/q48 || echo "FAILED synth_memory"
  mkdir -p "$OUT/tmp_serve"
  for spec in "resident:32:--mode resident --cuda-graph-max-bs 4" \
              "paged32:32:--mode paged --resident-experts 32 --cuda-graph-max-bs 4" \
              "paged64:32:--mode paged --resident-experts 64 --cuda-graph-max-bs 4" \
              "offload:8:--mode offload"; do
    name="${spec%%:*}"; rest="${spec#*:}"; tokens="${rest%%:*}"; flags="${rest#*:}"
    taskset -c 0-3 timeout "${SERVE_CELL_S:-100}" python3 benchmarks/serve_decode.py --model /tmp/q48 --concurrency 1 4 \
      --max-tokens "$tokens" --prompt-tokens 16 --rounds 1 --out "$OUT/tmp_serve/serve_$name.json" \
      -- --device cuda --dtype bfloat16 --max-total-tokens 4096 $flags > "$OUT/tmp_serve/serve_$name.log" 2>&1 \
      || echo "FAILED serve $name"
    echo "serve $name done at $((SECONDS - T0)) s"; tail -2 "$OUT/tmp_serve/serve_$name.log"
  done
  tar czf "$OUT/serve.tgz" -C "$OUT/tmp_serve" . && rm -rf "$OUT/tmp_serve"
fi

if [ "${LLAMA:-0}" = 1 ]; then
  # Q8_0 experts (the bf16 GGUF, 58 GB, does not fit the disk): written while the build finishes.
  python3 benchmarks/llamacpp_h200.py gguf --layers 48 --out-file /dev/shm/q48.gguf > "$OUT/llama_gguf.log" 2>&1 \
    || echo "FAILED gguf"
  echo "gguf done at $((SECONDS - T0)) s"; tail -2 "$OUT/llama_gguf.log"
  wait "$BUILD_PID" || echo "FAILED llama build (see llama_build_stdout.log)"
  echo "build done at $((SECONDS - T0)) s"
  LEFT=$(( ${LLAMA_DEADLINE_S:-540} - (SECONDS - T0) ))
  python3 benchmarks/llamacpp_h200.py bench --gguf /dev/shm/q48.gguf --build /tmp/llamacpp_h200 --out "$OUT/llama" \
    --deadline-s "$LEFT" > "$OUT/llama_bench_stdout.log" 2>&1 || echo "FAILED llama bench"
  echo "bench done at $((SECONDS - T0)) s"
  cp "$OUT/llama/llamacpp_h200.json" "$OUT/" 2>/dev/null
  cp /tmp/llamacpp_h200/build.json "$OUT/llama_build.json" 2>/dev/null
  tar czf "$OUT/llama_logs.tgz" -C "$OUT" llama llama_build_stdout.log llama_gguf.log llama_bench_stdout.log 2>/dev/null \
    && rm -rf "$OUT/llama" "$OUT"/llama_*stdout.log "$OUT/llama_gguf.log"
fi
ls -la "$OUT"
