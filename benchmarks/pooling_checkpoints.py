"""The checkpoints `benchmarks.pooling` embeds with, built once each under a cache directory.

`qwen2_vl_embedder`: a random Qwen2-VL of 47.5M parameters (ViT 8 x 512 with its merger, LM 512 x 8), the real
Qwen2-VL processor classes and a chat template like the released checkpoints' (`benchmarks.serve_harness`'s builder,
the one `benchmarks.mm_serve` uses). `clip_checkpoint`: a random `CLIPModel` of ViT-B/32's shapes (vision 768 x 12,
patch 32, 224 px; text 512 x 12, 77 positions; projection 512) saved with a real `CLIPProcessor`: the OpenAI
image processor settings and a `CLIPTokenizer` whose BPE vocabulary and merges spell each word of `WORDS` as one
token (no hub download). `quick=True` builds the same families at a size that runs in seconds.
"""

from __future__ import annotations

import os

from benchmarks.serve_harness import build_checkpoint

# Lower-case words the text workloads draw from; each is one CLIP token (and a few Qwen2 tokens).
WORDS = (
    "a an the of in on at with and or to from by for over under near above below beside behind small large red "
    "blue green yellow black white old new bright dark quiet busy cat dog bird horse cow fish tree flower house "
    "street river mountain beach forest city car bus train boat bicycle road bridge window door table chair book "
    "lamp cup plate bowl apple orange bread cake child woman man people group photo picture image drawing view "
    "sitting standing running walking flying swimming sleeping eating reading playing holding looking morning "
    "evening night winter summer rain snow sun sky cloud field garden park market kitchen room wall floor roof"
).split()

QWEN2_VL_SIZES = {  # (vision depth, vision width, LM hidden, LM layers)
    "full": (8, 512, 512, 8),
    "quick": (1, 64, 64, 1),
}
# Tower shapes: (hidden, layers, heads, MLP); vision patch and image size; projection dim (vLLM's CLIP needs the
# text tower's width equal to it, as in ViT-B/32)
CLIP_SIZES = {
    "full": dict(vision=(768, 12, 12, 3072), text=(512, 12, 8, 2048), patch=32, image=224, projection=512),
    "quick": dict(vision=(64, 1, 2, 128), text=(64, 1, 2, 128), patch=32, image=64, projection=64),
}


def qwen2_vl_embedder(cache_dir: str, quick: bool = False) -> str:
    """The random Qwen2-VL under `cache_dir` (built on first use); returns its path."""
    return build_checkpoint(cache_dir, *QWEN2_VL_SIZES["quick" if quick else "full"])


def clip_tokenizer():
    """A CLIPTokenizer over `WORDS`: characters, then merges added word by word so that BPE (lowest rank first)
    joins every word into one token (a merge added later never applies before the ones a word already has), then
    the two special tokens."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for ch in sorted({c for w in WORDS for c in w}):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    ranks: dict[tuple[str, str], int] = {}
    for word in WORDS:
        pieces = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        while len(pieces) > 1:
            ranks[(pieces[0], pieces[1])] = len(ranks)
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
            pieces = _bpe(pieces, ranks)
    for special in ("<|startoftext|>", "<|endoftext|>"):  # last, as in OpenAI's vocabulary (vLLM's CLIP takes id 0
        vocab[special] = len(vocab)  # as its image placeholder and insists that it is no special token)
    return CLIPTokenizer(vocab=vocab, merges=list(ranks))


def _bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE as the tokenizer runs it: merge the lowest-ranked adjacent pair until none is known."""
    while len(pieces) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(pieces, pieces[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        pieces = pieces[:i] + [pieces[i] + pieces[i + 1]] + pieces[i + 2 :]
    return pieces


def clip_checkpoint(cache_dir: str, quick: bool = False, seed: int = 0) -> str:
    """The random CLIPModel under `cache_dir` (built on first use) with its CLIPProcessor; returns its path."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    size = "quick" if quick else "full"
    path = os.path.join(cache_dir, f"clip-{size}-s{seed}")
    if os.path.exists(os.path.join(path, ".complete")):
        return path
    shapes = CLIP_SIZES[size]
    tokenizer = clip_tokenizer()
    side = shapes["image"]
    images = CLIPImageProcessor(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )

    def tower(hidden, layers, heads, mlp):
        return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=mlp)

    text = tower(*shapes["text"]) | dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=77,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = tower(*shapes["vision"]) | dict(image_size=side, patch_size=shapes["patch"])
    for sub in (text, vision):  # released checkpoints repeat it in both (vLLM reads the sub-configs')
        sub["projection_dim"] = shapes["projection"]
    torch.manual_seed(seed)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=shapes["projection"])
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    open(os.path.join(path, ".complete"), "w").close()
    return path


def parameter_count(path: str) -> int:
    """Parameters in the checkpoint's safetensors files."""
    from safetensors import safe_open

    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    count = 1
                    for side in f.get_slice(key).get_shape():
                        count *= side
                    total += count
    return total
