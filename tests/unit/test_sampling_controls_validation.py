"""The scheduler's check of the logits controls (scheduler_svc/validation.py): each out-of-range value is refused
with a message naming the field and its limit; valid ones reach Sampling, and min_tokens masks the stop token ids
and EOS (unless ignore_eos)."""

from __future__ import annotations

import pytest

from pagedkv.api.v1 import api_pb2 as api
from pagedkv.bounds import InvalidRequest
from scheduler_svc.validation import Limits, check_sampling

pytestmark = pytest.mark.unit

LIMITS = Limits(max_model_len=64, vocab_size=300)


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "sampling.presence_penalty: 2.5; must be in [-2, 2]"),
    ({"frequency_penalty": -2.01}, "sampling.frequency_penalty: "),
    ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty: nan; must be in [-2, 2]"),
    ({"repetition_penalty": -1.0}, "sampling.repetition_penalty: -1.0; must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty: inf"),
    ({"min_p": 1.5}, "sampling.min_p: 1.5; must be in [0, 1]"),
    ({"min_tokens": 9, "max_tokens": 8}, "sampling.min_tokens: 9; must be in [0, max_tokens=8]"),
    ({"min_tokens": -1}, "sampling.min_tokens: -1"),
    ({"min_tokens": 2, "stop": ["x"]}, "sampling.min_tokens: 2 with sampling.stop strings is not supported"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias: 301 entries; at most 300"),
    ({"logit_bias": {300: 1.0}}, "sampling.logit_bias: id 300 outside the vocabulary [0, 300)"),
    ({"logit_bias": {5: 100.5}}, "sampling.logit_bias: 100.5 for id 5; each value must be in [-100, 100]"),
    ({"allowed_token_ids": [1, 300]}, "sampling.allowed_token_ids: id 300 outside the vocabulary [0, 300)"),
    ({"allowed_token_ids": [1] * 301}, "sampling.allowed_token_ids: 301 ids; at most the vocabulary's size 300"),
    ({"bad_words": ["x"] * 101}, "sampling.bad_words: 101 words; at most 100"),
    ({"bad_words": ["  "]}, "sampling.bad_words: a word of 2 characters; each must have 1 to 256"),
    ({"bad_words": ["x" * 257]}, "sampling.bad_words: a word of 257 characters"),
])
def test_out_of_range_controls_are_refused_naming_the_field_and_limit(fields, message):
    with pytest.raises(InvalidRequest) as e:
        check_sampling(api.SamplingParams(**fields), 4, LIMITS)
    assert str(e.value).startswith(message), str(e.value)


def test_valid_controls_reach_sampling_and_min_tokens_masks_stop_ids_and_eos():
    p = api.SamplingParams(max_tokens=10, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5,
                           min_p=0.25, min_tokens=10, logit_bias={7: -100, 8: 100}, stop_token_ids=[5],
                           allowed_token_ids=[4, 9])
    s = check_sampling(p, 4, LIMITS, eos_token_ids=[2, 5])
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (-2, 2, 1.5,
                                                                                                     0.25, 10)
    assert s.logit_bias == {7: -100, 8: 100} and s.min_tokens_stop_ids == [5, 2] and s.allowed_token_ids == [4, 9]
    p.ignore_eos = True
    assert check_sampling(p, 4, LIMITS, eos_token_ids=[2]).min_tokens_stop_ids == [5]
    unset = check_sampling(api.SamplingParams(), 4, LIMITS, eos_token_ids=[2])
    assert (unset.repetition_penalty, unset.min_tokens, unset.min_tokens_stop_ids, unset.logit_bias) == (1.0, 0, [],
                                                                                                         {})
