"""Reading a PEFT LoRA adapter directory (as `peft`'s `save_pretrained` writes it) onto the decoder's fused layers.

A PEFT adapter is `adapter_config.json` + `adapter_model.safetensors` with, per adapted HF projection,
`base_model.model.<module>.lora_A.weight` `[r, in]` and `...lora_B.weight` `[out, r]`; PEFT computes
`y = base(x) + (x @ A^T @ B^T) * scaling` with `scaling = alpha / r` (`alpha / sqrt(r)` under `use_rslora`), r and
alpha per module from `rank_pattern` / `alpha_pattern` when a pattern matches the module's name.

`<module>` is a causal LM's `model.layers.N.{self_attn,mlp}.<proj>` or a VLM's language model
(`model.language_model.layers.N...` in transformers 5, `language_model.model.layers.N...` in 4). Each of the seven
projections maps onto one of our modules: q/k/v_proj -> a slice of `self_attn.qkv_proj`, gate/up_proj -> a slice of
`mlp.gate_up_proj`, o_proj and down_proj -> themselves. Under tensor parallelism a column-parallel target
(qkv_proj, gate_up_proj) reads A whole and its rank's rows of B; a row-parallel one (o_proj, down_proj) its rank's
columns of A and B whole (the partial deltas are summed with the base output). The target layer object says which
rows and columns (`vlserve.lora.layers.LoRALayerMixin`), so this module knows no model class.

On a multimodal model an adapter may also target linears of the vision / audio tower and the projector (tower
LoRA): the caller passes `encoder_target`, which maps such a PEFT module name onto our linear (or None), and
each of those is one whole-output slice named by its leaf (`qkv`, `fc1`, `linear_1`, ...).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# HF projection -> (its block, our module holding it): q/k/v and gate/up live in fused matrices.
PROJECTIONS = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
# Where the text decoder's layers sit in a PEFT module name (after `base_model.model.`), most specific first.
_DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"^layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>\w+)$")


@dataclass(frozen=True)
class PeftLoRAConfig:
    """The fields of a PEFT `LoraConfig` that inference reads (lora_dropout is ignored: identity at inference)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    fan_in_fan_out: bool = False  # PEFT resets it to False on nn.Linear targets: lora_A/B are Linear-shaped anyway

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "adapter_config.json") -> PeftLoRAConfig:
        """Validate a parsed adapter_config.json; ValueError on what this engine does not run."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
        if cfg.get("modules_to_save"):
            raise ValueError(f"{where}: modules_to_save={cfg['modules_to_save']!r} is not supported yet")
        for flag in ("use_dora", "lora_bias"):
            if cfg.get(flag):
                raise ValueError(f"{where}: {flag}=True is not supported")
        r = cfg.get("r")
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
        targets = cfg.get("target_modules") or ()
        targets = targets if isinstance(targets, str) else tuple(sorted(targets))
        return cls(
            r=r,
            lora_alpha=float(cfg.get("lora_alpha", 8)),
            use_rslora=bool(cfg.get("use_rslora", False)),
            target_modules=targets,
            rank_pattern=dict(cfg.get("rank_pattern") or {}),
            alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
            fan_in_fan_out=bool(cfg.get("fan_in_fan_out", False)),
        )

    def rank_alpha(self, module_key: str) -> tuple[int, float]:
        """`(r, alpha)` of the module named `module_key` (PEFT's name, e.g. `model.layers.0.self_attn.q_proj`)."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module_key), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module_key), self.lora_alpha)
        return int(r), float(alpha)

    def scaling(self, module_key: str) -> float:
        """What PEFT multiplies the module's delta by: alpha / r, or alpha / sqrt(r) under use_rslora."""
        r, alpha = self.rank_alpha(module_key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: Mapping[str, object], key: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern that matches a dotted suffix of `key`, else `key` itself."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


@dataclass
class LoRAWeights:
    """One HF projection's adapter, ready for this rank: `lora_a [r, in_local]`, `lora_b [out_local, r]` with the
    scaling folded in, filling slice `piece` of our module `module` (decoder-relative, e.g.
    `layers.0.self_attn.qkv_proj`)."""

    module: str
    piece: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        """r of this projection."""
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    """A parsed adapter in host memory: its weights keyed by `(our module, HF projection)`."""

    lora_int_id: int
    config: PeftLoRAConfig
    weights: dict[tuple[str, str], LoRAWeights]
    encoder_modules: frozenset[str] = frozenset()  # our tower / projector linears it changes (tower LoRA)

    @property
    def rank(self) -> int:
        """The largest r over its modules."""
        return max(w.rank for w in self.weights.values())

    def modules(self) -> set[str]:
        """Our modules this adapter changes."""
        return {m for m, _ in self.weights}


def read_peft_files(path: str) -> tuple[PeftLoRAConfig, dict[str, torch.Tensor]]:
    """`(config, {tensor name: tensor})` of the adapter directory `path`; ValueError when a file is missing."""
    from safetensors.torch import load_file

    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise ValueError(f"LoRA adapter {path!r}: missing {os.path.basename(p)}")
    with open(cfg_path) as f:
        config = PeftLoRAConfig.from_dict(json.load(f), cfg_path)
    return config, load_file(w_path)


def check_adapter_dir(path: str, max_lora_rank: int) -> PeftLoRAConfig:
    """The quick checks of an adapter directory, before its weights are read: both files present, the config valid,
    no rank (r or a rank_pattern entry) above `max_lora_rank`. ValueError names what fails."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    for p in (cfg_path, os.path.join(path, WEIGHTS_FILE)):
        if not os.path.isfile(p):
            raise ValueError(f"LoRA adapter {path!r}: missing {os.path.basename(p)}")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} does not parse ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    config = PeftLoRAConfig.from_dict(raw, cfg_path)
    rank = max([config.r, *(int(r) for r in config.rank_pattern.values())])
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank {rank} is above max_lora_rank {max_lora_rank}")
    return config


_ENCODER_TOUCH_CACHE: dict[tuple[str, int], bool] = {}


def adapter_targets_encoder(path: str) -> bool:
    """Whether the adapter at `path` holds weights outside the text decoder (a tower or projector: its image
    embeddings then depend on the adapter); reads only the safetensors header, cached per (path, mtime). False
    when the file cannot be read (loading it reports that)."""
    from safetensors import safe_open

    w_path = os.path.join(path, WEIGHTS_FILE)
    try:
        key = (w_path, os.stat(w_path).st_mtime_ns)
    except OSError:
        return False
    if key not in _ENCODER_TOUCH_CACHE:
        with safe_open(w_path, framework="pt") as f:
            modules = {m["module"] for m in map(_KEY.match, f.keys()) if m is not None}
        _ENCODER_TOUCH_CACHE[key] = any(decoder_module_of(m) is None for m in modules)
    return _ENCODER_TOUCH_CACHE[key]


def decoder_module_of(module_key: str) -> str | None:
    """PEFT module name -> the decoder-relative HF name (`layers.N.self_attn.q_proj`), or None when it is not one
    of the text decoder's seven projections (vision tower, projector, embeddings, lm_head)."""
    for prefix in _DECODER_PREFIXES:
        if module_key.startswith(prefix):
            rel = module_key[len(prefix) :]
            m = _LAYER.match(rel)
            if m and m["proj"] in PROJECTIONS and PROJECTIONS[m["proj"]][0] == m["block"]:
                return rel
            return None
    return None


def _check_targets(config: PeftLoRAConfig, where: str) -> None:
    """ValueError naming target_modules entries that are not decoder projections (list form only: a regex is
    checked through the tensors it produced)."""
    if isinstance(config.target_modules, str):
        return
    unknown = [t for t in config.target_modules if t.rsplit(".", 1)[-1] not in PROJECTIONS]
    if unknown:
        raise ValueError(
            f"{where}: target_modules {unknown} are not supported; LoRA applies to the text decoder's "
            f"projections only ({', '.join(PROJECTIONS)})"
        )


EncoderTarget = Callable[[str], "tuple[str, object] | None"]


def load_peft_adapter(
    path: str,
    targets: Mapping[str, object],
    max_lora_rank: int,
    lora_int_id: int = 0,
    encoder_target: EncoderTarget | None = None,
    files: tuple[PeftLoRAConfig, dict[str, torch.Tensor]] | None = None,
) -> LoRAAdapter:
    """Parse the PEFT adapter at `path` onto `targets` (decoder-relative module name -> LoRA-capable layer, see
    `vlserve.lora.layers`), slicing A and B for this tensor-parallel rank and folding the scaling into B.
    `encoder_target(PEFT module name)` -> `(our module name, its LoRA layer)` or None resolves the modules outside
    the decoder (a multimodal model's tower and projector); without it those are refused. `files`: what
    `read_peft_files(path)` returned, when the caller read them already (on another thread).

    ValueError: missing files, unsupported config fields, modules outside the decoder's projections (named),
    modules the model has no LoRA layer for, a rank above `max_lora_rank`, A/B shapes that do not fit the base.
    """
    config, tensors = read_peft_files(path) if files is None else files
    if encoder_target is None:
        _check_targets(config, path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for name, tensor in tensors.items():
        m = _KEY.match(name)
        if m is None:
            others.append(name)
        else:
            pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if others:
        raise ValueError(
            f"LoRA adapter {path!r}: unsupported tensors {sorted(others)[:5]} (only lora_A / lora_B "
            "weights of linear projections are supported)"
        )
    outside = sorted(k for k in pairs if decoder_module_of(k) is None)
    encoder = {k: encoder_target(k) for k in outside} if encoder_target is not None else {}
    unresolved = [k for k in outside if encoder.get(k) is None]
    if unresolved:
        where = (
            "the text decoder's projections or a linear of the vision / audio tower or projector"
            if encoder_target is not None
            else "the text decoder's projections"
        )
        raise ValueError(
            f"LoRA adapter {path!r} targets modules outside {where}: {unresolved[:6]}"
            f"{' ...' if len(unresolved) > 6 else ''} (LoRA on embeddings, lm_head"
            f"{'' if encoder_target is not None else ', vision towers, projectors'} and non-linear "
            "layers is not supported)"
        )
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_A / lora_B weights")
    weights: dict[tuple[str, str], LoRAWeights] = {}
    for key, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {key} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        if key in encoder:
            ours, target = encoder[key]
            proj = ours.rpartition(".")[2]
            weights[(ours, proj)] = _prepare(key, ours, proj, ab["A"], ab["B"], config, target, max_lora_rank, path)
            continue
        rel = decoder_module_of(key)
        layer_path, _, proj = rel.rpartition(".")
        ours = f"{layer_path}.{PROJECTIONS[proj][1]}"
        target = targets.get(ours)
        if target is None:
            raise ValueError(f"LoRA adapter {path!r}: {key} has no LoRA-capable layer in this model ({ours})")
        weights[(ours, proj)] = _prepare(key, ours, proj, ab["A"], ab["B"], config, target, max_lora_rank, path)
    return LoRAAdapter(lora_int_id, config, weights, frozenset(ours for ours, _ in encoder.values()))


def _prepare(
    key: str,
    module: str,
    piece: str,
    a: torch.Tensor,
    b: torch.Tensor,
    config: PeftLoRAConfig,
    target,
    max_lora_rank: int,
    path: str,
) -> LoRAWeights:
    """Check one projection's A `[r, in]` / B `[out, r]` against the config and the target layer; slice them for
    this rank (A's columns for row-parallel targets, B's rows for column-parallel ones); fold the scaling into B."""
    r, _ = config.rank_alpha(key)
    where = f"LoRA adapter {path!r}: {key}"
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair up")
    if a.shape[0] != r:
        raise ValueError(f"{where}: rank {a.shape[0]} in the weights, {r} in adapter_config.json")
    if r > max_lora_rank:
        raise ValueError(f"{where}: rank {r} is above max_lora_rank {max_lora_rank}")
    in_start, in_count, in_total = target.checkpoint_in_cols()
    out_start, out_count, out_total = target.checkpoint_out_rows(piece)
    if (
        a.shape[1] != in_total
        or (out_total is not None and b.shape[0] != out_total)
        or b.shape[0] < out_start + out_count
    ):
        raise ValueError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base layer "
            f"(in {in_total}, out {out_total if out_total is not None else out_count})"
        )
    a = a[:, in_start : in_start + in_count].float().contiguous()  # [r, in_local]
    b = (b[out_start : out_start + out_count].float() * config.scaling(key)).contiguous()  # [out_local, r]
    return LoRAWeights(module=module, piece=piece, lora_a=a, lora_b=b)
