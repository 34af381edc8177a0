"""INT8 media towers (`mm_encoder_quantization="int8"`, `models.quantization.encoder_int8`): the option is checked
and reaches the engine from the CLI; the walk quantizes every tower and projector linear (counted from the
checkpoint's config) and nothing else; a quantized layer is bit-equal to `int8_linear_ref` on its int8 weight; a
quantized tower stays close to the float one; `LLM` generates with it and reuses cached embeddings; tower LoRA is
refused on quantized towers."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image
from torch import nn

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.config import EngineArgs
from vlserve.encoders import Qwen2VisionTower
from vlserve.encoders.vision_layers import VisionTowerConfig
from vlserve.kernels import quant_linear_cpu as QC
from vlserve.kernels.packed_linear import PackableLinear, PatchConv3d, pack_linears_for_cpu
from vlserve.kernels.quant_linear import int8_linear_ref
from vlserve.models.quantization.encoder_int8 import EncoderInt8Scheme, quantize_encoder_linears, quantize_weight_int8


class _TowerHolder(nn.Module):
    """A model whose one encoder part is `tower` (what `quantize_encoder_linears` walks)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.visual = tower

    def encoder_parts(self) -> list[nn.Module]:
        return [self.visual]


def _relative_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return float((out - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------------------------- options


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="mm_encoder_quantization must be None or 'int8'"):
        EngineArgs(mm_encoder_quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        EngineArgs(mm_encoder_quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="not supported"):
        quantize_encoder_linears(_TowerHolder(nn.Identity()), "fp8")
    with pytest.raises(ValueError, match="CPU only for now; visual is on meta"):  # (a CUDA tower alike)
        quantize_encoder_linears(_TowerHolder(PackableLinear(8, 8).to("meta")), "int8")


def test_the_cli_flag_reaches_the_engine_args():
    from vlserve.cli import build_parser, serve_config_from_args

    engine_args, _ = serve_config_from_args(build_parser().parse_args(["serve", "--mm-encoder-quantization", "int8"]))
    assert engine_args.mm_encoder_quantization == "int8"
    engine_args, _ = serve_config_from_args(build_parser().parse_args(["serve"]))
    assert engine_args.mm_encoder_quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mm-encoder-quantization", "int4"])


def test_shared_caches_keep_int8_towers_apart(qwen2_vl_dir):
    """Encoder outputs shared on disk and offloaded KV blocks (which hold media tokens) carry the option."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from vlserve.engine.kv_transfer_setup import encoder_namespace, model_namespace

    loaded = SimpleNamespace(
        model_path=qwen2_vl_dir, hf_config=AutoConfig.from_pretrained(qwen2_vl_dir), dtype=torch.float32
    )
    float_args, int8_args = EngineArgs(), EngineArgs(mm_encoder_quantization="int8")
    assert encoder_namespace(float_args, loaded) != encoder_namespace(int8_args, loaded)
    assert model_namespace(float_args, loaded, torch.float32) != model_namespace(int8_args, loaded, torch.float32)


def test_a_rank_process_loads_int8_towers_from_its_settings(qwen2_vl_dir):
    """The executor's ranks (mp, ray, the engine process) load from `WorkerSettings.args`."""
    from vlserve.executor.worker import WorkerSettings, load_rank_model

    args = EngineArgs(model=qwen2_vl_dir, dtype="float32", device="cpu", mm_encoder_quantization="int8")
    rank = load_rank_model(WorkerSettings(args, qwen2_vl_dir, 512, 512), rank=0)
    assert isinstance(rank.model.visual.merger.mlp[0].quant_scheme, EncoderInt8Scheme)


def test_a_text_model_is_refused(tmp_path):
    from vlserve.demo.checkpoints import build_text_checkpoint

    model_dir = build_text_checkpoint(str(tmp_path / "text"), arch="qwen2", hidden_size=64, num_layers=1)
    with pytest.raises(ValueError, match="needs a multimodal model"):
        LLM(model_dir, device="cpu", num_kv_blocks=16, mm_encoder_quantization="int8")


# ------------------------------------------------------------------------------------------------- the walk


def _expected_count(model_dir: str) -> int:
    """Tower + merger linears from the checkpoint's config: qkv, proj, fc1, fc2 a Qwen2-VL block (qkv, proj,
    gate, up, down a Qwen2.5-VL one), and the merger's two."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    per_block = 5 if cfg.model_type == "qwen2_5_vl" else 4
    return per_block * cfg.vision_config.depth + 2


def test_every_tower_linear_is_quantized_and_nothing_else(vl_dir):
    from transformers import AutoConfig

    from vlserve.models import load_model

    model = load_model(vl_dir, AutoConfig.from_pretrained(vl_dir), torch.float32, "cpu", mm_encoder_quantization="int8")
    quantized = [m for m in model.modules() if isinstance(m.__dict__.get("quant_scheme"), EncoderInt8Scheme)]
    assert len(quantized) == _expected_count(vl_dir)
    assert all(m.weight is None for m in quantized)  # the float matrix is not held beside the int8 one
    assert all(m.quant_weights.scale.shape == (m.out_features,) for m in quantized)
    tower_linears = [m for m in model.visual.modules() if isinstance(m, PackableLinear)]
    assert {id(m) for m in tower_linears} == {id(m) for m in quantized}  # the tower and merger: all of them
    assert not any(getattr(m, "quant_scheme", None) for m in model.language_model.modules())
    patch = [m for m in model.visual.modules() if isinstance(m, PatchConv3d)]
    assert patch and all(m.weight is not None and m.weight.dtype == torch.float32 for m in patch)
    norms = [m for m in model.visual.modules() if "norm" in type(m).__name__.lower()]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)


# ------------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_quantized_layer_is_bit_equal_to_the_reference(dtype, rows):
    torch.manual_seed(rows)
    layer = PackableLinear(160, 96).to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    quantize_encoder_linears(_TowerHolder(layer), "int8")
    if QC.quant_kernel() is not None:
        assert layer.quant_weights.cpu is not None  # the C++ kernel runs, not the reference against itself
    q, scale = quantize_weight_int8(weight)
    x = torch.randn(rows, 160).to(dtype)
    assert torch.equal(layer(x), int8_linear_ref(x, q, scale, bias))


def test_the_weight_scale_is_per_output_channel():
    """Rows of the matrix 100x apart in size: per-row absmax scales keep every row's relative error small; the
    scale laid along the input instead (a transposed scale) or one per tensor fails the same bound."""
    torch.manual_seed(0)
    row_size = torch.logspace(-2, 0, 96).unsqueeze(1)  # [N, 1]
    weight = torch.randn(96, 160) * row_size
    x = torch.randn(64, 160)
    ref = x @ weight.t()
    q, scale = quantize_weight_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.allclose(scale, weight.abs().amax(dim=1) / 127)
    good = _relative_error(ref, int8_linear_ref(x, q, scale, None))
    assert good < 0.02
    col_scale = weight.abs().amax(dim=0) / 127  # [K]: the transposed scale
    transposed = torch.round(weight / col_scale).clamp(-127, 127) * col_scale
    per_tensor = torch.round(weight / scale.max()).clamp(-127, 127) * scale.max()
    for wrong in (transposed, per_tensor):
        out = x @ wrong.t()
        assert max(_relative_error(ref[:, i], out[:, i]) for i in range(96)) > 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_tower_stays_close_to_the_float_one(dtype):
    torch.manual_seed(0)
    cfg = VisionTowerConfig(depth=4, width=128, num_heads=4, mlp_hidden=512, hidden_act="quick_gelu", out_dim=96)
    tower = Qwen2VisionTower(cfg)
    for m in tower.modules():
        if isinstance(m, (PackableLinear, PatchConv3d)):
            nn.init.normal_(m.weight, std=0.05)
        if isinstance(m, PackableLinear):  # output rows 100x apart in size: a scale not per row shows
            m.weight.data.mul_(torch.logspace(-2, 0, m.out_features).unsqueeze(1)[torch.randperm(m.out_features)])
    float_tower = copy.deepcopy(tower).to(dtype)
    int8_model = _TowerHolder(copy.deepcopy(tower).to(dtype))
    assert quantize_encoder_linears(int8_model, "int8") == 4 * cfg.depth + 2
    pack_linears_for_cpu(float_tower, many_rows=[float_tower])
    pack_linears_for_cpu(int8_model, many_rows=[int8_model.visual])
    grids = [(1, 16, 16), (2, 8, 12)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14).to(dtype)
    with torch.inference_mode():
        ref, out = float_tower(pixels, grids), int8_model.visual(pixels, grids)  # [P / 4, 96]
    assert out.shape == ref.shape and out.dtype == dtype
    assert _relative_error(ref, out) < 0.05
    assert torch.nn.functional.cosine_similarity(ref.float().flatten(), out.float().flatten(), dim=0) > 0.998
    # layer by layer, every output channel (a scale per tensor or along the input fails its small rows)
    pairs = zip(
        [m for m in float_tower.modules() if isinstance(m, PackableLinear)],
        [m for m in int8_model.visual.modules() if isinstance(m, PackableLinear)],
    )
    for float_layer, int8_layer in pairs:
        x = torch.randn(32, float_layer.in_features).to(dtype)
        with torch.inference_mode():
            a, b = float_layer(x), int8_layer(x)  # [32, N]
        assert max(_relative_error(a[:, i], b[:, i]) for i in range(a.shape[1])) < 0.05


# ------------------------------------------------------------------------------------------------- the engine


def _image_prompt(model_dir: str, image) -> dict:
    from vlserve.multimodal.processor import load_hf_processor

    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = load_hf_processor(model_dir).apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "multi_modal_data": {"image": [image]}}


def test_generate_with_int8_towers_reuses_cached_embeddings(qwen2_vl_dir):
    llm = LLM(qwen2_vl_dir, dtype="float32", device="cpu", num_kv_blocks=256, mm_encoder_quantization="int8")
    visual = llm.engine.runner.model.visual
    assert isinstance(visual.blocks[0].mlp.fc1.quant_scheme, EncoderInt8Scheme)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = _image_prompt(qwen2_vl_dir, Image.fromarray(rand_image(56, 84, seed=0)))
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(first) == 6
    assert llm.get_metrics()["vlserve:encoder_runs_total"] == 1
    again = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == [list(first)] * 2
    assert llm.get_metrics()["vlserve:encoder_runs_total"] == 1  # the same image: its cached embeddings
    llm.check_integrity()


def test_tower_lora_on_int8_towers_is_refused(qwen2_vl_dir, tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from vlserve.lora import LoRARequest

    torch.manual_seed(1)
    base = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32).eval()
    cfg = LoraConfig(r=4, target_modules=r".*visual\.blocks\.\d+\.mlp\.fc1", init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(tmp_path / "tower"))
    llm = LLM(
        qwen2_vl_dir,
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        enable_lora=True,
        max_lora_rank=4,
        mm_encoder_quantization="int8",
    )
    with pytest.raises(ValueError, match="tower LoRA needs float towers"):
        llm.generate(
            {"prompt": "hi"},
            SamplingParams(max_tokens=1),
            use_tqdm=False,
            lora_request=LoRARequest("tower", 1, str(tmp_path / "tower")),
        )
