"""Through real processes on loopback: greedy output with the logits controls (repetition_penalty,
frequency_penalty, presence_penalty, min_tokens, logit_bias, allowed_token_ids, bad_words) is token-exact against
transformers' generate() with the equivalent logits processors, under preemption too (a preempted request is resent
in full: its token counts are rebuilt from its tokens)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from pagedkv.client import Client
from scheduler_svc.validation import bad_words_token_ids
from tests.support.hf_reference import random_prompts

pytestmark = pytest.mark.e2e

VOCAB = 259
PROMPT_LENS = [3, 17, 40, 9, 64, 25]
MAX_TOKENS = 40
CASES = {  # name: the request's controls
    "repetition": {"repetition_penalty": 1.4},
    "repetition-below-1": {"repetition_penalty": 0.7},
    "frequency-presence": {"frequency_penalty": 1.5, "presence_penalty": 0.8},
    "all-penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -0.5},
    "logit-bias": {"logit_bias": {7: 8.0, 42: 5.5, 100: -100.0}},
    "min-tokens": {"min_tokens": 30},
    "allowed-token-ids": {"allowed_token_ids": list(range(35, 130, 2))},
    # "bad-words": words taken from the plain greedy outputs (the references fixture)
}


class OutputPenalties(LogitsProcessor):
    """vLLM's frequency and presence penalties, over the tokens generated (transformers has no such processor)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class OutputBadWords(LogitsProcessor):
    """transformers' NoBadWordsLogitsProcessor over the tokens generated (vLLM's bad words look at the output
    only)."""

    def __init__(self, prompt_len: int, words: list[list[int]]) -> None:
        self.prompt_len, self.inner = prompt_len, NoBadWordsLogitsProcessor(words)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.inner(input_ids[:, self.prompt_len:], scores)


def processors(controls: dict, prompt_len: int, eos: list[int], encode) -> LogitsProcessorList:
    procs = LogitsProcessorList()  # (vLLM's order: allowed, bad words, min_tokens, logit_bias, the penalties)
    if controls.get("allowed_token_ids"):
        procs.append(SuppressTokensLogitsProcessor(sorted(set(range(VOCAB)) - set(controls["allowed_token_ids"]))))
    if controls.get("bad_words"):
        procs.append(OutputBadWords(prompt_len, bad_words_token_ids(controls["bad_words"], encode)))
    if controls.get("min_tokens"):
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, controls["min_tokens"], eos))
    if controls.get("logit_bias"):
        procs.append(SequenceBiasLogitsProcessor([[[t], v] for t, v in controls["logit_bias"].items()]))
    if "repetition_penalty" in controls:
        procs.append(RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"]))
    if "frequency_penalty" in controls or "presence_penalty" in controls:
        procs.append(OutputPenalties(prompt_len, controls.get("frequency_penalty", 0.0),
                                     controls.get("presence_penalty", 0.0)))
    return procs


def hf_greedy_with(model_dir, prompts: list[list[int]], controls: dict | None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            procs = processors(controls, len(prompt), eos, encode) if controls else None
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, logits_processor=procs)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def bad_words_from(outputs: list[list[int]]) -> list[str]:
    """A one-character word and a two-character one that the plain outputs hold (tiny-llama's tokens are bytes:
    id = byte + 3; printable ASCII, no spaces)."""
    printable = [[t for t in out if 36 <= t < 130] for out in outputs]
    pair = next((a, b) for out in outputs for a, b in zip(out, out[1:]) if 36 <= a < 130 and 36 <= b < 130)
    return [chr(printable[0][0] - 3), chr(pair[0] - 3) + chr(pair[1] - 3)]


@pytest.fixture(scope="module")
def references(tiny_llama_dir):
    prompts = random_prompts(5, PROMPT_LENS, VOCAB)
    plain = hf_greedy_with(tiny_llama_dir, prompts, None)
    cases = {**CASES, "bad-words": {"bad_words": bad_words_from(plain)}}
    return prompts, cases, {"plain": plain, **{name: hf_greedy_with(tiny_llama_dir, prompts, c)
                                               for name, c in cases.items()}}


async def run_all(address: str, prompts, controls: dict) -> list:
    async with Client(address) as client:
        return await asyncio.gather(*[client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0, **controls)
                                      for p in prompts])


async def _preemptions(address: str) -> int:
    async with Client(address) as client:
        return (await client.model_info()).num_preemptions


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_greedy_with_controls_matches_transformers(start_server, references, pool):
    prompts, cases, expected = references
    args = ["--num-pages", "512"] if pool == "roomy" else ["--num-pages", "10", "--preemption-mode", "recompute",
                                                           "--max-model-len", "128"]
    server = start_server("--block-size", "16", "--max-num-batched-tokens", "64", "--check-integrity", *args)
    for name, controls in cases.items():
        outs = asyncio.run(run_all(server.address, prompts, controls))
        for i, (out, ref) in enumerate(zip(outs, expected[name])):
            assert out.token_ids == ref, f"{name}: request {i} (prompt {len(prompts[i])} tokens) differs"
    if pool == "preempting":
        assert asyncio.run(_preemptions(server.address)) > 0, "the pool was meant to be too small"
    changed = [name for name in cases if expected[name] != expected["plain"]]
    assert changed == list(cases), f"each case must change transformers' greedy output (unchanged: " \
        f"{set(cases) - set(changed)})"


SEEDED = {  # name: (temperature, the request's controls)
    "penalties": (0.9, {"repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.4}),
    "min-p": (1.2, {"min_p": 0.1}),
    "bias-min-tokens": (0.8, {"logit_bias": {7: 8.0, 42: 5.5}, "min_tokens": 25}),
}


def seeded_reference(model_dir, prompts: list[list[int]], temperature: float, controls: dict,
                     seed: int) -> list[list[int]]:
    """Per step: transformers' logits (eager, fp32, the whole sequence recomputed), its processors, min-p by
    MinPLogitsWarper after temperature, then the executor's draw (seed, draw number) on what is left: what a seeded
    run must give, token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MinPLogitsWarper

    from executor_svc.sampler import SamplingParams, sample

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            procs = processors(controls, len(prompt), eos,
                               lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
            for draw in range(MAX_TOKENS):
                t = torch.tensor([ids])
                scores = procs(t, model(t).logits[:, -1].float())
                if controls.get("min_p"):
                    cut = MinPLogitsWarper(controls["min_p"])(t, scores / temperature)
                    scores = scores.masked_fill(torch.isinf(cut), float("-inf"))
                token = sample(scores, [SamplingParams(temperature=temperature, seed=seed)], [draw])[0][0]
                ids.append(token)
                if token in eos:
                    break
            outs.append(ids[len(prompt):])
    return outs


def test_seeded_with_controls_matches_the_reference_draws(start_server, tiny_llama_dir):
    prompts = random_prompts(6, PROMPT_LENS[:4], VOCAB)
    server = start_server("--block-size", "16", "--num-pages", "512", "--check-integrity")

    async def run(temperature: float, controls: dict, seed: int) -> list:
        async with Client(server.address) as client:
            return await asyncio.gather(*[client.complete(p, max_tokens=MAX_TOKENS, temperature=temperature,
                                                          seed=seed, **controls) for p in prompts])
    for name, (temperature, controls) in SEEDED.items():
        expected = seeded_reference(tiny_llama_dir, prompts, temperature, controls, seed=11)
        plain = seeded_reference(tiny_llama_dir, prompts, temperature, {}, seed=11)
        assert expected != plain, f"{name}: the controls must change the seeded output"
        outs = asyncio.run(run(temperature, controls, 11))
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.token_ids == ref, f"{name}: request {i} differs from the reference draws"
