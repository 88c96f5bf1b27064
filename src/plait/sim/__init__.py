"""The performance model: hardware specs, per-action costs, schedule replay, memory.

    from plait.sim import simulate, get_hardware
    result = simulate(model_cfg, layout, get_hardware("h100-sxm"))
    result.iter_time_s, result.mfu, result.peak_mem_bytes, result.breakdown

See ``simulate.py`` for the step it simulates and docs/performance-model.md for the
equations, parameters and measured accuracy. Nothing here imports torch.distributed.
"""

from plait.sim.hardware import BUILTIN, Hardware, get_hardware, load_hardware
from plait.sim.runtime import PROFILES, Runtime, get_runtime
from plait.sim.simulate import Result, simulate

__all__ = [
    "BUILTIN",
    "PROFILES",
    "Hardware",
    "Result",
    "Runtime",
    "get_hardware",
    "get_runtime",
    "load_hardware",
    "simulate",
]
