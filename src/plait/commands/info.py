"""``plait info``: parameters, FLOPs per token and memory of a model and layout, computed
without building anything (``model/sizes.py``; model state from ``sim/memory.py``).

    plait info --model llama-65b
    plait info --model qwen2.5-72b --tp 8 --pp 4 --dtype bf16
    plait info --model llama2-7b --micro-batch-size 1 --dtype bf16 --lora-rank 16 \\
        --recompute full --dp 8 --zero 3
    plait info --model llama2-7b --seq-len 32768 --cp 4 --dtype bf16 --recompute selective

With ``--cp N`` each rank holds s / N tokens of every sequence: activations are those of
s / N tokens (the cp attention keeps Q, K, V, its output and a log-sum-exp, never the
s x s scores), the model state is sharded by ZeRO over dp x cp ranks, and one more line
gives what one layer's exchange holds while it runs (``sim/context.py``).

A mixture of experts (``--moe-experts``) shows total and active parameters; with
``--ep N`` a rank holds E / N of every MoE block's experts, their state sharded by ZeRO
over the dp / N ranks holding the same experts, and its activations hold the routed rows
of a balanced router (``sim/expert.py``).

Errors a user can cause print one line and return 2.
"""

from __future__ import annotations

import argparse

from plait.cli_args import layout_config, lora_config, model_config, model_layout_parser
from plait.commands.common import UserError, die, merged_values


def add_parser(sub) -> argparse.ArgumentParser:
    return model_layout_parser(sub, "info", help="sizes, FLOPs and memory of a model")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from plait.model.sizes import (
        activation_bytes_per_layer,
        active_params,
        model_flops_per_token,
        num_params,
    )
    from plait.sim.costs import residual_bytes, residual_note
    from plait.sim.memory import average_model_state

    try:
        values = merged_values(args, parser)
        model = model_config(values)
        layout = layout_config(values)
        layout.check_model(model)
        lora = lora_config(values)
        if lora is not None:
            lora.check_model(model)
    except (UserError, ValueError) as e:
        return die("info", str(e).strip().splitlines()[0])
    n = num_params(model)
    print(f"model {values.get('model') or 'tiny'} ({model.arch})")
    for k, v in model.to_dict().items():
        if model.moe or not k.startswith("moe_"):  # a dense model's listing stays as it was
            print(f"  {k:<15} {v}")
    print(f"parameters           {n:,} ({n / 1e9:.3f} B)")
    if model.moe:
        a = active_params(model)
        print(f"active per token     {a:,} ({a / 1e9:.3f} B, {a / n:.1%}): top-"
              f"{model.moe_top_k} of {model.moe_experts} experts in {model.n_moe_layers} of "
              f"{model.n_layers} blocks; FLOPs count these")  # fmt: skip
    flops = model_flops_per_token(model)
    if lora is not None:
        from plait.model.lora import model_flops_per_token as lora_flops
        from plait.model.lora import num_adapter_params

        flops = lora_flops(model, lora)
        t = num_adapter_params(model, lora)
        print(f"trainable            {t:,} ({t / n:.2%}): LoRA r={lora.rank} on "
              f"{','.join(lora.targets)}, base frozen")  # fmt: skip
    print(f"FLOPs per token      {flops:.4g} (training, model FLOPs)")
    st = average_model_state(model, layout, lora)
    gib = 2**30
    print(
        f"model state per rank {st['device'] / gib:.3f} GiB on the device: weights "
        f"{st['params'] / gib:.3f}, gradients {st['grads'] / gib:.3f}, optimizer "
        f"{st['optim'] / gib:.3f} (fp32 weights+grads, AdamW; tp={layout.tp} pp={layout.pp} "
        f"dp={layout.dp}{f' cp={layout.cp}' if layout.cp > 1 else ''}"
        f"{f' ep={layout.ep}' if model.moe else ''} zero={layout.zero}"
        + (", LoRA" if lora else "")
        + ")"
        + (f"; host {st['host'] / gib:.3f}" if st["host"] else "")
    )
    cp, held = layout.cp, model.seq_len // layout.cp

    def per_layer(recompute):
        return activation_bytes_per_layer(
            model, micro_batch_size=layout.micro_batch_size, seq_len=held, tp=layout.tp,
            sequence_parallel=layout.sequence_parallel, recompute=recompute,
            act_bytes=4 if layout.dtype == "fp32" else 2, flash_attention=cp > 1,
            residual_bytes=residual_bytes(layout),
        )  # fmt: skip

    # --recompute-layers: that share of the blocks recomputes, the rest keep theirs
    share = layout.recomputed_share(model.n_layers)
    act = (share * per_layer(layout.recompute) + (1 - share) * per_layer("none")
           ) * model.n_layers / layout.pp  # fmt: skip
    if model.moe:  # the routed MLP's bytes in place of the dense one's (sim/expert.py)
        from plait.sim.expert import activation_bytes

        e = 4 if layout.dtype == "fp32" else 2
        T = layout.micro_batch_size * held
        dense_mlp = T * (2 if model.arch == "gpt2" else 3) * model.ffn_hidden / layout.tp * e
        if layout.recompute != "full" or share < 1:  # the blocks that keep theirs
            act += (1 - share if layout.recompute == "full" else 1) * (
                (activation_bytes(model, layout, 1.0) - dense_mlp) * model.n_moe_layers / layout.pp
            )
    tokens = f"{held} of {model.seq_len} tokens per sequence at cp={cp}" if cp > 1 else (
        f"{model.seq_len} tokens")  # fmt: skip
    print(
        f"activations per rank {act / gib:.3f} GiB per micro-batch in flight "
        f"({layout.micro_batch_size} x {tokens}, {layout.dtype}{residual_note(layout)}, "
        f"recompute={layout.recompute}"
        + (
            f" on the first {layout.recompute_layers} blocks of each chunk"
            if layout.recompute_layers is not None
            else ""
        )
        + "; blocks only, Korthikanti et al. 2022)"
    )
    if model.moe:
        from plait.sim.expert import expert_params

        x = model.n_moe_layers * expert_params(model, layout) / layout.pp
        print(f"experts per rank     {x:,.0f} routed expert parameters ({x / n:.1%} of the model) "
              f"at ep={layout.ep}: {model.moe_experts // layout.ep} of {model.moe_experts} "
              f"experts per MoE block; state sharded over {layout.dp // layout.ep} edp "
              f"rank(s) under ZeRO")  # fmt: skip
    if cp > 1:
        from plait.sim.context import buffer_bytes, math_attention
        from plait.sim.runtime import get_runtime

        math = math_attention(layout, get_runtime("plait"))  # document-masked blocks
        buf = buffer_bytes(model, layout, flash_attention=not math)
        held = "K/V in flight and fp32 block scores" if math else "K/V in flight"
        print(f"cp exchange          {buf / gib:.3f} GiB held by one layer's {layout.cp_mode} "
              f"attention while it runs ({held})")  # fmt: skip
    return 0
