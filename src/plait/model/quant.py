"""Weight-only integer quantisation of the transformer blocks' linear layers: training
with it (quantisation-aware training, ``--qat``) and exporting with it (``plait export
--quantize``), both on PyTorch's own library, torchao.

Schemes (symmetric, zero point 0; the scheme of torchao's ``IntxWeightOnlyConfig``):

- ``int8``: one scale per output channel (``PerAxis(0)``), integers in [-128, 127];
- ``int4``: one scale per group of ``group_size`` consecutive input features of an output
  channel (``PerGroup(g)``), integers in [-8, 7].

scale = max(|w| over the channel or group) / ((qmax - qmin) / 2), q = clamp(round(w /
scale), qmin, qmax), and the layer multiplies by q * scale. Which layers: q, k, v, o and
the MLP's GEMMs of every block; the embedding and the output head stay in full precision.

What torchao does: the quantisation arithmetic (``_fake_quantize_affine``, with
straight-through rounding), the quantised weight tensor (``IntxUnpackedToInt8Tensor``)
and its matmul, and ``quantize_`` over a model. What plait adds: scales that stay those
of the whole weight when tensor parallelism splits it (below), the choice of layers, a
portable file (safetensors, int4 packed two to a byte) and its reload, and the validation
perplexity before and after, reported with every export.

Communication (QAT only; axis tp, t = tp size): a row-parallel layer's weight is split
along its input features, so an ``int8`` channel spans every tp rank's shard: its
absolute maximum is all-reduced (MAX) over tp before the scales are formed, one call of
4 out bytes per row-parallel layer (o and the MLP's second GEMM), issued by the training
thread in the model's layer order, identically on every tp rank: once a step, in the
first forward that uses the layer (the step's quantised copy, ``tensor.step_cast``, whose
backward takes the quantiser's gradient at the kept scales, ``FakeQuant.grad``); under
ZeRO-3, whose weights are gathered per use, in every forward
(``tensor.quantised_linear``), and again in the backward under ``--recompute full``. Column-parallel layers split output
channels, and ``int4`` groups never straddle a shard (``group_size`` must divide each
rank's input features): their scales are local. Nothing with t == 1. Scales are
computed without gradient; the rounding passes gradients straight through (STE) and
clamping stops them, as torchao's fake quantisation does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from plait.model.config import ModelConfig
from plait.model.quant_config import QuantConfig

LAYERS = re.compile(r"blocks\.\d+\.(attn\.(q|k|v|o)|mlp\.(fc|proj|gate|up|down))")
WEIGHTS = "quantized.safetensors"
META = "quantization.json"


def torchao_config(cfg: QuantConfig):
    """The torchao post-training config equivalent to ``cfg``."""
    with _quiet_import():
        from torchao.quantization import IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup

    if cfg.dtype == "int8":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(cfg.group_size))


@contextlib.contextmanager
def _quiet_import():
    """Import torchao without its start-up warnings on machines without its GPU kernels
    (it tries to load CUDA libraries, and registers enums with torch's pytree)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# --- quantisation-aware training ----------------------------------------------------------


class FakeQuant:
    """A parallel linear layer's ``weight_quant`` (``tensor._weight``): this rank's weight
    shard fake-quantised with the scales of the whole weight (module docstring)."""

    def __init__(self, cfg: QuantConfig, layer: nn.Module):
        from plait.parallel.tensor import RowParallelLinear

        self.cfg, self.topo = cfg, layer.topo
        # an int8 channel of a row-parallel weight spans the tp shards
        self.reduce_max = isinstance(layer, RowParallelLinear) and cfg.dtype == "int8"

    def scales(self, w: torch.Tensor) -> torch.Tensor:
        """(out, groups) scales of ``w`` (out, in_local), without gradient."""
        from plait import comm
        from plait.topology import Axis

        with torch.no_grad():
            g = w.shape[1] if self.cfg.dtype == "int8" else self.cfg.group_size
            absmax = w.detach().float().reshape(w.shape[0], -1, g).abs().amax(dim=-1)
            if self.reduce_max and self.topo.tp > 1:
                absmax = absmax.contiguous()
                comm.all_reduce(absmax, topo=self.topo, axis=Axis.TP, op=dist.ReduceOp.MAX)
            half_range = (self.cfg.qmax - self.cfg.qmin) / 2
            return (absmax / half_range).clamp(min=torch.finfo(torch.float32).eps)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return self.quantize(w, self.scales(w))

    def quantize(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``w`` fake-quantised at ``scale`` (``scales``), torchao's arithmetic; no
        collective (``tensor.quantised_linear`` makes it again in each backward). Where no
        graph is wanted (a step's copy, ``tensor._StepQuant``; ``quantised_linear``) the
        same operations run in place on one fp32 copy of the weight, where torchao's
        expression held three: (clamp(round(w x (1 / s)) + 0) - 0) x s, the zero
        point's adds kept, as they turn a -0 into a +0."""
        rows, cols = w.shape
        group = cols // scale.shape[1]
        if torch.is_grad_enabled() and w.requires_grad:
            with _quiet_import():
                from torchao.quantization.quant_primitives import _fake_quantize_affine

            return _fake_quantize_affine(
                w, (1, group), scale.to(w.dtype), torch.zeros_like(scale, dtype=torch.int8),
                torch.int8, self.cfg.qmin, self.cfg.qmax,
            )  # fmt: skip
        s = scale.to(w.dtype).view(rows, -1, 1)
        zero = torch.zeros_like(s)
        q = w.detach().view(rows, -1, group) * (1.0 / s)
        q.round_().add_(zero).clamp_(self.cfg.qmin, self.cfg.qmax)
        return q.sub_(zero).mul_(s).view(rows, cols)

    def grad(self, w: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of ``quantize(w, scale)`` at ``grad``: straight through the
        rounding, stopped where the clamp cut, with the bits autograd gets from torchao's
        graph -- ((grad x s) where round(w / s) is in range, else 0) x (1 / s) -- but
        without making that graph again: two fp32 copies of the weight at once (the
        rounded quotient, then the product) and a mask, where the graph held every step
        of the quantiser and its dequantisation (about six). It runs in each backward, at
        the weight's largest GEMM."""
        rows, cols = w.shape
        group = cols // scale.shape[1]
        s = scale.to(w.dtype).view(rows, -1, 1)
        inv = 1.0 / s  # as the forward's ``input * (1.0 / scale)``
        with torch.no_grad():
            q = (w.detach().view(rows, -1, group) * inv).round_()
            keep = (q >= self.cfg.qmin).logical_and_(q <= self.cfg.qmax)
            del q
            out = grad.view(rows, -1, group) * s  # (a bf16 gradient promoted, exactly)
            return out.masked_fill_(keep.logical_not_(), 0).mul_(inv).view(rows, cols)


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The block linear layers the schemes quantise, by name."""
    return {n: m for n, m in model.named_modules() if LAYERS.fullmatch(n)}


def apply_qat(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Fake-quantise the weights of ``model``'s block linear layers in every forward."""
    layers = quantized_layers(model)
    for layer in layers.values():
        layer.weight_quant = FakeQuant(cfg, layer)
    return list(layers)


# --- export: real quantisation, the file, the reload ----------------------------------------


def quantize_model(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Replace the block linear weights of a whole (tp = 1) model by torchao's quantised
    tensors (``torchao.quantization.quantize_``); they then compute with them."""
    with _quiet_import():
        from torchao.quantization import quantize_

    names = set(quantized_layers(model))
    quantize_(model, torchao_config(cfg), filter_fn=lambda m, fqn: fqn in names)
    return sorted(names)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two int4 values per byte (even columns in the low nibble): (out, in) -> (out, in/2)."""
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    q = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(q > 7, q - 16, q).to(torch.int8)


def save_quantized(folder: str | Path, model: nn.Module, model_cfg: ModelConfig,
                   cfg: QuantConfig, report: dict) -> Path:  # fmt: skip
    """Write a quantised model (``quantize_model``) as ``config.json`` (the Hugging Face
    config, for the sizes), ``quantized.safetensors`` (plait's parameter names; each
    quantised weight as ``NAME.qdata`` -- int4 packed as ``NAME.qdata_int4x2`` -- plus
    ``NAME.scale`` and ``NAME.zero_point``) and ``quantization.json`` (scheme, layers and
    ``report``)."""
    from safetensors.torch import save_file

    from plait.model import hf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, layers = {}, {}
    for name, p in model.named_parameters():
        if hasattr(p, "tensor_data_names"):  # a torchao quantised weight
            for key in p.tensor_data_names:
                t = getattr(p, key).detach().cpu().contiguous()
                if key == "qdata" and cfg.dtype == "int4":
                    tensors[f"{name}.qdata_int4x2"] = _pack_int4(t)
                else:
                    tensors[f"{name}.{key}"] = t
            layers[name] = {k: _jsonable(getattr(p, k)) for k in p.tensor_attribute_names}
        else:
            tensors[name] = p.detach().cpu().contiguous()
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    (folder / "config.json").write_text(json.dumps(hf.hf_config(model_cfg), indent=2) + "\n")
    meta = {"scheme": cfg.dtype, "group_size": cfg.group_size if cfg.dtype == "int4" else None,
            "torchao_tensor": "IntxUnpackedToInt8Tensor", **report,
            "layers": layers}  # fmt: skip
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def _jsonable(v):
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, tuple | list):
        return list(v)
    return v


def load_quantized(folder: str | Path) -> tuple[ModelConfig, nn.Module]:
    """(config, whole plait model) from ``save_quantized``'s folder; the quantised layers
    hold torchao ``IntxUnpackedToInt8Tensor`` weights again."""
    from safetensors.torch import load_file

    with _quiet_import():
        from torchao.quantization import IntxUnpackedToInt8Tensor

    from plait.model import hf
    from plait.model.transformer import build_model

    folder = Path(folder)
    if not (folder / META).is_file():
        raise ValueError(f"{folder}: no {META} there (a folder written by plait export --quantize)")
    meta = json.loads((folder / META).read_text())
    cfg = hf.read_config(folder)
    tensors = load_file(str(folder / WEIGHTS))
    model = build_model(cfg, device="meta")
    quantized = meta["layers"]
    for name, module in model.named_modules():
        for key, _ in list(module.named_parameters(recurse=False)):
            full = f"{name}.{key}" if name else key
            if full in quantized:
                q = tensors.get(f"{full}.qdata")
                if q is None:
                    q = _unpack_int4(tensors[f"{full}.qdata_int4x2"])
                attrs = dict(quantized[full])
                attrs["target_dtype"] = getattr(torch, attrs["target_dtype"])
                attrs["dtype"] = getattr(torch, attrs["dtype"])
                attrs["block_size"] = tuple(attrs["block_size"])
                w = IntxUnpackedToInt8Tensor(q, tensors[f"{full}.scale"],
                                             tensors[f"{full}.zero_point"], **attrs)  # fmt: skip
            else:
                w = tensors[full]
            setattr(module, key, nn.Parameter(w, requires_grad=False))
    return cfg, model.eval()
