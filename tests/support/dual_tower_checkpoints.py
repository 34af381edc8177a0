"""Tiny random CLIP (`CLIPModel`) and SigLIP (`SiglipModel`) checkpoints saved with save_pretrained, with their real
processors: CLIP's CLIPProcessor with a CLIPTokenizer built from a local character vocabulary; SigLIP's
SiglipProcessor with SiglipImageProcessor and a local word-level fast tokenizer (SigLIP's own tokenizer needs a
sentencepiece model)."""

from __future__ import annotations

import json
import os
import tempfile

import torch

TEXTS = ["a cat", "a big dog sat on the mat", "hello", "the quick brown fox jumps over"]
WORDS = sorted({w for t in TEXTS for w in t.split()} | {"photo", "of"})
TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def clip_processor():
    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    with tempfile.TemporaryDirectory() as files:  # vocab.json + merges.txt: what both transformers 4.57 and 5 load
        with open(os.path.join(files, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        with open(os.path.join(files, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")
        tokenizer = CLIPTokenizer.from_pretrained(files)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return CLIPProcessor(image_processor=images, tokenizer=tokenizer)


def siglip_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, SiglipImageProcessor, SiglipProcessor

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    images = SiglipImageProcessor(size={"height": 32, "width": 32})
    return SiglipProcessor(image_processor=images, tokenizer=tokenizer)


def build_checkpoint(family: str, path, text_positions: int | None = None) -> tuple:
    """Save a tiny random `family` checkpoint (and its processor) under `path`; returns (HF model, processor).
    `text_positions`: the text tower's max_position_embeddings (default 40 for CLIP, 16 for SigLIP)."""
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    torch.manual_seed(0)
    if family == "clip":
        processor = clip_processor()
        tok = processor.tokenizer
        text = dict(
            TINY_TOWER, vocab_size=len(tok), max_position_embeddings=text_positions or 40, eos_token_id=tok.eos_token_id
        )
        text |= dict(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
        config = CLIPConfig(
            text_config=text, vision_config=dict(TINY_TOWER, image_size=32, patch_size=8), projection_dim=16
        )
        model = CLIPModel(config)
    else:
        processor = siglip_processor()
        text = dict(TINY_TOWER, vocab_size=len(processor.tokenizer), max_position_embeddings=text_positions or 16)
        config = SiglipConfig(text_config=text, vision_config=dict(TINY_TOWER, image_size=32, patch_size=8))
        model = SiglipModel(config)
    with torch.no_grad():  # scales away from their init values, so a swap of the two would show
        model.logit_scale.fill_(1.7)
        if family == "siglip":
            model.logit_bias.fill_(-0.6)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model.eval(), processor


def features(output) -> torch.Tensor:
    """HF's get_*_features result: a tensor, or (transformers 5) an output whose pooler_output is the projection."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
