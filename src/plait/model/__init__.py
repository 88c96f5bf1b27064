from plait.model.config import PRESETS, ModelConfig, preset
from plait.model.transformer import Transformer, build_model

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "preset"]
