"""Sampling text from a trained run: ``plait generate --run DIR --prompt "def "``."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from plait.data import prepare
from plait.model.transformer import build_model
from plait.topology import Topology
from plait.train import checkpoint
from plait.train.config import RunConfig


def locate(run: Path, *, trust=None):
    """(config, newest checkpoint that verifies) of a run folder, or ValueError (one line):
    signed by this user, or under ``trust`` (``--trust-checkpoint``)."""
    run = Path(run)
    if not (run / "config.yaml").exists():
        raise ValueError(f"--run {run}: no config.yaml there; pass a folder made by plait train")
    cfg = RunConfig.load(run / "config.yaml")
    try:  # the newest checkpoint that verifies
        path, note = checkpoint.pick_resume(run / "checkpoints", flag=f"--run {run}", trust=trust)
    except checkpoint.CheckpointError as e:
        raise ValueError(str(e)) from None
    if "skipped" in note:
        logging.getLogger("plait").warning("plait: %s", note.replace("resuming", "loading", 1))
    return cfg, path


def build_as_trained(cfg: RunConfig, *, device=None):
    """The whole model as the run trained it: LoRA adapters beside the frozen base, block
    weights fake-quantised (QAT); ``device="meta"``: names and shapes only."""
    model = build_model(cfg.model, seed=cfg.train.seed, device=device or "cpu")
    if cfg.lora:  # the checkpoint holds the adapters beside the frozen base
        from plait.model.lora import apply_lora

        apply_lora(model, cfg.lora, arch=cfg.model.arch, seed=cfg.train.seed)
    if cfg.qat:  # the model as trained: its block weights fake-quantised
        from plait.model.quant import apply_qat

        apply_qat(model, cfg.qat)
    return model


def check_host_memory(cfg: RunConfig, what: str) -> None:
    """ValueError (one line) when the whole model's fp32 weights exceed this host's
    MemAvailable: sampling and quantised export run it in one process, which a model
    trained across many devices may not fit."""
    from plait.model.sizes import num_params
    from plait.sim.hardware import host_mem_available

    need = 4 * num_params(cfg.model)
    available = host_mem_available()
    if available is not None and need > available:
        raise ValueError(
            f"{what}: the whole model is {need / 2**30:.1f} GiB in fp32 and this host has "
            f"{available / 2**30:.1f} GiB available; plait export without --quantize writes "
            "it a layer at a time, for a machine that holds it"
        )


def load_model(run: Path, *, trust=None):
    """(config, checkpoint path, model with its weights) of a run folder's newest checkpoint
    that verifies (``locate``). The whole model in fp32 in this process: ValueError (one
    line) where that is more than this host's MemAvailable, before anything is allocated."""
    cfg, path = locate(run, trust=trust)
    check_host_memory(cfg, f"--run {run}")
    model = build_as_trained(cfg)
    checkpoint.load(path, state=checkpoint.model_state(model), topo=Topology.single(),
                    verified=True)  # fmt: skip
    model.eval()
    return cfg, path, model


def load_run(run: Path, *, trust=None):
    """(config, tokenizer, model with the newest checkpoint's weights) of a run folder."""
    cfg, _, model = load_model(run, trust=trust)
    return cfg, prepare(cfg.data).tokenizer, model


@torch.no_grad()
def sample(
    model,
    ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> list[int]:
    """Autoregressive sampling (no KV cache: the models plait samples from are small)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([ids or [0]], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(x[:, -model.cfg.seq_len :])[0, -1].float()  # (V,)
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return x[0, len(ids or [0]) :].tolist()


def generate_text(run: Path, prompt: str, *, max_new_tokens=120, temperature=0.8, seed=0,
                  trust=None) -> str:  # fmt: skip
    _, tok, model = load_run(run, trust=trust)
    new = sample(
        model, tok.encode(prompt), max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
    )
    return prompt + tok.decode(new)
