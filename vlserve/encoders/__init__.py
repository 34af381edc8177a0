"""Vision and audio encoders: our own towers on vlserve.kernels, loaded by HF weight names (and
TimmVisionTower, which timm builds and runs; timm is imported only when one is built).

Imports only torch, vlserve.kernels and plain config objects (never transformers modules). A tower maps the
concatenated pixel rows of every item of a step plus their grids to one `[num_embeddings, O]` tensor.
"""

from vlserve.encoders.qwen2_5_vl_vision import Qwen2_5VisionTower, qwen2_5_vl_tower_config
from vlserve.encoders.qwen2_audio_encoder import AudioEncoderConfig, Qwen2AudioEncoder, qwen2_audio_encoder_config
from vlserve.encoders.qwen2_vl_vision import Qwen2VisionTower, qwen2_vl_tower_config
from vlserve.encoders.timm_tower import TimmVisionTower, timm_tower_args
from vlserve.encoders.vision_layers import VisionTowerConfig

__all__ = [
    "AudioEncoderConfig",
    "Qwen2AudioEncoder",
    "qwen2_audio_encoder_config",
    "Qwen2VisionTower",
    "Qwen2_5VisionTower",
    "TimmVisionTower",
    "VisionTowerConfig",
    "qwen2_5_vl_tower_config",
    "qwen2_vl_tower_config",
    "timm_tower_args",
]
