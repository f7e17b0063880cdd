"""The scheduler's tokenizer: the ``tokenizers`` library alone where that gives transformers' answers, else
transformers' ``AutoTokenizer``.

What the scheduler asks of a tokenizer (api.py, detokenizer.py): ``tok(text, add_special_tokens=...)["input_ids"]``,
``convert_ids_to_tokens``, ``backend_tokenizer.decode`` (or ``decode``), ``chat_template`` and
``apply_chat_template(messages, tokenize=False, add_generation_prompt=..., continue_final_message=...,
chat_template=..., **kwargs)``. Importing transformers'
AutoTokenizer costs a scheduler seconds at start-up and loads torch, which the scheduler never needs.

``FastTokenizer`` builds the same backend transformers 5 builds for a checkpoint whose tokenizer_config.json names
the generic class (``TokenizersBackend``, alias ``PreTrainedTokenizerFast``; Llama 3 and the built-in tiny-llama
among them) from tokenizer.json:

- the named special tokens (bos, eos, unk, sep, pad, cls, mask) and ``extra_special_tokens`` (formerly
  ``additional_special_tokens``) are added to the backend as special tokens: matched whole in text, skipped by
  ``decode(skip_special_tokens=True)``;
- tokenizer.json's post-processor adds BOS/EOS; ``add_bos_token``/``add_eos_token`` in tokenizer_config.json are
  ignored when tokenizer.json exists (transformers drops them too); a tokenizer.json without a post-processor adds
  none;
- ``split_special_tokens`` is honoured; no truncation, no padding.

``load_tokenizer`` falls back to AutoTokenizer (and says why) for anything else: no tokenizer.json, a
model-specific tokenizer class (those rebuild the pipeline in their own code; so does a model type that transformers
maps to its own class whatever the config names, e.g. qwen2), added tokens in the config that
tokenizer.json lacks, named model-specific special tokens, or a large-vocabulary Mistral tokenizer that
transformers patches.

Chat templates are rendered with jinja2 directly, in the environment transformers' ``apply_chat_template`` builds:
sandboxed and immutable, ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that keeps non-ASCII
characters, ``raise_exception``, ``strftime_now``, ``dict()`` and ``namespace()`` that refuse underscore names, and
``{% generation %}`` blocks rendered as their content. The template sees ``messages``, ``tools`` (the request's, else
None), ``documents`` (None), ``add_generation_prompt``, the named special tokens as strings and the caller's keyword
arguments (a request's chat_template_kwargs), which win over the special tokens. Only plain JSON data reaches it
(chat.check_chat builds the messages), so transformers' conversion of rich message objects has nothing to do;
``continue_final_message`` is transformers 5's (a tag after the last content, cut off after rendering). Compiled
templates are kept (the last 32: the model's and requests' own). A template is read as transformers reads it:
chat_template.jinja (plus additional_chat_templates/*.jinja) before tokenizer_config.json's ``chat_template``; of
several, the one named ``default``, or the one a request names.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MISTRAL_TYPES = {"mistral", "mistral3", "voxtral", "ministral", "pixtral"}  # transformers may patch their regex
# config.json model types for which AutoTokenizer loads its own class whatever tokenizer_config.json names
# (transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS with a model-specific class; a test checks the table)
OWN_TOKENIZER_TYPES = {"hyperclovax_vision_v2", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp",
                       "siglip2"}
MISTRAL_PATCH_VOCAB = 100_000  # ... when the vocabulary is larger than this


def load_tokenizer(path: str | Path, log=None):
    """The tokenizer of the checkpoint (or tokenizer directory) at ``path``: a FastTokenizer where it gives
    transformers' answers, else transformers' AutoTokenizer (logged as ``tokenizer_transformers`` with the reason)."""
    path = Path(path)
    reason = fast_path_refusal(path)
    if reason is None:
        try:
            return FastTokenizer(path)
        except TokenizerMismatch as err:
            reason = str(err)
    if log is not None:
        log.info("tokenizer_transformers", path=str(path), reason=reason)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def fast_path_refusal(path: Path) -> str | None:
    """Why ``FastTokenizer`` would not give transformers' answers for ``path`` (None: it would)."""
    if not (path / "tokenizer.json").is_file():
        return "no tokenizer.json"
    config = _read_json(path / "tokenizer_config.json")
    cls = config.get("tokenizer_class")
    if cls not in GENERIC_CLASSES:
        return f"tokenizer_class {cls!r} (model-specific tokenizers build their own pipeline)"
    named = [k for k, v in config.items() if k.endswith("_token") and k not in SPECIAL_TOKEN_NAMES
             and isinstance(v, (str, dict))]
    if named or isinstance(config.get("extra_special_tokens"), dict) or config.get("model_specific_special_tokens"):
        return f"model-specific special tokens {named or 'extra_special_tokens'}"
    if config.get("auto_map"):
        return "auto_map (a tokenizer class from the checkpoint's own code)"
    model_type = _read_json(path / "config.json").get("model_type")
    if model_type in OWN_TOKENIZER_TYPES:
        return f"model_type {model_type!r} (transformers loads that family's own tokenizer class)"
    if model_type in MISTRAL_TYPES:
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size() > MISTRAL_PATCH_VOCAB:
            return f"model_type {model_type!r} with a large vocabulary (transformers may patch its regex)"
    return None


def _added_token(value: Any, **defaults):
    """An AddedToken from tokenizer_config.json's form of one: a string, or a dict of its fields."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
        return AddedToken(value["content"], **fields)
    return AddedToken(str(value), **defaults)


def _content(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


class TokenizerMismatch(ValueError):
    """tokenizer_config.json's added tokens are not those of tokenizer.json (transformers' loader reconciles them)."""


class FastTokenizer:
    """tokenizer.json and tokenizer_config.json through the ``tokenizers`` library, answering as transformers'
    TokenizersBackend does for the calls the scheduler makes."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        self.name_or_path = str(path)
        config = _read_json(path / "tokenizer_config.json")
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        backend.no_truncation()
        backend.no_padding()
        self._check_added_tokens(backend, config.get("added_tokens_decoder") or {})
        self._special = {k: config[k] for k in SPECIAL_TOKEN_NAMES if config.get(k) is not None}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        special = [*self._special.values(), *extra]
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [_added_token(t, special=True) for t in special if _content(t) not in present]
        if missing:  # transformers adds the special tokens a tokenizer.json lacks, then marks every one special
            backend.add_tokens(missing)
        backend.add_special_tokens([_added_token(t, special=True, normalized=False) for t in special])
        if backend.post_processor is None:  # transformers' update_post_processor, neither BOS nor EOS asked
            from tokenizers import processors

            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.backend_tokenizer = backend
        self.special_tokens_map = {k: _content(v) for k, v in self._special.items()}
        self.chat_template = _chat_template(path, config)

    @staticmethod
    def _check_added_tokens(backend, declared: dict) -> None:
        have = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        for index, token in declared.items():
            if have.get(int(index)) != _content(token):
                raise TokenizerMismatch(f"added token {index} {_content(token)!r} of tokenizer_config.json is not in "
                                        "tokenizer.json")

    # ---- what the scheduler calls --------------------------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            chat_template: str | None = None, **kwargs) -> str:
        """The rendered prompt text (``tokenize=False`` only: the caller encodes it without special tokens), as
        transformers 5 renders it: ``tools``: the template's tools variable (dicts, as given); ``chat_template`` is a
        template, or the name of one of the checkpoint's; ``kwargs`` are the template's variables (over the special
        tokens'); ``continue_final_message`` ends the text where the last message's content ends."""
        if tokenize:
            raise ValueError("FastTokenizer.apply_chat_template renders text only (tokenize=False)")
        template = self._template_for(chat_template)
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible. Use "
                             "continue_final_message when you want the model to continue the final message, and "
                             "add_generation_prompt when you want to add a header that will prompt it to start a new "
                             "assistant message instead.")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        final = None
        if continue_final_message:  # transformers' way: a tag after the final content, cut off again after rendering
            final = chat[-1].get("content")
            if final is None:
                raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
            if "content" not in template[0]:
                raise ValueError('continue_final_message is set to "content" but this is not an accepted field in '
                                 "the chat_template")
            chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
        text = template[1].render(messages=chat, tools=tools, documents=None,
                                  add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if final is not None:
            if final.strip() not in text or CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                                 "after applying the chat template! This can happen if the chat template deletes "
                                 "portions of the final message. Please verify the chat template and final message in "
                                 "your chat to ensure they are compatible.")
            at = text.rindex(CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text

    def _template_for(self, chat_template: str | None) -> tuple[str, object]:
        """(text, compiled) of the template to render: transformers' get_chat_template (a name picks one of the
        checkpoint's; none: the checkpoint's, its ``default`` of several)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                chat_template = own[chat_template]
            elif chat_template is None:
                if "default" not in own:
                    raise ValueError("This model has multiple chat templates with no default specified! Available "
                                     f"template names are {sorted(own)}.")
                chat_template = own["default"]
        elif chat_template is None:
            chat_template = own
        if chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        return chat_template, _compile(chat_template)


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # (transformers' continue_final_message_tag)


def _chat_template(path: Path, config: dict) -> str | dict[str, str] | None:
    """The checkpoint's chat template(s), as transformers' from_pretrained reads them."""
    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template}
    return template


@functools.lru_cache(maxsize=32)  # the model's own and the requests' recent ones (each at most 64 KiB)
def _compile(template: str):
    """``template`` compiled in the environment transformers' apply_chat_template uses (see the module doc)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): its content."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

        def _content(self, caller) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's own signature trick: namespace(self=...) still works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)
