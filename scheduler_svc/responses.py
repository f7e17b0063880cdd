"""A client stream's messages on the wire: an ``Output`` (request.py) as a GenerateResponse (``response``), and the
prompt that the first message of a stream carries (``prompt_message``)."""

from __future__ import annotations

from pagedkv.api.v1 import api_pb2 as api
from scheduler_svc.request import Finish, Output

FINISH_REASONS = {
    Finish.STOP: api.FINISH_REASON_STOP,
    Finish.LENGTH: api.FINISH_REASON_LENGTH,
    Finish.ABORT: api.FINISH_REASON_ABORT,
}


def response(request_id: str, out: Output) -> api.GenerateResponse:
    """``out`` as its stream's message: text, tokens, their log-probabilities and most likely tokens, the prompt's
    log-probabilities (a message of its own), and on a fork's last message its finish reason and usage."""
    msg = api.GenerateResponse(request_id=request_id, text=out.text, token_ids=out.token_ids, logprobs=out.logprobs,
                               index=out.index)
    for ids, values in out.top_logprobs:
        msg.top_logprobs.add(token_ids=ids, logprobs=values)
    if out.prompt is not None:
        out.prompt.write(msg.prompt)
    if out.finish is not None:
        msg.finish_reason = FINISH_REASONS[out.finish]
        msg.stop_reason = out.stop_reason
        msg.usage.CopyFrom(api.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                                     cached_tokens=out.cached_tokens))
    return msg


def prompt_message(prompt_ids: list[int], sampling: api.SamplingParams, received: bool, text: str = "") -> api.Prompt:
    """What the first message of a stream says of the prompt: its size; its ids when sampling.echo or prompt_logprobs
    ask, and ``text`` with echo, unless the client has them (``received``: a continuation's prompt_received)."""
    prompt = api.Prompt(num_tokens=len(prompt_ids))
    if not received and (sampling.echo or sampling.HasField("prompt_logprobs")):
        prompt.token_ids.extend(prompt_ids)
        prompt.text = text
    return prompt
