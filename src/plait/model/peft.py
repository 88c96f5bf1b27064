"""LoRA adapters in PEFT's on-disk format: ``adapter_config.json`` +
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, folder)``
loads onto the Hugging Face model that ``hf.save`` wrote for the base weights.

    peft.save_adapter(folder, state, model_cfg, lora_cfg, base="../base")

PEFT stores ``base_model.model.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight``
(out, r) and computes ``lora_B(lora_A(x)) * lora_alpha / r``, plait's ``scale * B A x``
(``model/lora.py``). LLaMA's projections (and Qwen's, Mistral's) map one to one (``q`` ->
``self_attn.q_proj``).
GPT-2 fuses q, k and v into one ``Conv1D`` ``c_attn`` (C -> 3C): the adapters of the q/k/v
targets present become one adapter of rank n r (n of them) with A the n A's stacked and B
block-diagonal, so ``c_attn``'s update is exactly [B_q A_q x, B_k A_k x, B_v A_v x] (zero
rows for an untargeted one); ``rank_pattern`` / ``alpha_pattern`` keep its scale alpha /
r. ``fan_in_fan_out`` is set because GPT-2's ``Conv1D`` stores weights (in, out).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from plait.model.config import ModelConfig
from plait.model.lora import LoRAConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

_LLAMA = {  # plait target -> module under model.layers.i
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}  # fmt: skip
_GPT2 = {"o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}  # and q/k/v: attn.c_attn


def adapter_tensors(
    state: dict[str, torch.Tensor], model_cfg: ModelConfig, cfg: LoRAConfig
) -> tuple[dict[str, torch.Tensor], dict]:
    """PEFT's tensors and config fields for plait's full state dict (adapters included)."""
    out, fields = {}, {}
    targets = set(cfg.targets)
    for i in range(model_cfg.n_layers):
        mod = cfg.modules(model_cfg.arch)

        def ab(target, i=i, mod=mod):
            layer = next(k for k, t in mod.items() if t == target)
            return (state[f"blocks.{i}.{layer}.lora.A"].detach().float(),
                    state[f"blocks.{i}.{layer}.lora.B"].detach().float())  # fmt: skip

        if model_cfg.rotary:
            for t in cfg.targets:
                a, b = ab(t)
                _put(out, f"model.layers.{i}.{_LLAMA[t]}", a, b)
            continue
        for t in (t for t in cfg.targets if t in _GPT2):
            a, b = ab(t)
            _put(out, f"transformer.h.{i}.{_GPT2[t]}", a, b)
        qkv = [t for t in "qkv" if t in targets]
        if qkv:
            h, r = model_cfg.hidden, cfg.rank
            a_cat = torch.cat([ab(t)[0] for t in qkv])  # (n r, C)
            b_bd = torch.zeros(3 * h, len(qkv) * r)  # (3C, n r), block-diagonal
            for j, t in enumerate(qkv):
                row = "qkv".index(t) * h
                b_bd[row : row + h, j * r : (j + 1) * r] = ab(t)[1]
            _put(out, f"transformer.h.{i}.attn.c_attn", a_cat, b_bd)
            if len(qkv) > 1:
                fields["rank_pattern"] = {"c_attn": len(qkv) * r}
                fields["alpha_pattern"] = {"c_attn": len(qkv) * cfg.alpha}
    if model_cfg.rotary:
        names = "|".join(sorted(_LLAMA[t].replace(".", r"\.") for t in cfg.targets))
        fields["target_modules"] = rf"model\.layers\.\d+\.({names})"
    else:
        mods = {_GPT2[t] for t in cfg.targets if t in _GPT2}
        mods |= {"attn.c_attn"} if targets & set("qkv") else set()
        names = "|".join(sorted(m.replace(".", r"\.") for m in mods))
        fields["target_modules"] = rf"transformer\.h\.\d+\.({names})"
        fields["fan_in_fan_out"] = True
    return out, fields


def _put(out: dict, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    out[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
    out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()


def adapter_config(cfg: LoRAConfig, fields: dict, base: str) -> dict:
    """``adapter_config.json``: a LoRA of ``cfg`` for a causal language model."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **fields,
    }


def save_adapter(
    folder: str | Path,
    state: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    cfg: LoRAConfig,
    *,
    base: str,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder``;
    ``base`` is the base model's folder as PEFT should name it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, fields = adapter_tensors(state, model_cfg, cfg)
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    conf = json.dumps(adapter_config(cfg, fields, base), indent=2) + "\n"
    (folder / CONFIG).write_text(conf)
    return folder
