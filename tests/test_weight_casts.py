"""One compute-dtype copy of each weight per step (``tensor.weight_casts``), in one process."""

import contextlib

import torch

from plait.model.config import preset
from plait.model.transformer import build_model
from plait.parallel.tensor import weight_casts

M = 4  # micro-batches in flight, as in a pipeline's warm-up


def _run(model, batches, *, cached: bool):
    """Forwards of every micro-batch first (each in its own autocast context, as the
    runners enter it), then their backwards; returns the bf16 tensors saved for the
    backward that have a linear weight's shape, by storage, and the gradients."""
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")}
    saved = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    model.zero_grad(set_to_none=True)
    ctx = weight_casts() if cached else contextlib.nullcontext()
    roots = []
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                roots.append(model(x, y).sum())
        for root in roots:
            root.backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_micro_batches_in_flight_share_one_cast_of_each_weight():
    """Under bf16 autocast, M micro-batches whose forwards all run before their backwards
    save one bf16 copy of each block weight, not M (autocast's cache lives for one
    micro-batch's context); and the gradients are the uncached run's, bit for bit. Catches
    the per-micro-batch copies that made GPT-3 175B's first pipeline stage (tp 8 pp 16)
    hold 16 bf16 copies of its weights, and a shared copy that loses a micro-batch's
    gradient or adds one twice."""
    cfg = preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, seq_len=16,
                 vocab_size=128)  # fmt: skip
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g))
        for _ in range(M)
    ]
    plain, plain_grads = _run(model, batches, cached=False)
    shared, shared_grads = _run(model, batches, cached=True)
    blocks = [
        m
        for n, m in model.named_modules()
        if n.startswith("blocks.") and hasattr(m, "weight_quant")
    ]
    assert len(blocks) == 2 * 7  # q k v o gate up down: the linears that run under autocast
    assert len(shared) == len(blocks), (len(shared), len(blocks))
    assert len(plain) == M * len(blocks), (len(plain), len(blocks))
    for name, grad in plain_grads.items():
        assert torch.equal(grad, shared_grads[name]), name


def test_compiled_blocks_share_one_graph_inside_the_steps_casts(monkeypatch):
    """``--compile`` under bf16: ``compile_blocks`` compiles every block's forward, and
    inside a step's ``weight_casts`` all blocks must share one graph. The step's cast dict
    grew by each layer's weights as the blocks ran; read from a compiled region, dynamo
    guarded on its length, so each block recompiled until the recompile limit (8) sent
    the rest of the model back to eager: plait compiled ran slower than plait eager on the
    H200 (0.40-0.46 of a plain compiled loop). Catches any per-block state read inside the
    compiled region. (Dynamo's ``eager`` backend: the guards are dynamo's, not the
    compiler's, and it takes seconds rather than minutes on a CPU.)"""
    import functools

    from plait.model.transformer import compile_blocks

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = preset("tiny", n_layers=4, hidden=32, n_heads=2, seq_len=16, vocab_size=64)
    model = build_model(cfg)
    compile_blocks(model)
    x = torch.randint(0, 64, (2, 16))
    torch._dynamo.utils.counters.clear()
    with weight_casts(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x).sum().backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1, f"{graphs} graphs for 4 blocks of one code path"
