"""Chat templates for test checkpoints that behave like the ones real checkpoints ship.

QWEN2_VL_CHAT_TEMPLATE follows the logic of the template Qwen2-VL / Qwen2.5-VL checkpoints carry: a default system
prompt, ChatML turns, and a media part recognised by `part['type'] == 'image'` or an 'image' / 'image_url' key
(videos by `part['type'] == 'video'` or a 'video' key); `add_vision_id=True` numbers them ("Picture 1: ").
Unlike vlserve.demo.tokenizer.CHAT_TEMPLATE it does not know `{"type": "image_url"}` without the key.

STRING_CHAT_TEMPLATE is ChatML that prints each message's content as one string (no content parts).
"""

from __future__ import annotations

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set pictures = namespace(n=0) %}{% set clips = namespace(n=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set pictures.n = pictures.n + 1 %}"
    "{% if add_vision_id %}Picture {{ pictures.n }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set clips.n = clips.n + 1 %}"
    "{% if add_vision_id %}Video {{ clips.n }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

STRING_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-Audio's template logic: a default system prompt, ChatML turns, and each audio part (`part['type'] ==
# 'audio'` or an 'audio' / 'audio_url' key) numbered as "Audio N: " followed by the audio markers and a newline.
QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set clips = namespace(n=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' or 'audio' in part or 'audio_url' in part %}"
    "{% set clips.n = clips.n + 1 %}"
    "Audio {{ clips.n }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
