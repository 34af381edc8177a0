"""The Whisper-style audio encoder of Qwen2-Audio on vlserve.kernels: conv1d stem (GELU), learned positions,
pre-norm transformer layers (bidirectional `varlen_attention`, one segment per clip), 2x average pooling, LayerNorm.

The HF encoder runs every clip padded to the feature extractor's 30 s window and masks the padded keys; here each
clip runs only over its own frames, which gives the same outputs for the frames that become LLM tokens: the stem
reads 2 frames past the valid ones (the HF stem sees padding frames there too), the layers attend within the valid
frames, and pooling keeps floor(valid / 2) rows, exactly HF's `(valid - 2) // 2 + 1`.

Shapes: M = mel bins, F = feature frames of a clip, S = frames after the stride-2 conv, E = encoder width
(`d_model`). Parameter names follow the HF checkpoints (`conv1.weight`, `layers.N.self_attn.q_proj.weight`,
`layers.N.fc1.weight`, `embed_positions.weight`, `layer_norm.weight`) so weights load by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.kernels import varlen_attention
from vlserve.kernels.packed_linear import PackableConv1d, PackableLinear


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The audio-encoder fields vlserve reads from a checkpoint's `audio_config`."""

    num_mel_bins: int
    width: int  # E: d_model
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_source_positions: int  # S of a full window (1500 for 30 s)
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.width % self.num_heads:
            raise ValueError(f"audio width {self.width} must split into {self.num_heads} heads")


def qwen2_audio_encoder_config(audio_config) -> AudioEncoderConfig:
    """An HF Qwen2AudioEncoderConfig (4.57 or 5.x) -> AudioEncoderConfig."""
    return AudioEncoderConfig(
        num_mel_bins=int(audio_config.num_mel_bins),
        width=int(audio_config.d_model),
        num_layers=int(audio_config.encoder_layers),
        num_heads=int(audio_config.encoder_attention_heads),
        ffn_dim=int(audio_config.encoder_ffn_dim),
        max_source_positions=int(audio_config.max_source_positions),
        activation=str(getattr(audio_config, "activation_function", "gelu")),
    )


def conv_output_frames(num_frames: int) -> int:
    """Frames after the stride-2 conv of the stem: (F - 1) // 2 + 1."""
    return (num_frames - 1) // 2 + 1


def audio_output_tokens(num_frames: int) -> int:
    """LLM tokens of a clip with `num_frames` valid feature frames (conv stride 2, then 2x pooling), as HF counts."""
    return (conv_output_frames(num_frames) - 2) // 2 + 1


def _activation(name: str):
    acts = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}
    if name not in acts:
        raise ValueError(f"unsupported audio encoder activation {name!r}; supported: {', '.join(acts)}")
    return acts[name]


class AudioSelfAttention(nn.Module):
    """Multi-head self-attention with HF Whisper's names (k_proj has no bias) and order (queries scaled first)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = width // num_heads
        self.q_proj = PackableLinear(width, width)
        self.k_proj = PackableLinear(width, width, bias=False)
        self.v_proj = PackableLinear(width, width)
        self.out_proj = PackableLinear(width, width)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, bounds: list[int], max_len: int) -> torch.Tensor:
        n = x.shape[0]  # x: [N, E] (all clips' frames)
        q = (self.q_proj(x) * self.head_dim**-0.5).view(n, self.num_heads, self.head_dim)  # [N, heads, Hd]
        k = self.k_proj(x).view(n, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_heads, self.head_dim)
        out = varlen_attention(q, k, v, cu_seqlens, 1.0, max_seqlen=max_len, cu_seqlens_cpu=bounds)
        return self.out_proj(out.reshape(n, -1))  # [N, E]


class AudioEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(LN(x)), then x + fc2(act(fc1(LN(x))))."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioSelfAttention(cfg.width, cfg.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.fc1 = PackableLinear(cfg.width, cfg.ffn_dim)
        self.fc2 = PackableLinear(cfg.ffn_dim, cfg.width)
        self.final_layer_norm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.act = _activation(cfg.activation)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, bounds: list[int], max_len: int) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens, bounds, max_len)  # [N, E]
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen2AudioEncoder(nn.Module):
    """Mel features of several clips -> their pooled encoder states, concatenated in clip order."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.conv1 = PackableConv1d(cfg.num_mel_bins, cfg.width, kernel_size=3, padding=1)
        self.conv2 = PackableConv1d(cfg.width, cfg.width, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.width)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.act = _activation(cfg.activation)

    def _stem(self, mel: torch.Tensor, valid_frames: int) -> torch.Tensor:
        """One clip's mel `[M, F']` (F' >= valid + 2 frames, or the whole window) -> `[S, E]` for its valid frames."""
        x = self.act(self.conv1(mel.unsqueeze(0)))  # [1, E, F']
        x = self.act(self.conv2(x))  # [1, E, (F' - 1) // 2 + 1]
        s = conv_output_frames(valid_frames)
        if s > self.cfg.max_source_positions:
            raise ValueError(
                f"audio clip of {valid_frames} feature frames is longer than the encoder's "
                f"{self.cfg.max_source_positions * 2} frame window"
            )
        x = x[0, :, :s].transpose(0, 1)  # [S, E]
        return x + self.embed_positions.weight[:s]

    def forward(self, mels: list[torch.Tensor], valid_frames: list[int]) -> torch.Tensor:
        """`mels[i]` `[M, F_i]` with `valid_frames[i]` real frames -> `[sum_i floor(S_i / 2), E]`."""
        states = [self._stem(mel, n) for mel, n in zip(mels, valid_frames)]  # each [S_i, E]
        lengths = [s.shape[0] for s in states]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=states[0].device)
        x = torch.cat(states, dim=0)  # [sum S_i, E]
        for layer in self.layers:
            x = layer(x, cu, bounds, max(lengths))
        pooled = []
        for i, n in enumerate(lengths):
            clip = x[bounds[i] : bounds[i] + 2 * (n // 2)]  # [2 * (S_i // 2), E]
            pooled.append(clip.view(n // 2, 2, -1).mean(dim=1))  # [S_i // 2, E]
        return self.layer_norm(torch.cat(pooled, dim=0))  # [sum S_i // 2, E]
