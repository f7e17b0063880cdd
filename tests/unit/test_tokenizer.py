"""The scheduler's tokenizer (scheduler_svc/tokenizer.py) answers as transformers' AutoTokenizer does: token ids
with and without special tokens, convert_ids_to_tokens, decoding (special tokens kept or skipped, broken UTF-8
included) and chat templates rendered to text, for the built-in tiny-llama and the tokenizers the suite builds
(pagedkv.tools.random_model.build_byte_tokenizer, tests/support/chat_template.py), in every form a checkpoint stores
them. Where it cannot, it says why and hands over to transformers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from pagedkv.tools.random_model import build_byte_tokenizer
from scheduler_svc.tokenizer import OWN_TOKENIZER_TYPES, FastTokenizer, fast_path_refusal, load_tokenizer
from tests.support.chat_template import TEMPLATE, TOOL_TEMPLATE

pytestmark = pytest.mark.unit

TEXTS = ["Hello world", "", " leading and  double  spaces\n\ttabs", "héllo ☃ 日本語 🦙", "<s>inside</s> text <unk>",
         "<|im_start|>user\nhi<|im_end|>", "a" * 300]
MESSAGES = [
    [{"role": "user", "content": "Héllo?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and <s> 3+3?"}],
]
# A template with what real ones use: namespace, loop controls, tojson, strip/trim, a generation block, special
# tokens as variables, and raise_exception.
RICH_TEMPLATE = (
    "{%- set ns = namespace(system='', n=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}"
    "{%- continue -%}{%- endif -%}{%- set ns.n = ns.n + 1 -%}{%- endfor -%}"
    "{{ bos_token }}{% if ns.system %}<<SYS>>{{ ns.system | trim }}<</SYS>>\n{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] | tojson }} [/INST]\n"
    "{% elif m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    "{% endfor %}"
    "{{ dict(count=ns.n) | tojson }}")


def _transformers(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _config(path: Path) -> dict:
    return json.loads((path / "tokenizer_config.json").read_text())


def _write_config(path: Path, **changes) -> None:
    config = {**_config(path), **changes}
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def assert_same(path: Path, messages=MESSAGES) -> FastTokenizer:
    """The FastTokenizer of ``path`` gives transformers' answer to every call the scheduler makes."""
    assert fast_path_refusal(path) is None
    fast, hf = load_tokenizer(path), _transformers(path)
    assert isinstance(fast, FastTokenizer)
    assert fast.special_tokens_map == hf.special_tokens_map
    assert fast.chat_template == hf.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = fast(text, add_special_tokens=special)["input_ids"]
            assert ids == hf(text, add_special_tokens=special)["input_ids"], (text, special)
            assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    rng = random.Random(7)
    vocab = hf.backend_tokenizer.get_vocab_size()
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(200)]  # broken UTF-8 too
    sequences += [fast(t)["input_ids"] for t in TEXTS]
    for ids in sequences:
        for skip in (True, False):
            want = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert fast.decode(ids, skip_special_tokens=skip) == want, (ids, skip)
            assert fast.backend_tokenizer.decode(ids, skip_special_tokens=skip) == want
    assert fast.convert_ids_to_tokens(sequences[0][0]) == hf.convert_ids_to_tokens(sequences[0][0])
    if hf.chat_template is not None:
        for conversation in messages:
            for generation_prompt in (True, False):
                got = fast.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
                assert got == hf.apply_chat_template(conversation, tokenize=False,
                                                     add_generation_prompt=generation_prompt), conversation
    return fast


@pytest.fixture()
def byte_dir(tmp_path) -> Path:
    path = tmp_path / "byte"
    build_byte_tokenizer(path)
    return path


def test_tiny_llama(tiny_llama_dir):
    fast = assert_same(tiny_llama_dir)
    assert fast("Hi")["input_ids"][0] == 1 and fast("Hi", add_special_tokens=False)["input_ids"][0] != 1
    assert fast.chat_template is None


# The model types of the checkpoints pagedkv.tools.random_model.build_random_model writes (ARCHS), each with the byte
# tokenizer.
SUITE_MODEL_TYPES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text", "gemma3",
                     "mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("model_type", SUITE_MODEL_TYPES)
def test_the_suites_model_families(byte_dir, model_type):
    """Whichever way load_tokenizer goes for a family, ids and text are transformers'."""
    (byte_dir / "config.json").write_text(json.dumps({"model_type": model_type}))
    if fast_path_refusal(byte_dir) is None:
        assert_same(byte_dir)
        return
    tok, hf = load_tokenizer(byte_dir), _transformers(byte_dir)
    assert type(tok) is type(hf)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert ids == hf(text, add_special_tokens=True)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_chat_template_saved_by_transformers(byte_dir, tmp_path):
    """As tests/unit/test_chat.py makes it: transformers 5 writes the template to chat_template.jinja."""
    hf = _transformers(byte_dir)
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(tmp_path / "chat"))
    assert (tmp_path / "chat" / "chat_template.jinja").is_file()
    assert_same(tmp_path / "chat")


@pytest.mark.parametrize("template", [TEMPLATE, RICH_TEMPLATE], ids=["suite", "rich"])
def test_chat_template_in_tokenizer_config(byte_dir, template):
    _write_config(byte_dir, chat_template=template)
    assert_same(byte_dir)


def test_named_chat_templates_use_the_default(byte_dir):
    _write_config(byte_dir, chat_template=[{"name": "default", "template": RICH_TEMPLATE},
                                           {"name": "tool_use", "template": "{{ 'tools' }}"}])
    fast = assert_same(byte_dir)
    assert set(fast.chat_template) == {"default", "tool_use"}


# A tool-using conversation as chat.check_chat hands it over (vLLM's shape: arguments decoded to an object).
TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": {}}}]},
    {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is 18C and"},
]
TRIMMING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"


@pytest.mark.parametrize("options", [
    dict(add_generation_prompt=True), dict(add_generation_prompt=True, enable_thinking=False),
    dict(continue_final_message=True), dict(continue_final_message=True, chat_template=TRIMMING_TEMPLATE),
    dict(chat_template=TEMPLATE, add_generation_prompt=True), dict(chat_template="tools", add_generation_prompt=True),
    dict(bos_token="<B>"),  # (a keyword argument wins over the special token of that name, as in transformers)
], ids=["tools", "kwargs", "continue", "continue-trimmed", "request-template", "named-template", "over-special"])
def test_tool_calls_kwargs_continue_and_request_templates_render_as_transformers(byte_dir, options):
    _write_config(byte_dir, chat_template=[{"name": "default", "template": TOOL_TEMPLATE},
                                           {"name": "tools", "template": TEMPLATE}])
    fast, hf = load_tokenizer(byte_dir), _transformers(byte_dir)
    assert isinstance(fast, FastTokenizer)
    want = hf.apply_chat_template(TOOL_CHAT, tokenize=False, **options)
    assert fast.apply_chat_template(TOOL_CHAT, tokenize=False, **options) == want
    if options == dict(add_generation_prompt=True):
        assert '<call call_1 function weather {"city": "Paris"}><call call_2 function time {}>' in want
        assert "<|user|>[ann]Weather" in want and "<|tool|>(re call_1)18C" in want
    if options.get("continue_final_message"):
        assert want.endswith("It is 18C and")


def test_continue_final_message_refusals_are_transformers(byte_dir):
    _write_config(byte_dir, chat_template=TOOL_TEMPLATE)
    fast, hf = load_tokenizer(byte_dir), _transformers(byte_dir)
    for options in (dict(continue_final_message=True, add_generation_prompt=True),
                    dict(continue_final_message=True, chat_template="{% for m in messages %}{{ m.role }}{% endfor %}"),
                    dict(continue_final_message=True, chat_template="{% for m in messages %}{{ m.content[:2] }}"
                                                                    "{% endfor %}")):
        with pytest.raises(ValueError) as want:
            hf.apply_chat_template(TOOL_CHAT, tokenize=False, **options)
        with pytest.raises(ValueError) as got:
            fast.apply_chat_template(TOOL_CHAT, tokenize=False, **options)
        assert str(got.value)[:60] == str(want.value)[:60]


def test_template_errors_are_transformers_errors(byte_dir):
    _write_config(byte_dir, chat_template=RICH_TEMPLATE)
    fast, hf = load_tokenizer(byte_dir), _transformers(byte_dir)
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception) as want:
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(type(want.value), match="role tool is not supported"):
        fast.apply_chat_template(bad, tokenize=False)
    escape = "{{ messages.__class__.__mro__ }}"  # the sandbox refuses what transformers' sandbox refuses
    _write_config(byte_dir, chat_template=escape)
    fast, hf = load_tokenizer(byte_dir), _transformers(byte_dir)
    with pytest.raises(Exception) as want:
        hf.apply_chat_template(MESSAGES[0], tokenize=False)
    with pytest.raises(type(want.value)):
        fast.apply_chat_template(MESSAGES[0], tokenize=False)
    _write_config(byte_dir, chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(Exception, match="underscore-prefixed"):
        load_tokenizer(byte_dir).apply_chat_template(MESSAGES[0], tokenize=False)


def test_extra_special_tokens_missing_from_tokenizer_json(byte_dir):
    """Added as new special ids (259, 260): matched whole in text, skipped by decode(skip_special_tokens=True)."""
    _write_config(byte_dir, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                  chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast = assert_same(byte_dir)
    ids = fast("<|im_start|>user", add_special_tokens=False)["input_ids"]
    assert ids[0] == 259 and fast.decode(ids, skip_special_tokens=True) == "user"


def test_split_special_tokens(byte_dir):
    _write_config(byte_dir, split_special_tokens=True)
    fast = assert_same(byte_dir)
    assert 1 not in fast("<s>", add_special_tokens=False)["input_ids"]


def test_tokenizer_json_without_post_processor_adds_no_bos(byte_dir):
    spec = json.loads((byte_dir / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (byte_dir / "tokenizer.json").write_text(json.dumps(spec))
    _write_config(byte_dir, add_bos_token=True)  # ignored with a tokenizer.json, by transformers too
    fast = assert_same(byte_dir)
    assert fast("Hi")["input_ids"] == fast("Hi", add_special_tokens=False)["input_ids"]


def test_special_tokens_given_as_added_token_dicts(byte_dir):
    _write_config(byte_dir, bos_token={"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True, "__type": "AddedToken"})
    assert_same(byte_dir)


@pytest.mark.parametrize("change,reason", [
    ({"tokenizer_class": "LlamaTokenizer"}, "tokenizer_class 'LlamaTokenizer'"),
    ({"tokenizer_class": None}, "tokenizer_class None"),
    ({"image_token": "<image>"}, "model-specific special tokens"),
    ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "auto_map"),
])
def test_what_only_transformers_can_load_is_refused(byte_dir, change, reason):
    _write_config(byte_dir, **change)
    assert reason in fast_path_refusal(byte_dir)


def test_model_types_transformers_gives_their_own_tokenizer_are_refused(byte_dir):
    (byte_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "model_type 'qwen2'" in fast_path_refusal(byte_dir)
    assert type(_transformers(byte_dir)).__name__ == "Qwen2Tokenizer"


def test_own_tokenizer_types_match_transformers_table():
    """AutoTokenizer ignores a generic tokenizer_class for these model types; the list follows transformers'."""
    from transformers.models.auto import tokenization_auto as auto

    generic = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "MistralCommonBackend", ""}
    own = {m for m in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
           if (auto.TOKENIZER_MAPPING_NAMES.get(m) or "").removesuffix("Fast") not in generic}
    assert own == OWN_TOKENIZER_TYPES


def test_no_tokenizer_json_is_refused(byte_dir):
    (byte_dir / "tokenizer.json").unlink()
    assert fast_path_refusal(byte_dir) == "no tokenizer.json"


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))


def test_added_tokens_the_config_declares_but_tokenizer_json_lacks_fall_back_to_transformers(byte_dir, tmp_path):
    extra = {"content": "<extra>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}
    _write_config(byte_dir, added_tokens_decoder={"259": extra})
    log = Log()
    tok = load_tokenizer(byte_dir, log)
    assert not isinstance(tok, FastTokenizer)
    assert log.events[0][0] == "tokenizer_transformers" and "<extra>" in log.events[0][1]["reason"]
    assert tok("<extra>", add_special_tokens=False)["input_ids"] == [259]
    copy = tmp_path / "copy"  # the same directory with the token in tokenizer.json too: the fast path again
    shutil.copytree(byte_dir, copy)
    hf = _transformers(byte_dir)
    hf.save_pretrained(str(copy))
    assert_same(copy)


def test_named_special_tokens_become_special_even_when_tokenizer_json_says_not(byte_dir):
    spec = json.loads((byte_dir / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["special"] = False
    (byte_dir / "tokenizer.json").write_text(json.dumps(spec))
    fast = assert_same(byte_dir)
    h = fast("H", add_special_tokens=False)["input_ids"]
    assert fast.decode([1, *h, 2], skip_special_tokens=True) == "H"
