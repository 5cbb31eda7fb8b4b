"""Chat templates of the two families users bring most, written here (nothing downloads), on the
testbed tokenizer: a Qwen3-style ChatML template (a ``<think>`` block on the turns after the last user
query, dropped from earlier turns; tool calls; ``enable_thinking``) and a Llama-3-style template."""

from __future__ import annotations

from pathlib import Path

QWEN3_STYLE = """\
{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}\
{%- endif %}{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}\
{{- '\\n</tools><|im_end|>\\n' }}\
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}\
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}{%- set reasoning = message.reasoning_content or '' %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}\
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
{%- for call in message.tool_calls or [] %}{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}\
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}\
{{- call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}\
{{- '}\\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}\
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""

LLAMA3_STYLE = """\
{{- '<|begin_of_text|>' }}{%- for message in messages %}\
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}\
{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

TEMPLATES = {"qwen3": QWEN3_STYLE, "llama3": LLAMA3_STYLE}
SPECIAL = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
#: the token that ends an assistant turn in each template
END_OF_TURN = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}


def chat_tokenizer(family: str, folder: Path | None = None):
    """The testbed tokenizer with ``family``'s special tokens and chat template (saved to ``folder`` if given)."""
    from transformers import AutoTokenizer

    from distill.testbed import ASSETS

    tok = AutoTokenizer.from_pretrained(ASSETS / "testbed_target")
    tok.add_tokens(SPECIAL[family], special_tokens=True)
    tok.chat_template = TEMPLATES[family]
    if folder is not None:
        tok.save_pretrained(folder)
    return tok
