#!/usr/bin/env bash
# The GPU check, in one device call (see the device tool's README): GPU tests, then GPU benchmarks, then a
# short table. Installs nothing from the network; the device image has torch, cupy, transformers, pytest.
# Needs no structlog/grpc extras (the GPU tests and the DMA bench import neither).
#   run: bash bench/gpu_check.sh            (results under ${OUT:-bench/results})
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print(torch.__version__, torch.cuda.get_device_name())' || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null

echo "== GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_page_dma.py --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 \
  | tee "$OUT_DIR/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== page DMA (bench/swap.py --dma-only)"
python3 bench/swap.py --dma-only --out "$OUT_DIR/swap.json" 2>&1 | tee "$OUT_DIR/dma.txt"
dma_rc=${PIPESTATUS[0]}

echo
echo "== summary"
printf '%-28s %s\n' "GPU tests" "$(tail -1 "$OUT_DIR/gpu_tests.txt") (rc $tests_rc)"
grep -E "device -> host|host -> device|round trip" "$OUT_DIR/dma.txt" | sed 's/^ */page DMA: /'
exit $(( tests_rc || dma_rc ))
