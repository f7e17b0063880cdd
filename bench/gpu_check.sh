#!/usr/bin/env bash
# The GPU check, in one device call of < 8 minutes (see the device tool's README): GPU tests, then GPU benchmarks,
# then a short table. Installs nothing from the network.
#
# The device image has torch, cupy-cuda13x, transformers, pytest, uvloop, prometheus-client, but not structlog nor
# grpcio-health-checking / grpcio-reflection (and maybe older grpcio/protobuf than our generated stubs need), which
# the services (end-to-end GPU tests, e2e bench) import. Carry them as wheels: on the host, before the call,
#     bash bench/fetch_gpu_wheels.sh
#   (= python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
#        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl structlog==26.1.0 grpcio==1.85.3
#        grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 ; .whl/ is git-ignored)
# then run on the device with carry [".whl"]:   bash bench/gpu_check.sh [--tests-only | --bench-only]
# (the halves, for a second call when the first ran out of time).
# Without .whl/ the end-to-end GPU tests skip (with that reason) and the e2e bench is skipped.
# Results under ${OUT:-bench/results} (13 files: gpu_tests.txt, attention_kernels.{txt,json},
# attention_kernels_{fp8_e4m3,int8}.json, kv_quant_gpu.{txt,json}, dma.txt, swap_dma.json, cuda_graphs.{txt,json},
# e2e_vs_hf.{txt,json}).
set -u
cd "$(dirname "$0")/.."
run_tests=1 run_bench=1
case "${1:-}" in
  --tests-only) run_bench=0 ;;
  --bench-only) run_tests=0 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--tests-only | --bench-only]" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR=/tmp/pagedkv-cupy-cache PAGEDKV_CACHE_DIR=/tmp/pagedkv-cache  # shared by every process
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
start=$SECONDS
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print(torch.__version__, torch.cuda.get_device_name())' || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null
python3 -c 'import cupy; print("cupy", cupy.__version__)' || echo "WARNING: CuPy missing: the cuda backend tests skip"

services=0
if ls .whl/*.whl >/dev/null 2>&1; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pagedkv-site .whl/*.whl; then
    export PYTHONPATH="$PWD:/tmp/pagedkv-site"
    services=1
  fi
fi
python3 -c 'import structlog, grpc_health, grpc_reflection, pagedkv.grpc_common' 2>/dev/null || services=0
[ "$services" = 1 ] || echo "NOTE: services not importable (no carried .whl/, see this script's header): e2e GPU tests skip, e2e bench skipped"

tests_rc=0 attn_rc=0 dma_rc=0 e2e_rc=0 graphs_rc=0
if [ "$run_tests" = 1 ]; then
echo "== GPU tests (PAGEDKV_CUDA_DEBUG=1: every kernel launch checked)"
PAGEDKV_CUDA_DEBUG=1 timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 150 \
  tests/gpu tests/unit/test_page_dma.py tests/e2e/test_kernels_compile.py tests/unit/test_cuda_backend_cpu.py tests/e2e/test_cuda_backend_cpu.py 2>&1 \
  | tee "$OUT_DIR/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "== decode kernels again without the debug synchronisation (ordering between launches as in serving)"
timeout 60 python3 -m pytest -q -p no:cacheprovider --timeout 50 tests/gpu/test_cuda_attention_gpu.py -k "decode or forward" \
  2>&1 | tail -3 | tee -a "$OUT_DIR/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || tests_rc=1
fi

if [ "$run_bench" = 1 ]; then
echo "== paged decode attention kernels (bench/attention_kernels.py)"
timeout 70 python3 bench/attention_kernels.py --out "$OUT_DIR/attention_kernels.json" 2>&1 \
  | tee "$OUT_DIR/attention_kernels.txt"
attn_rc=${PIPESTATUS[0]}
echo "== the same with 64 query / 8 KV heads (a group of 8: Llama-3-70B's shape)"
timeout 30 python3 bench/attention_kernels.py --heads 64 --cases 64x4096 --out "$OUT_DIR/attention_kernels_g8.json" \
  2>&1 | tail -4 | tee -a "$OUT_DIR/attention_kernels.txt"
[ "${PIPESTATUS[0]}" = 0 ] || attn_rc=1
for kv in fp8_e4m3 int8; do
  echo "== paged_decode_q8 over $kv pages, 64x4096 (bytes read: data + scales)"
  timeout 40 python3 bench/attention_kernels.py --kv-cache-dtype $kv --cases 64x4096 \
    --out "$OUT_DIR/attention_kernels_$kv.json" 2>&1 | tail -4 | tee -a "$OUT_DIR/attention_kernels.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || attn_rc=1
done

echo "== 8-bit KV pages: decode attention 64x4096 through the torch backend (bench/kv_quant.py --gpu)"
timeout 40 python3 bench/kv_quant.py --gpu --out "$OUT_DIR/kv_quant_gpu.json" 2>&1 | tee "$OUT_DIR/kv_quant_gpu.txt"
[ "${PIPESTATUS[0]}" = 0 ] || attn_rc=1

echo "== page DMA (bench/swap.py --dma-only)"
timeout 40 python3 bench/swap.py --dma-only --out "$OUT_DIR/swap.json" 2>&1 | tee "$OUT_DIR/dma.txt"
dma_rc=${PIPESTATUS[0]}

echo "== decode step time with vs without CUDA graphs, random 1B Llama fp16, batch 1/8/64 at 512 tokens of context"
if ! python3 -c 'import structlog' 2>/dev/null; then
  echo "NOTE: no structlog (the executor's modules log with it; carry .whl/): skipped"
else
timeout 150 python3 - "$OUT_DIR/cuda_graphs.json" cuda <<'PY' 2>&1 | tee "$OUT_DIR/cuda_graphs.txt"
import json, statistics, sys, time
import torch
from executor_svc.attention import BACKENDS
from executor_svc.cuda_graphs import DecodeGraphs, eager_capture
from executor_svc.kv_quant import parse_kv_dtype
from executor_svc.model import load_model
from executor_svc.model_config import ModelConfig
from executor_svc.pages import DevicePagePool
from executor_svc.runner import ModelRunner
from pagedkv.executor.v1 import executor_pb2 as pb

out_path, device = sys.argv[1], torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")
if device.type == "cuda":
    sys.path.insert(0, "bench")
    from e2e_vs_hf import random_model_dir
    model_dir, dtype, capture = random_model_dir("1b"), torch.float16, None
else:  # a dry run of this script on the CPU: tiny-llama, graphs replayed eagerly
    from pagedkv.models import resolve_model
    model_dir, dtype, capture = resolve_model("tiny-llama"), torch.float32, eager_capture
CTX, STEPS, BS, BATCHES = 512, 20, 16, (1, 8, 64)
cfg = ModelConfig.from_dir(model_dir)
model = load_model(cfg, device, dtype)
pages_per = -(-(CTX + STEPS + 2) // BS)
backends = ["torch"]
if device.type == "cuda":
    from kernels_cuda.loader import cupy_import_error
    if cupy_import_error() is None:
        backends.append("cuda")

def step_ms(backend, graphs_on, batch):
    attention = BACKENDS[backend](cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.scale)
    n = batch * pages_per
    pool = DevicePagePool(cfg, n + 1, BS, dtype, device, parse_kv_dtype("auto", dtype))
    pool.copier = attention.copy_pages
    graphs = DecodeGraphs(model, pool, attention, device, 64, n, capture) if graphs_on else None
    runner = ModelRunner(model, pool, attention, device, graphs=graphs)
    g = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(batch)]
    for c in range(0, batch, 8):
        plan = pb.StepPlan(step_id=0)
        for i in range(c, min(batch, c + 8)):
            plan.new_requests.add(request_id=rids[i], token_ids=torch.randint(3, 250, (CTX,), generator=g).tolist(),
                                  num_scheduled_tokens=CTX, page_ids=range(i * pages_per, (i + 1) * pages_per),
                                  sampling=pb.SamplingParams())
        assert not runner.step(plan).error
    times = []
    for s in range(STEPS):
        t0 = time.perf_counter()
        r = runner.step(pb.StepPlan(step_id=s + 1, decodes=rids))  # sampling reads the tokens: synchronised
        times.append((time.perf_counter() - t0) * 1e3)
        assert not r.error, r.error
    return statistics.median(times[3:])  # the first steps capture

rows = []
for backend in backends:
    for batch in BATCHES:
        eager, graph = step_ms(backend, False, batch), step_ms(backend, True, batch)
        rows.append(dict(backend=backend, batch=batch, context=CTX, eager_ms=eager, graph_ms=graph,
                         speedup=eager / graph))
        print(f"{backend:6s} batch {batch:3d} ctx {CTX}: decode step {eager:.2f} ms eager, {graph:.2f} ms graphs "
              f"({eager / graph:.2f}x)", flush=True)
json.dump(dict(model=str(model_dir), dtype=str(dtype), rows=rows), open(out_path, "w"), indent=1)
PY
graphs_rc=${PIPESTATUS[0]}
fi

left=$(( 450 - (SECONDS - start) ))
if [ "$services" = 1 ] && [ "$left" -gt 60 ]; then
  echo "== end to end vs HF generate, random 1B Llama, fp16 (bench/e2e_vs_hf.py; ${left}s left)"
  timeout "$left" python3 bench/e2e_vs_hf.py --random-model 1b --device cuda --dtype float16 \
    --attention-backend cuda --hf-attn sdpa --wait-idle 0 --num-requests 64 \
    --serve-arg=--kv-cache-gb=16 --serve-arg=--swap-space=0 --out "$OUT_DIR/e2e_vs_hf.json" 2>&1 \
    | tee "$OUT_DIR/e2e_vs_hf.txt"
  e2e_rc=${PIPESTATUS[0]}
else
  echo "== end to end vs HF: skipped (services=$services, ${left}s left)"
fi
fi

echo
echo "== summary ($(( SECONDS - start ))s)"
[ "$run_tests" = 1 ] && printf '%-22s %s\n' "GPU tests" "$(tail -1 "$OUT_DIR/gpu_tests.txt") (rc $tests_rc)"
python3 - "$OUT_DIR" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    a = json.loads((out / "attention_kernels.json").read_text())
    print(f"{'device copy':22s} {a['copy']['gb_per_s']:.0f} GB/s (read + write)")
    for r in a["cases"]:
        print(f"{'decode ' + str(r['batch']) + 'x' + str(r['context']):22s} paged {r['gb_per_s']['paged']:.0f} GB/s = "
              f"{r['paged_share_of_copy']:.1%} of copy (target 85%), paged/contig {r['paged_over_contiguous']:.3f} "
              f"(target 1.02), paged/sdpa {r['paged_over_sdpa']:.2f}, err {r['max_rel_err_vs_sdpa']:.1e}")
except Exception as err:  # noqa: BLE001
    print(f"{'decode kernels':22s} no result ({err})")
try:
    base = next(r for r in a["cases"] if (r["batch"], r["context"]) == (64, 4096))
    for kv in ("fp8_e4m3", "int8"):
        r = json.loads((out / f"attention_kernels_{kv}.json").read_text())["cases"][0]
        print(f"{kv + ' decode 64x4096':22s} {r['gb_per_s']['paged']:.0f} GB/s read = {r['paged_share_of_copy']:.1%} "
              f"of copy (target 85%), {r['tokens_per_s'] / (64 / base['ms']['paged'] * 1e3):.2f}x fp16 tokens/s "
              f"(target ~1.9x), err {r['max_rel_err_vs_sdpa']:.1e}")
        for name, w in ((("fp16", base.get("write")),) if kv == "fp8_e4m3" else ()) + ((kv, r.get("write")),):
            if w:
                print(f"{'cache write ' + name:22s} {w['tokens_per_s'] / 1e6:.1f} M tokens/s per layer, "
                      f"{w['gb_per_s']:.0f} GB/s (8192 scattered slots)")
except Exception as err:  # noqa: BLE001
    print(f"{'8-bit decode kernels':22s} no result ({err})")
try:
    k = json.loads((out / "kv_quant_gpu.json").read_text())["decode"]
    print(f"{'8-bit KV decode (torch)':22s} " + ", ".join(f"{n} {r['tokens_per_s']:.0f} tok/s ({r['vs_fp16']:.2f}x)"
                                                        for n, r in k.items()) + " (torch backend, unfused)")
except Exception as err:  # noqa: BLE001
    print(f"{'8-bit KV decode':22s} no result ({err})")
try:
    d = json.loads((out / "swap_dma.json").read_text())  # --dma-only writes it beside --out
    for way in ("out", "in"):
        print(f"{'page DMA ' + way:22s} {d['paged_' + way]['gb_per_s']:.1f} GB/s, {d['ratio_' + way]:.1%} of one "
              f"pinned copy (target 90%)")
except Exception as err:  # noqa: BLE001
    print(f"{'page DMA':22s} no result ({err})")
try:
    for r in json.loads((out / "cuda_graphs.json").read_text())["rows"]:
        print(f"{'decode step b' + str(r['batch']) + ' ' + r['backend']:22s} {r['eager_ms']:.2f} ms eager, "
              f"{r['graph_ms']:.2f} ms CUDA graphs ({r['speedup']:.2f}x), 1B fp16, ctx {r['context']}")
except Exception as err:  # noqa: BLE001
    print(f"{'CUDA graphs':22s} no result ({err})")
try:
    e = json.loads((out / "e2e_vs_hf.json").read_text())
    print(f"{'e2e 1B fp16 vs HF':22s} {e['pagedkv']['tokens_per_s']:.0f} vs {e['hf']['tokens_per_s']:.0f} tokens/s = "
          f"{e['ratio_tokens_per_s']:.2f}x (target {e['target_ratio']:g}x)")
except Exception as err:  # noqa: BLE001
    print(f"{'e2e vs HF':22s} no result ({err})")
PY
exit $(( tests_rc || attn_rc || dma_rc || e2e_rc || graphs_rc ))
