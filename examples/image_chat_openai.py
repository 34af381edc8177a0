"""Chat about an image through a running vlserve server with the official `openai` client.

vlserve serve &                                           # the demo model on 127.0.0.1:8000
python examples/image_chat_openai.py --base-url http://127.0.0.1:8000/v1 [--image PATH]
"""

import argparse
import base64
import io
import random

from openai import OpenAI


def image_data_url(path: str | None) -> str:
    if path:
        with open(path, "rb") as f:
            data = f.read()
    else:
        from vlserve.demo.world import render_image, sample_scene

        buf = io.BytesIO()
        render_image(sample_scene(random.Random(1))).save(buf, format="PNG")
        data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--image", help="an image file (default: a rendered demo scene)")
    p.add_argument("--question", default="Describe the image.")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(args.image)}},
                {"type": "text", "text": args.question},
            ],
        }
    ]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
    print(f"{args.question} -> {reply.choices[0].message.content!r}")
    print("streamed: ", end="", flush=True)
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
