"""A request's own chat template rendered under bounds: what the template worker runs (template_worker.py), and
plain code, so that tests run it in process too.

The template renders as the scheduler renders the model's (tokenizer.py: transformers' environment, variables and
``continue_final_message``), with a tighter sandbox: ``*`` and ``+`` that would build a string or list longer than
the rendered prompt may be, and ``**`` past MAX_POWER_BITS, are refused before the memory is taken, and the rendered
text is counted as it is produced, so a template that writes more than ``max_bytes`` stops there. These stop the
obvious blow-ups early; the worker's process (its time and memory limits) is what bounds everything else (nested
loops, filters such as ``center`` with a huge width).

A job is plain JSON data (``render_job``): template, messages, tools, kwargs, add_generation_prompt,
continue_final_message, special_tokens (the model's named special tokens, the template's bos_token and so on) and
max_bytes; nothing else of the scheduler reaches the worker.
"""

from __future__ import annotations

import functools

from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler_svc.tokenizer import FastTokenizer
from scheduler_svc.tokenizer import _compile as _transformers_template

MAX_POWER_BITS = 4096  # an int ** int whose result would need more bits is refused (templates count, not crypt)
SIZED = (str, list, tuple)


class RenderLimit(Exception):
    """The render passed ``max_bytes`` (the rendered text, or a string or list the template builds on the way)."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox whose ``*``, ``**`` and ``+`` are checked before they run (jinja compiles the
    intercepted operators into ``call_binop`` calls and folds none of them into constants)."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, max_chars: int, **options) -> None:
        super().__init__(**options)
        self.max_chars = max_chars

    def call_binop(self, context, operator: str, left, right):
        if operator == "**":
            _check_power(left, right)
        elif operator == "*":
            seq, times = (left, right) if isinstance(left, SIZED) else (right, left)
            if isinstance(seq, SIZED) and isinstance(times, int):
                self._check_size(seq, len(seq) * times, operator)
        elif operator == "+" and isinstance(left, SIZED) and isinstance(right, SIZED):
            self._check_size(left, len(left) + len(right), operator)
        return super().call_binop(context, operator, left, right)

    def _check_size(self, like, size: int, operator: str) -> None:
        if size > self.max_chars:
            what = "string of" if isinstance(like, str) else f"{type(like).__name__} of"
            unit = "characters" if isinstance(like, str) else "items"
            raise RenderLimit(f"the template would build a {what} {size} {unit} with '{operator}'")


def _check_power(base, exponent) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        bits = exponent * abs(base).bit_length()
        if bits > MAX_POWER_BITS:
            raise RenderLimit(f"the template would compute an integer of about {bits} bits with '**'; at most "
                              f"{MAX_POWER_BITS}")


@functools.lru_cache(maxsize=4)
def _environment(max_chars: int) -> BoundedSandbox:
    """The environment tokenizer.py builds for the model's templates (transformers': its options, extensions,
    filters and globals), as a BoundedSandbox."""
    base = _transformers_template("").environment
    env = BoundedSandbox(max_chars, trim_blocks=base.trim_blocks, lstrip_blocks=base.lstrip_blocks,
                         extensions=[type(e) for e in base.extensions.values()])
    env.filters.update(base.filters)
    env.globals.update(base.globals)
    return env


class BoundedTemplate:
    """A compiled template whose ``render`` stops once the text passes ``max_chars`` characters (each at least one
    byte), before the rest is produced."""

    def __init__(self, template, max_chars: int) -> None:
        self.template, self.max_chars = template, max_chars

    def render(self, **variables) -> str:
        parts, size = [], 0
        for part in self.template.generate(**variables):
            size += len(part)
            if size > self.max_chars:
                raise RenderLimit(f"the rendered text passes {self.max_chars} characters")
            parts.append(part)
        return "".join(parts)


@functools.lru_cache(maxsize=16)  # (a client sends its template with every request)
def _bounded(template: str, max_chars: int) -> BoundedTemplate:
    return BoundedTemplate(_environment(max_chars).from_string(template), max_chars)


class _TemplateRenderer(FastTokenizer):
    """FastTokenizer's apply_chat_template (its variables, its continue_final_message) with no tokenizer behind it:
    the template is always the request's, compiled in the BoundedSandbox."""

    def __init__(self, special_tokens: dict[str, str], max_bytes: int) -> None:  # (no tokenizer.json to read)
        self.chat_template = None
        self.special_tokens_map = dict(special_tokens)
        self.max_bytes = max_bytes

    def _template_for(self, chat_template: str | None) -> tuple[str, object]:
        if chat_template is None:
            raise ValueError("a render job must carry its template")
        return chat_template, _bounded(chat_template, self.max_bytes)


def render_job(job: dict) -> str:
    """The text ``job``'s template renders, at most ``job["max_bytes"]`` UTF-8 bytes (RenderLimit past that); a
    template's own error is raised as it is."""
    renderer = _TemplateRenderer(job["special_tokens"], job["max_bytes"])
    text = renderer.apply_chat_template(job["messages"], tools=job["tools"],
                                        add_generation_prompt=job["add_generation_prompt"],
                                        continue_final_message=job["continue_final_message"],
                                        chat_template=job["template"], **job["kwargs"])
    if len(text) * 4 > job["max_bytes"] and len(text.encode("utf-8", "surrogatepass")) > job["max_bytes"]:
        raise RenderLimit(f"the rendered text passes {job['max_bytes']} bytes of UTF-8")
    return text
