"""The server half of a family's HF-parity tests: one image chat over `vlserve serve` (in-process) and the openai
client, the reply equal to HF's greedy text and the prompt token count to HF's."""

from __future__ import annotations

from tests.support.hf_oracle import data_url


def assert_server_image_parity(
    model_dir: str,
    image,
    want_ids: list[int],
    tokenizer,
    prompt_tokens: int,
    max_tokens: int,
    served_name: str = "tiny-vlm",
    question: str = "What is this?",
    **engine_kw,
) -> None:
    """Ask the server about `image` greedily (EOS ignored, `max_tokens`); the reply must decode `want_ids` and the
    usage must count `prompt_tokens`. `engine_kw` go to EngineArgs (default float32, 128 KV blocks)."""
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    kw = {"dtype": "float32", "num_kv_blocks": 128, "max_num_batched_tokens": 16, **engine_kw}
    served = start_server(EngineArgs(model=model_dir, served_model_name=served_name, **kw))
    try:
        r = served.client.chat.completions.create(
            model=served_name,
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(image)}},
                        {"type": "text", "text": question},
                    ],
                }
            ],
        )
        # a stream ending inside a UTF-8 sequence holds that partial character back
        want = tokenizer.decode(want_ids, skip_special_tokens=True).rstrip("\ufffd")
        assert r.choices[0].message.content.rstrip("\ufffd") == want and want
        assert r.usage.prompt_tokens == prompt_tokens
        served.wait_idle()
    finally:
        served.close()
