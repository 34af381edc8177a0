"""Chat-template content format: detection from the Jinja syntax tree and the two renderings (no model needed)."""

from __future__ import annotations

import pytest

from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE, STRING_CHAT_TEMPLATE
from vlserve.demo.tokenizer import CHAT_TEMPLATE
from vlserve.engine.chat import (
    MEDIA_PLACEHOLDERS,
    detect_content_format,
    flatten_content,
    parse_chat_messages,
    resolve_content_format,
    to_content_format,
)

IMG = MEDIA_PLACEHOLDERS["image"]


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN2_VL_CHAT_TEMPLATE, "openai"),
        (CHAT_TEMPLATE, "openai"),
        (STRING_CHAT_TEMPLATE, "string"),
        # content reached through aliases: a sliced message list, attribute access, a `set` variable
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{{ messages[0]['content'][0]['text'] }}", "openai"),  # indexed by position
        ("{% for m in messages %}{{ m['content'] | trim }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for x in m['tool_calls'] %}{{ x }}{% endfor %}{{ m.content }}{% endfor %}",
            "string",
        ),
        (
            "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}{{ m.content }}{% endfor %}", "string"),
    ],
)
def test_detect_content_format(template, expected):
    assert detect_content_format(template) == expected


def test_detection_is_cached_and_forced_formats_win():
    detect_content_format.cache_clear()
    detect_content_format(STRING_CHAT_TEMPLATE)
    detect_content_format(STRING_CHAT_TEMPLATE)
    assert detect_content_format.cache_info().hits == 1
    assert resolve_content_format("openai", STRING_CHAT_TEMPLATE) == "openai"
    assert resolve_content_format("auto", {"default": STRING_CHAT_TEMPLATE}) == "string"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        resolve_content_format("x" * 500, STRING_CHAT_TEMPLATE)


def test_parts_become_modality_types_and_strings_like_vllm():
    messages, mm = parse_chat_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:a"}},
                    {"type": "text", "text": "one"},
                    {"type": "image_pil", "image_pil": "pil"},
                    {"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
                    {"type": "text", "text": "two"},
                ],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert mm == {"image": ["data:a", "pil"], "video": ["/v.mp4"]}
    assert messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "one"},
        {"type": "image"},
        {"type": "video"},
        {"type": "text", "text": "two"},
    ]
    flat = to_content_format(messages, "string")
    assert flat[0]["content"] == f"{IMG}\n{IMG}\n{MEDIA_PLACEHOLDERS['video']}\none\ntwo"
    assert flat[1]["content"] == ""
    assert to_content_format(messages, "openai") is messages


def test_flatten_keeps_placeholders_the_user_wrote():
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": f"first {IMG} then"}]
    assert flatten_content(parts) == f"{IMG}\nfirst {IMG} then"
    assert flatten_content([{"type": "image"}]) == f"{IMG}\n"


def test_engine_args_and_cli_take_the_content_format():
    from vlserve.cli import build_parser, serve_config_from_args
    from vlserve.config import EngineArgs

    with pytest.raises(ValueError, match="chat_template_content_format"):
        EngineArgs(chat_template_content_format="list")
    args = build_parser().parse_args(["serve", "/m", "--chat-template-content-format", "string"])
    assert serve_config_from_args(args)[0].chat_template_content_format == "string"
    assert serve_config_from_args(build_parser().parse_args(["serve", "/m"]))[0].chat_template_content_format == "auto"
