"""Image search with the pooling runner: embed a few pictures, embed a text query, rank the pictures by cosine.

python examples/image_search.py [--model DIR] [--query TEXT]        # offline: LLM(runner="pooling").score
python examples/image_search.py --server http://127.0.0.1:8000      # the same ranking from a pooling server's /v1/rerank

The default model is the embedded demo model served as an embedder (`convert="embed"`: the last token's hidden state,
normalized). The pictures are rendered shape scenes whose true description is printed beside each score.
"""

import argparse
import base64
import io
import random
from dataclasses import replace

from vlserve.demo.world import COLORS, describe_image, render_image, sample_scene

PICTURES = [("triangle", "red"), ("circle", "red"), ("triangle", "blue"), ("square", "green"), ("triangle", "yellow")]


def pictures(seed: int = 0):
    """One single-shape scene per (shape, color) of PICTURES, rendered: [(description, PIL image)]."""
    rng = random.Random(seed)
    out = []
    for kind, color in PICTURES:
        scene = sample_scene(rng, num_shapes=1)
        shape = replace(scene.shapes[0], kind=kind, color=color, fill=COLORS[color])
        scene = replace(scene, shapes=(shape,))
        out.append((describe_image(scene), render_image(scene)))
    return out


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def document(image) -> dict:
    """A picture as a scoring input: vLLM's multimodal content (the image, then the instruction it is embedded with)."""
    return {
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": "Describe the image."},
        ]
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local checkpoint (default: the demo model)")
    p.add_argument("--query", default="a red triangle")
    p.add_argument("--server", default=None, help="a running `vlserve serve ... --runner pooling` to ask /v1/rerank")
    args = p.parse_args()
    pics = pictures()
    docs = [document(image) for _, image in pics]
    if args.server:
        import httpx

        body = {"query": args.query, "documents": docs, "top_n": len(docs), "return_documents": False}
        results = httpx.post(args.server.rstrip("/") + "/v1/rerank", json=body, timeout=120).json()["results"]
        ranking = [(r["relevance_score"], r["index"]) for r in results]
    else:
        from vlserve import LLM

        llm = LLM(args.model, runner="pooling", convert="embed", dtype="float32")
        outs = llm.score(args.query, docs, use_tqdm=False)
        ranking = sorted(((o.outputs.score, i) for i, o in enumerate(outs)), reverse=True)
    print(f"query: {args.query!r}")
    for rank, (score, i) in enumerate(ranking, 1):
        print(f"{rank}. {score:+.4f}  picture {i}: {pics[i][0]}")


if __name__ == "__main__":
    main()
