"""One compute-dtype copy of each weight per step (``tensor.weight_casts``), in one process."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.model.config import preset
from plait.model.transformer import build_model
from plait.parallel.tensor import weight_casts

M = 4  # micro-batches in flight, as in a pipeline's warm-up
FUSED = {"qkv": (3 * 64, 64), "gate_up": (2 * 192, 64)}  # the test model's fused weights


def _run(model, batches, *, shared: bool):
    """Forwards of every micro-batch first (each in its own autocast context, as the
    runners enter it), then their backwards; returns the bf16 tensors saved for the
    backward that have a block weight's (or a fused group's) shape, by storage, and the
    gradients. ``shared``: one ``weight_casts`` over the step, as the runners do; else one
    per micro-batch's forward (each makes its own copies: the same GEMMs, not shared)."""
    shapes = {tuple(p.shape) for n, p in model.named_parameters()
              if n.startswith("blocks.") and n.endswith("weight")}  # fmt: skip
    shapes |= set(FUSED.values())  # q / k / v and gate / up concatenated
    shapes = {tuple(sorted(s)) for s in shapes}  # a GEMM may save the transpose
    saved = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and tuple(sorted(t.shape)) in shapes:
            saved[t.untyped_storage().data_ptr()] = tuple(sorted(t.shape))
        return t

    model.zero_grad(set_to_none=True)
    step = weight_casts() if shared else contextlib.nullcontext()
    roots = []
    with step, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for x, y in batches:
            own = contextlib.nullcontext() if shared else weight_casts()
            with own, torch.autocast("cpu", dtype=torch.bfloat16):
                roots.append(model(x, y).sum())
        for root in roots:
            root.backward()
    return saved, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_micro_batches_in_flight_share_one_cast_of_each_weight():
    """Under bf16 autocast, M micro-batches whose forwards all run before their backwards
    save one bf16 copy of each weight the blocks multiply by -- q / k / v and gate / up
    concatenated (``column_linears``), o and down alone -- not M (autocast's cache lives
    for one micro-batch's context); and the gradients are those of the same GEMMs on
    copies made per micro-batch, bit for bit. Catches the per-micro-batch copies that made
    GPT-3 175B's first pipeline stage (tp 8 pp 16) hold 16 bf16 copies of its weights, a
    fused group that is not cached for the step, and a shared copy that loses a
    micro-batch's gradient or adds one twice."""
    cfg = preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, seq_len=16,
                 vocab_size=128)  # fmt: skip
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g))
        for _ in range(M)
    ]
    apart, apart_grads = _run(model, batches, shared=False)
    shared, shared_grads = _run(model, batches, shared=True)
    copies = [tuple(sorted(s)) for s in (*FUSED.values(), (64, 64), (64, 192))]  # a block's
    assert sorted(shared.values()) == sorted(2 * copies), shared
    assert sorted(apart.values()) == sorted(M * 2 * copies), apart
    for name, grad in apart_grads.items():
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


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def _block_gemms(block, x, *, casts: bool) -> tuple[int, torch.Tensor]:
    """GEMMs of one block's bf16 forward, and its output."""
    count = _CountGemms()
    ctx = weight_casts() if casts else contextlib.nullcontext()
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16), count:
        y = block(x)
    return count.n, y


def _lora_model(cfg, targets=("q", "v")):
    """A llama model with rank-4 adapters on ``targets`` whose update is nonzero (B starts
    at zero)."""
    from plait.model.lora import apply_lora
    from plait.model.lora_config import LoRAConfig

    model = build_model(cfg, seed=0)
    apply_lora(model, LoRAConfig(rank=4, targets=targets), arch="llama", seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora.B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model


def test_q_k_v_and_gate_up_run_as_one_gemm_each_inside_a_steps_casts():
    """Inside a step's ``weight_casts`` under autocast, a llama block runs 4 forward GEMMs
    (q / k / v, o, gate / up, down) where 7 ran, with the separate layers' output within
    bf16 rounding; outside it, or with weights already in bf16 that do not lie side by
    side (each its own tensor: ZeRO-3's units lay theirs out adjacent), the layers run
    apart (7), since concatenating would hold a copy the step does not otherwise keep.
    With LoRA on q and v the group stays fused, each adapter adding its 2 GEMMs (8), and
    the block's output and gradients are those of the layers run apart within bf16
    rounding. Catches a fusion that never engages (the GPU step's host time: 168 GEMM calls
    where the plain loop made 99), one that engages where it costs memory, a split that
    hands the layers each other's rows, and an adapter whose update or gradient lands in
    another layer's rows."""

    cfg = preset("tiny", arch="llama", n_layers=1, hidden=64, n_heads=4, n_kv_heads=2,
                 seq_len=16, vocab_size=128)  # fmt: skip
    model = build_model(cfg, seed=0)
    block = model.blocks["0"]
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    fused, y = _block_gemms(block, x, casts=True)
    apart, y_ref = _block_gemms(block, x, casts=False)
    assert (fused, apart) == (4, 7)
    # the same products, rounded to bf16 (2^-8 relative) in another order: a few roundings
    # of the block's scale apart; another layer's rows would be O(1) off
    err = (y.float() - y_ref.float()).abs().max().item()
    assert err <= 4 * 2**-8 * y_ref.float().abs().max().item(), err
    block.to(torch.bfloat16)  # weights held in the compute dtype: no fusion
    assert _block_gemms(block, x, casts=True)[0] == 7
    block = _lora_model(cfg).blocks["0"]
    outs, grads = [], []
    for casts in (True, False):
        block.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        n, y = _block_gemms(block, xg, casts=casts)
        y.float().pow(2).sum().backward()
        outs.append((n, y.float()))
        grads.append([xg.grad.float()] + [p.grad for p in block.parameters() if p.grad is not None])
    (fused, y), (apart, y_ref) = outs
    assert (fused, apart) == (4 + 2 * 2, 7 + 2 * 2)  # + 2 GEMMs for each adapter
    assert torch.equal(y, y_ref)  # the forward rounds alike: same products, same adds
    assert len(grads[0]) == len(grads[1]) == 1 + 4  # x, and q's and v's A and B
    for g, ref in zip(*grads):  # summed in another order: bf16 roundings of their scale
        assert (g - ref).abs().max() <= 8 * 2**-8 * ref.abs().max(), (g - ref).abs().max()


def _saved_bytes(model, ids, *, casts: bool) -> int:
    """Bytes of the distinct storages one bf16 forward saves for its backward, less the
    parameters' own (held anyway)."""
    saved, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ctx = weight_casts() if casts else contextlib.nullcontext()
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids, ids).sum().backward()
    return sum(saved.values())


def test_a_fused_group_saves_what_the_layers_apart_save():
    """A llama model's forward with q / k / v and gate / up fused saves, for the backward,
    exactly the bytes of the same forward with the layers apart (the fused weight is the
    concatenation of the separate casts). Catches a fused product kept whole by one of its
    views: rotary turns q and k into new tensors, and v, a view of the product, held q's
    and k's dead rows for the backward -- 2 GiB more activations rehearsed for llama2-7b at
    4,096 tokens (30.7 -> 32.7 GiB) until v took its own storage -- and a LoRA'd group that
    saves what its frozen layers would not (the weight where its input needs no gradient)."""
    from plait.model.lora import apply_lora
    from plait.model.lora_config import LoRAConfig

    cfg = preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                 seq_len=32, vocab_size=128)  # fmt: skip
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    for targets in (None, ("q", "v"), ("up",), ("q", "k", "v", "o", "gate", "up", "down")):
        model = build_model(cfg, seed=0)
        if targets:  # adapters fused with their groups (a frozen base keeps no input)
            apply_lora(model, LoRAConfig(rank=4, targets=targets), arch="llama", seed=0)
        fused, apart = _saved_bytes(model, ids, casts=True), _saved_bytes(model, ids, casts=False)
        # apart, autocast saves bf16 copies of the adapters' factors; fused, the factors
        casts = sum(2 * p.numel() for n, p in model.named_parameters() if ".lora." in n)
        assert apart - casts <= fused <= apart, (targets, fused, apart, casts)


def test_a_compiled_block_keeps_its_lora_layers_in_the_fused_groups(monkeypatch):
    """``--compile`` with LoRA on q and v (llama, bf16, inside a step's casts): the block's
    graph holds 4 base products (q / k / v, o, gate / up, down) and each adapter's 2, 8
    ``linear`` calls where q, k and v apart made 10 (two graphs: the first block's input
    needs no gradient under a frozen embedding), and the model's loss and gradients are
    the eager step's (which adds the updates in ``_AdaptedColumns``) within bf16 rounding.
    Catches compiled LoRA blocks sent back to running q, k and v apart (three GEMMs where
    one would do on a GPU), and an update added to another layer's rows. (Dynamo's graph,
    run eagerly: inductor's code generation is not what is checked.)"""
    import functools

    from plait.model.transformer import compile_blocks

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes
                          if n.op == "call_function" and "linear" in str(n.target)))  # fmt: skip
        return gm.forward

    cfg = preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                 seq_len=16, vocab_size=128)  # fmt: skip
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (True, False):
        model = _lora_model(cfg)
        if compiled:
            torch._dynamo.reset()
            monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
            compile_blocks(model)
        with weight_casts(), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, ids).float().mean()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.float().item(), grads))
    torch._dynamo.reset()
    assert len(graphs) == 2 and set(graphs) == {4 + 2 * 2}, graphs
    (loss, grads), (loss_ref, grads_ref) = results
    assert sorted(grads) == sorted(grads_ref) and len(grads) == 2 * 4  # A and B of q and v
    assert abs(loss - loss_ref) <= 4 * 2**-8 * abs(loss_ref), (loss, loss_ref)
    for name, g in grads.items():  # summed in another order: bf16 roundings of their scale
        ref = grads_ref[name]
        assert (g - ref).abs().max() <= 8 * 2**-8 * ref.abs().max(), name


def test_each_micro_batchs_weight_gradients_are_final_as_its_layer_ends():
    """A step's compute-dtype copy of a weight is used by every micro-batch; each use is
    its own autograd node (``tensor._StepCopy``), so in every micro-batch's backward a
    layer's weight gradients are accumulated as its backward ends -- before the blocks
    below it and the embedding -- and a data-parallel reduction can start on them. Catches
    one cast node shared by the step: made in the first forward, the autograd engine (the
    ready node made last runs first) ran it after everything else of each later
    micro-batch's backward, holding every layer's bf16 weight gradient to the end (2.8 GiB
    of LLaMA-2 7B pp 4's stage 0 under full recomputation)."""
    torch.manual_seed(0)
    model = build_model(preset("tiny"))
    names = {id(p): n for n, p in model.named_parameters()}
    events = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(names[id(p)]))
    x = torch.randint(0, 256, (1, 32))
    with weight_casts():
        for mb in range(2):
            events.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, x).float().mean()
            loss.backward()
            last = max(int(n.split(".")[1]) for n in names.values() if n.startswith("blocks."))
            top = [events.index(n) for n in events if n.startswith(f"blocks.{last}.")
                   and n.endswith("weight") and "norm" not in n]  # fmt: skip
            bottom = [events.index(n) for n in events if n.startswith("blocks.0.")]
            assert top and max(top) < min(bottom), (mb, events)
