"""Chat templates pagedkv writes for built-in models whose own template renders no tools.

SmolLM2-135M-Instruct's template (the GGUF's, as on the hub) is plain ChatML: it drops a request's ``tools`` and an
assistant turn's ``tool_calls``, so a model served with it never sees a tool, and --tool-call-parser auto finds no
parser in it. ``SMOLLM2_TOOLS`` is the same ChatML with tools added the way the ChatML families that call tools
(Hermes, Qwen, SmolLM3) do: the tools in ``<tools></tools>`` in the system turn, each call written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a tool's result as ``<tool_response>`` in a user
turn; vLLM ships such templates for checkpoints without one (``examples/tool_chat_template_*.jinja``). Without tools
or tool turns it renders exactly what the original renders (tests/unit/test_chat_templates.py), so answers to
plain chats and their prefix-cache keys do not change; with tools, auto finds ``hermes`` from its ``<tool_call>``.
"""

from __future__ import annotations

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# The GGUF's template, as the built-in model had it before (kept for the test that the two agree without tools).
SMOLLM2_PLAIN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    + SMOLLM2_SYSTEM + "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SMOLLM2_TOOLS = """\
{%- macro content(m) -%}{{ m['content'] if m['content'] is string else '' }}{%- endmacro -%}
{%- if tools %}{{ '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{ content(messages[0]) }}{% else %}""" + SMOLLM2_SYSTEM + """{% endif %}
{{- '\n\nYou may call one or more functions to assist with the user query. The functions are given within \
<tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}
{{- '\n</tools>\n\nTo call a function, answer with a JSON object with its name and arguments within \
<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n\
</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and message['role'] == 'system' and tools %}
{%- elif loop.first and message['role'] != 'system' and not tools %}
{{- '<|im_start|>system\n""" + SMOLLM2_SYSTEM + """<|im_end|>\n' }}
{%- endif %}
{%- if loop.first and message['role'] == 'system' and tools %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|im_start|>assistant\n' + content(message) }}
{%- for call in message['tool_calls'] %}
{%- set f = call['function'] if call['function'] is defined else call %}
{{- ('\n' if content(message) or not loop.first else '') + '<tool_call>\n{"name": "' + f['name'] + \
'", "arguments": ' }}
{{- f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}\n</tool_call>' }}
{%- endfor %}{{ '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + content(message) + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
