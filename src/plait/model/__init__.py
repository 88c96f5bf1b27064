"""The transformer (``plait.model.transformer``), its configs and presets, and size formulas.

Importing this package loads no torch: the simulator and planner use the config and the
formulas (``plait.model.sizes``) alone.
"""

from plait.model.config import PRESETS, ModelConfig, preset

__all__ = ["PRESETS", "ModelConfig", "preset"]
