"""A chat template for the byte tokenizer, and what transformers makes of it (test_chat.py, test_chat_e2e.py)."""

from __future__ import annotations

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if loop.first and m['role'] == 'assistant' %}"
            "{{ raise_exception('the conversation must not start with the assistant') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def template_ids(tokenizer, messages, add_generation_prompt: bool = True, **options) -> list[int]:
    """transformers' own answer (a dict or a list, as its version has it); ``options``: apply_chat_template's
    (continue_final_message, chat_template, the template's variables)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **options)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# A template that prints what a tool-using conversation carries (name, tool_call_id, tool_calls with arguments as
# JSON) and a variable from chat_template_kwargs (enable_thinking), as real tool-use templates (Qwen, Llama 3.1) do.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.name is defined %}[{{ m.name }}]{% endif %}"
    "{% if m.tool_call_id is defined %}(re {{ m.tool_call_id }}){% endif %}"
    "{{ m['content'] }}"
    "{% for c in m.tool_calls | default([]) %}"
    "<call {{ c.id }} {{ c.type }} {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")
