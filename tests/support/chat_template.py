"""A chat template for the byte tokenizer, and what transformers makes of it (test_chat.py, test_chat_e2e.py)."""

from __future__ import annotations

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if loop.first and m['role'] == 'assistant' %}"
            "{{ raise_exception('the conversation must not start with the assistant') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def template_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """transformers' own answer (a dict or a list, as its version has it)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
