"""Hugging Face weights in and out: plait's two flavours are the Hugging Face GPT-2
(``GPT2LMHeadModel``) and LLaMA (``LlamaForCausalLM``) architectures, so a model moves
between them by renaming tensors (and, for GPT-2, transposing its ``Conv1D`` weights and
splitting the fused q/k/v projection).

    full = hf.to_hf(state, cfg)           # plait names -> Hugging Face names
    state = hf.from_hf(full, cfg)         # and back (exactly)
    hf.save(folder, state, cfg)           # config.json + model.safetensors (from_pretrained)
    cfg, state = hf.load(folder)          # a folder written by save_pretrained, or by save

Tensors are whole (unsharded, the unpadded vocabulary), as ``train.checkpoint`` stores
them; ``load_into`` cuts them for a tensor-parallel or pipeline rank. What does not map is
refused in one line: another architecture, biases in LLaMA projections, a rotary scaling,
GPT-2 options plait's block does not have.

Name map (block i; gpt2 on the left of each pair is Hugging Face's):
    transformer.wte / wpe                  embed.tokens / embed.positions
    transformer.h.i.ln_1 / ln_2            blocks.i.ln1 / ln2
    transformer.h.i.attn.c_attn  (C, 3C)   blocks.i.attn.q | k | v  (transposed, split)
    transformer.h.i.attn.c_proj            blocks.i.attn.o          (transposed)
    transformer.h.i.mlp.c_fc / c_proj      blocks.i.mlp.fc / proj   (transposed)
    transformer.ln_f                       norm                     (lm_head tied to wte)
    model.embed_tokens, model.norm, lm_head            embed.tokens, norm, head
    model.layers.i.input_layernorm / post_attention_layernorm    blocks.i.ln1 / ln2
    model.layers.i.self_attn.{q,k,v,o}_proj            blocks.i.attn.{q,k,v,o}
    model.layers.i.mlp.{gate,up,down}_proj             blocks.i.mlp.{gate,up,down}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from plait.model.config import ModelConfig

WEIGHTS = "model.safetensors"


class HFError(ValueError):
    """A Hugging Face folder or config plait cannot map (one line, names the file)."""


# -- configs --------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig) -> dict:
    """The ``config.json`` of the equivalent Hugging Face model."""
    if cfg.arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_hidden,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": cfg.init_std, "tie_word_embeddings": True,
            "scale_attn_weights": True, "torch_dtype": "float32",
            "bos_token_id": None, "eos_token_id": None,  # plait's tokenizers have their own
        }  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout,
        "initializer_range": cfg.init_std, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }  # fmt: skip


def model_config(d: dict, *, source: str = "config.json") -> ModelConfig:
    """plait's ``ModelConfig`` for a Hugging Face ``config.json`` (GPT-2 or LLaMA)."""
    kind = d.get("model_type")
    try:
        if kind == "gpt2":
            act = d.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise HFError(f"{source}: activation_function {act!r}; plait's GPT-2 uses "
                              "tanh GELU (gelu_new)")  # fmt: skip
            for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
                if d.get(key):
                    raise HFError(f"{source}: {key} is not supported by plait's GPT-2 block")
            return ModelConfig(
                arch="gpt2", n_layers=d["n_layer"], hidden=d["n_embd"], n_heads=d["n_head"],
                ffn_hidden=d.get("n_inner") or 4 * d["n_embd"], vocab_size=d["vocab_size"],
                seq_len=d["n_positions"], norm_eps=d.get("layer_norm_epsilon", 1e-5),
                dropout=d.get("resid_pdrop", 0.0), init_std=d.get("initializer_range", 0.02),
            )  # fmt: skip
        if kind == "llama":
            for key in ("attention_bias", "mlp_bias"):
                if d.get(key):
                    raise HFError(f"{source}: {key} is not supported (plait's LLaMA projections "
                                  "have no biases)")  # fmt: skip
            # rotary base: top-level (transformers 4) or in rope_parameters (5); scaled
            # variants (linear, dynamic, llama3, yarn, ...) are not plait's rotary
            rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise HFError(f"{source}: rope_scaling / rope_type {kind!r} is not supported; "
                              "plait uses plain rotary positions")  # fmt: skip
            if d.get("pretraining_tp", 1) != 1:
                raise HFError(f"{source}: pretraining_tp {d['pretraining_tp']} is not supported")
            if d.get("tie_word_embeddings"):
                raise HFError(f"{source}: tied embeddings are not supported for llama")
            if d.get("hidden_act", "silu") != "silu":
                raise HFError(f"{source}: hidden_act {d['hidden_act']!r}; plait's LLaMA uses silu")
            heads, hidden = d["num_attention_heads"], d["hidden_size"]
            if d.get("head_dim") not in (None, hidden // heads):
                raise HFError(f"{source}: head_dim {d['head_dim']} is not hidden_size / heads")
            return ModelConfig(
                arch="llama", n_layers=d["num_hidden_layers"], hidden=hidden, n_heads=heads,
                n_kv_heads=d.get("num_key_value_heads") or heads,
                ffn_hidden=d["intermediate_size"], vocab_size=d["vocab_size"],
                seq_len=d["max_position_embeddings"], norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
                dropout=d.get("attention_dropout", 0.0), init_std=d.get("initializer_range", 0.02),
            )  # fmt: skip
    except KeyError as e:
        raise HFError(f"{source}: no {e.args[0]!r}") from None
    raise HFError(f"{source}: model_type {kind!r}; plait maps gpt2 and llama")


# -- tensors -------------------------------------------------------------------------------

_LLAMA = {  # plait suffix in block i -> Hugging Face suffix in layer i
    "ln1.weight": "input_layernorm.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_GPT2 = {  # transposed Conv1D weights, plain biases and norms
    "ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias",
    "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
    "attn.o.weight": "attn.c_proj.weight", "attn.o.bias": "attn.c_proj.bias",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias",
}  # fmt: skip


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for plait's full state dict (every name of the whole model)."""
    _check_names(state, cfg)
    out = {}
    if cfg.arch == "llama":
        out["model.embed_tokens.weight"] = state["embed.tokens.weight"]
        out["model.norm.weight"] = state["norm.weight"]
        out["lm_head.weight"] = state["head.weight"]
        for i in range(cfg.n_layers):
            for ours, theirs in _LLAMA.items():
                out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
        return {k: v.contiguous() for k, v in out.items()}
    out["transformer.wte.weight"] = state["embed.tokens.weight"]
    out["transformer.wpe.weight"] = state["embed.positions.weight"]
    out["transformer.ln_f.weight"] = state["norm.weight"]
    out["transformer.ln_f.bias"] = state["norm.bias"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in _GPT2.items():
            t = state[b + ours]
            out[h + theirs] = t.t() if t.dim() == 2 else t
        qkv = [state[f"{b}attn.{x}.weight"] for x in "qkv"]
        out[h + "attn.c_attn.weight"] = torch.cat(qkv, dim=0).t()
        out[h + "attn.c_attn.bias"] = torch.cat([state[f"{b}attn.{x}.bias"] for x in "qkv"])
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """plait's full state dict for Hugging Face tensors (``lm_head`` of a tied GPT-2 and
    rotary/attention buffers are ignored)."""
    try:
        if cfg.arch == "llama":
            out = {
                "embed.tokens.weight": hf["model.embed_tokens.weight"],
                "norm.weight": hf["model.norm.weight"],
                "head.weight": hf["lm_head.weight"],
            }
            for i in range(cfg.n_layers):
                for ours, theirs in _LLAMA.items():
                    out[f"blocks.{i}.{ours}"] = hf[f"model.layers.{i}.{theirs}"]
        else:
            out = {
                "embed.tokens.weight": hf["transformer.wte.weight"],
                "embed.positions.weight": hf["transformer.wpe.weight"],
                "norm.weight": hf["transformer.ln_f.weight"],
                "norm.bias": hf["transformer.ln_f.bias"],
            }
            for i in range(cfg.n_layers):
                b, h = f"blocks.{i}.", f"transformer.h.{i}."
                for ours, theirs in _GPT2.items():
                    t = hf[h + theirs]
                    out[b + ours] = t.t() if t.dim() == 2 else t
                q, k, v = hf[h + "attn.c_attn.weight"].t().chunk(3, dim=0)
                qb, kb, vb = hf[h + "attn.c_attn.bias"].chunk(3)
                out.update({b + "attn.q.weight": q, b + "attn.k.weight": k,
                            b + "attn.v.weight": v, b + "attn.q.bias": qb,
                            b + "attn.k.bias": kb, b + "attn.v.bias": vb})  # fmt: skip
    except KeyError as e:
        raise HFError(f"the Hugging Face weights lack {e.args[0]!r}") from None
    out = {k: v.contiguous() for k, v in out.items()}
    _check_names(out, cfg)
    return out


def _check_names(state: dict, cfg: ModelConfig) -> None:
    """The names and shapes of plait's whole model for ``cfg`` (built on the meta device)."""
    from plait.model.transformer import build_model
    from plait.topology import Topology

    want = {n: tuple(p.shape) for n, p in build_model(cfg, topo=Topology.single(),
                                                       device="meta").named_parameters()}  # fmt: skip
    missing = sorted(set(want) - set(state))
    if missing:
        raise HFError(f"weights lack {missing[0]!r} of the {cfg.arch} model")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise HFError(f"{name}: shape {tuple(state[name].shape)}, the model needs {shape}")


# -- folders -------------------------------------------------------------------------------


def save(folder: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (what ``from_pretrained`` reads)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_hf({k: v.detach().cpu() for k, v in state.items()}, cfg)
    if cfg.tied_embeddings:  # stored once, tied again on load
        tensors.pop("lm_head.weight", None)
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return folder


def save_tokenizer(folder: str | Path, tokenizer, cfg: ModelConfig) -> bool:
    """Write a ``tokenizers`` tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``
    (``AutoTokenizer.from_pretrained`` and ``plait train --tokenizer FOLDER`` read it).
    False for plait's byte tokenizer, which has no such file (its ids are UTF-8 bytes)."""
    from plait.data.tokenizer import HFTokenizer

    if not isinstance(tokenizer, HFTokenizer):
        return False
    folder = Path(folder)
    tokenizer.save(folder / "tokenizer.json")
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len}
    if tokenizer.eot_id is not None:
        conf["eos_token"] = tokenizer.decode([tokenizer.eot_id])
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return True


def read_config(folder: str | Path) -> ModelConfig:
    """plait's ``ModelConfig`` of a Hugging Face model folder (its ``config.json``)."""
    folder = Path(folder)
    conf = folder / "config.json"
    if not conf.is_file():
        raise HFError(f"--init-hf {folder}: no config.json there (a Hugging Face model folder)")
    try:
        return model_config(json.loads(conf.read_text()), source=str(conf))
    except json.JSONDecodeError as e:
        raise HFError(f"{conf}: not valid JSON ({e})") from None


def load(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, plait's full state dict) from a Hugging Face model folder: ``config.json``
    and ``model.safetensors`` or its shards (``model-0000x-of-0000y.safetensors``)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFError(f"--init-hf {folder}: no .safetensors weights there")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return cfg, from_hf({k: v.float() for k, v in tensors.items()}, cfg)


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], topo) -> None:
    """Copy whole tensors into ``model``'s parameters, cut for this tensor-parallel rank
    (a pipeline rank takes the names it holds)."""
    from plait.parallel.tensor import full_shape, shard_spec, tp_shard

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in state:
                raise HFError(f"weights lack {name!r}")
            spec = shard_spec(p)
            full = state[name]
            if tuple(full.shape) != tuple(full_shape(p.shape, spec, topo.tp)):
                raise HFError(f"{name}: shape {tuple(full.shape)} does not fit this model")
            p.copy_(tp_shard(full.to(p.dtype), spec, tp_rank=topo.tp_rank, tp=topo.tp))
