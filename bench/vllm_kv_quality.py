"""vLLM's own FP8 KV on SmolLM2, measured as bench/kv_quant.py measures pagedkv's: perplexity and top-1 agreement on
the same text (CPython's pydoc_data, 4 x 1,024 tokens), each sequence prefilled in 128-token chunks so that every
chunk reads the earlier ones from the (quantized) cache, against vLLM with float32 KV. Through vLLM's own server
(``vllm-cpu.sh serve``, float32 weights, ``--max-num-batched-tokens 128``): ``/v1/completions`` with ``echo``,
``logprobs: 1`` and ``max_tokens: 1`` gives every prompt position's log-probability and its top-1 token.

    python bench/vllm_kv_quality.py          # -> bench/results/vllm_kv_quality.json
"""

from __future__ import annotations

import json
import math
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import print_table, write_report  # noqa: E402
from e2e_peers import model_dir  # noqa: E402
from kv_quant import fixed_text_tokens  # noqa: E402

MODEL = "smollm2-135m-instruct"
SEQS, SEQ_LEN, CHUNK = 4, 1024, 128
KV = ("auto", "fp8_e4m3", "fp8_e5m2")  # auto: the model's float32


def prompt_logprobs(url: str, ids: list[int]) -> tuple[list[float], list[int]]:
    """(log p of each token after the first, the top-1 token id at each of those positions)."""
    body = dict(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0.0,
                return_tokens_as_token_ids=True)
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback only
        lp = json.loads(r.read())["choices"][0]["logprobs"]
    n = len(ids)
    tops = [max(d.items(), key=lambda kv: kv[1])[0] for d in lp["top_logprobs"][1:n]]
    return lp["token_logprobs"][1:n], [int(t.removeprefix("token_id:")) for t in tops]


def main() -> int:
    import peers_http

    from pagedkv.cli import free_port

    if why := peers_http.missing_peer("vllm"):
        print(f"skipped: {why}")
        return 1
    src = model_dir(MODEL)
    data = fixed_text_tokens(src)
    seqs = [data[i * SEQ_LEN:(i + 1) * SEQ_LEN] for i in range(SEQS)]
    got: dict[str, tuple[list[float], list[int]]] = {}
    for kv in KV:
        port = free_port()
        srv = peers_http.HttpServer("vllm", port, MODEL, [
            "bash", str(peers_http.PEERS / "vllm-cpu.sh"), "serve", str(src), str(port), "--served-model-name", MODEL,
            "--kv-cache-dtype", kv, "--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill",
            "--no-enable-prefix-caching", "--max-num-seqs", "1"])
        srv.start()
        try:
            lps, tops = [], []
            for s in seqs:
                a, b = prompt_logprobs(srv.url, s)
                lps += a
                tops += b
            got[kv] = (lps, tops)
            print(f"vLLM KV {kv}: {len(lps)} positions", flush=True)
        except Exception as err:  # (a KV dtype this build refuses: say so, measure the rest)
            print(f"vLLM KV {kv}: {err}: {srv.log()[-800:]}", flush=True)
        finally:
            srv.stop()
    ref_lp, ref_top = got["auto"]
    base = math.exp(-sum(ref_lp) / len(ref_lp))
    rows, out = [], []
    for kv, (lps, tops) in got.items():
        ppl = math.exp(-sum(lps) / len(lps))
        agree = sum(a == b for a, b in zip(tops, ref_top, strict=True)) / len(tops)
        out.append(dict(kv=kv, perplexity=ppl, ppl_vs_fp32=ppl / base - 1, top1_agreement=agree, tokens=len(lps)))
        rows.append((kv, f"{ppl:.3f}", f"{ppl / base - 1:+.3%}", f"{agree:.2%}"))
    print_table(("vLLM KV dtype", "perplexity", "vs float32 KV", "top-1 agree"), rows)
    write_report(ROOT / "bench" / "results" / "vllm_kv_quality.json", {"seqs": SEQS, "seq_len": SEQ_LEN,
                                                                        "chunk": CHUNK, "results": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
