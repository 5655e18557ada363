"""Chat templates: kiln's jinja2 rendering equals transformers' ``apply_chat_template`` on real-world
templates (written out here: Llama-3, ChatML/Qwen2.5 with tools, Mistral with raise_exception), and the
sandbox holds."""

from __future__ import annotations

import pytest

from kiln.serving.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

from synthetic_checkpoints import CHAT_TEMPLATE

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501  (the template as Qwen2.5 ships it)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "  You fire clay.  "}, {"role": "user", "content": "Héllo 東京 🙂\nline two"},
     {"role": "assistant", "content": "It is hot."}, {"role": "user", "content": "How hot?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "name": None},
     {"role": "user", "content": ""}],
]
TOOLS = [{"type": "function", "function": {
    "name": "kiln_temp", "description": "Température du four",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string"}}}}}]
TOOL_CHAT = [{"role": "user", "content": "Temperature?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "kiln_temp", "arguments": {"unit": "°C"}}}]},
             {"role": "tool", "content": "1250"}, {"role": "tool", "content": "rising"}]


@pytest.fixture(scope="module")
def ckpt(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def kiln_template(ckpt, tmp_path, source: str) -> ChatTemplate:
    path = tmp_path / "template.jinja"
    path.write_text(source)
    return load_chat_template(ckpt, path)   # special tokens from the checkpoint's tokenizer_config.json


@pytest.mark.parametrize("source", [LLAMA3, QWEN25, MISTRAL, CHAT_TEMPLATE],
                         ids=["llama3", "qwen2.5", "mistral", "kiln-synthetic"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(ckpt, hf_tokenizer, tmp_path, source, add_generation_prompt):
    template = kiln_template(ckpt, tmp_path, source)
    checked = 0
    for chat in CHATS:
        try:
            want = hf_tokenizer.apply_chat_template(chat, chat_template=source, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        except Exception as exc:   # the template refuses this chat (Mistral: a system role): so must kiln
            with pytest.raises(ChatTemplateError, match="refused"):
                template.render(chat, add_generation_prompt)
            assert "roles" in str(exc)
            continue
        assert template.render(chat, add_generation_prompt) == want
        checked += 1
    assert checked >= 2


def test_tools_and_tool_calls_render_like_transformers(ckpt, hf_tokenizer, tmp_path):
    """tojson (no HTML escaping, non-ASCII kept), tools, tool calls and tool responses, as Qwen2.5 uses them."""
    template = kiln_template(ckpt, tmp_path, QWEN25)
    want = hf_tokenizer.apply_chat_template(TOOL_CHAT, tools=TOOLS, chat_template=QWEN25, tokenize=False,
                                            add_generation_prompt=True)
    assert template.render(TOOL_CHAT, True, tools=TOOLS) == want
    assert '"Température du four"' in want and "°C" in want


def test_engine_directory_template_and_tokens(ckpt, hf_tokenizer):
    """The synthetic checkpoint's own template (as the builder copies it) tokenizes like transformers'."""
    template = load_chat_template(ckpt)
    assert template is not None and template.special_tokens["bos_token"] == "<s>"
    chat = CHATS[1]
    text = template.render(chat)
    want_ids = hf_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
    assert hf_tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids == list(want_ids)


def test_missing_template_and_bad_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": {"content": "<s>", "__type": "AddedToken"}}')
    assert load_chat_template(tmp_path) is None
    (tmp_path / "t.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(tmp_path, tmp_path / "t.jinja").render([{"role": "user", "content": "x"}]) == "<s>x"
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(tmp_path, tmp_path / "bad.jinja")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "D"}, '
                                                    '{"name": "tool_use", "template": "T"}]}')
    assert load_chat_template(tmp_path).render([]) == "D"
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        load_chat_template(tmp_path)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__subclasses__() }}",
    "{% set ns = namespace(_x=1) %}",
    "{% set ns = namespace(a=1) %}{% set ns._hidden = 2 %}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ dict.__init__.__globals__ }}",
])
def test_sandbox_refuses_escapes(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
