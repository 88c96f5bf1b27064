"""Context-parallel attention (plait/parallel/context.py): the head-tail split, its balance,
the ring's program under NCCL's semantics, and every exchange against one process."""

import math

import pytest
import torch
from distributed import run_workers
from numerics import U32, attention_chain

from plait.nccl_p2p import P2PDeadlock, Post, resolve
from plait.parallel.context import (
    ContextLayout,
    attention_work,
    check_heads,
    chunk_ids,
    context_attention,
    document_ids,
    gather_documents,
    ring_p2p,
    ring_program,
    shard,
    unshard,
)
from plait.topology import Axis, Topology


def test_shard_worked_example_and_round_trip():
    """The docstring's example (rank 0 holds 0 1 6 7) and unshard(shard) == x for tokens,
    positions and labels alike, along any dim: a chunk put back in the wrong place fails."""
    assert shard(torch.arange(8), cp=2, index=0, dim=0).tolist() == [0, 1, 6, 7]
    assert shard(torch.arange(8), cp=2, index=1, dim=0).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 3, 4, 8):
        x = torch.randn(2, 16 * cp, 3)
        for dim in (1, -2):
            shards = [shard(x, cp=cp, index=i, dim=dim) for i in range(cp)]
            assert all(s.shape[1] == 16 for s in shards)
            assert torch.equal(unshard(shards, dim=dim), x)
    with pytest.raises(ValueError, match="does not split into 2 x 4 chunks"):
        shard(torch.arange(12), cp=4, index=0, dim=0)


def test_head_tail_balances_causal_work_and_contiguous_does_not():
    """Per-rank causal (query, key) pairs, counted with the same ``visible`` the exchanges
    use: equal on every rank under head-tail; under the contiguous split the last rank
    does about 2N - 1 times the first rank's work (catches a split that loses balance)."""
    c = 5
    for cp in (1, 2, 4, 8):
        s = 2 * cp * c
        head_tail = [attention_work(cp, r, c=c) for r in range(cp)]
        contiguous = [attention_work(cp, r, c=c, split="contiguous") for r in range(cp)]
        assert sum(head_tail) == sum(contiguous) == s * (s + 1) // 2  # every pair once
        assert head_tail == [(2 * cp - 1) * c * c + c * (c + 1)] * cp
        if cp > 1:
            first, last = contiguous[0], contiguous[-1]
            assert first == c * c + c * (c + 1)  # chunks 0 and 1
            assert last == (4 * cp - 3) * c * c + c * (c + 1)  # chunks 2N-2, 2N-1
            assert last > 2 * first  # ~ (2N - 1) times for large chunks
    assert chunk_ids(4, 1) == (1, 6) and chunk_ids(4, 1, split="contiguous") == (2, 3)


def test_ring_programs_pass_the_nccl_check_and_a_misordered_one_fails():
    """The forward and backward ring programs of 2..8 ranks complete under nccl_p2p's model
    of NCCL (the one schedules.validate uses). The same program with each batch split into
    a send then a receive deadlocks: every rank's send waits for a receive queued behind
    the neighbour's send."""
    for cp in range(2, 9):
        for backward in (False, True):
            resolve(ring_p2p(cp, backward=backward))
            kv = sum(s.op == "post" and s.what == "kv" for s in ring_program(cp, backward=backward))
            assert kv == cp - 1
        dkv = [s for s in ring_program(cp, backward=True) if s.what == "dkv" and s.op == "post"]
        assert len(dkv) == cp  # the accumulator comes back to its owner
    split = [_split_posts(rank) for rank in ring_p2p(3)]
    with pytest.raises(P2PDeadlock, match="wait forever"):
        resolve(split)


def _split_posts(items):
    """Each batch posted as one batch per message, in its order (send, then receive), with
    the waits renumbered to the batch of the receive."""
    out, moved = [], {}
    for i, item in enumerate(items):
        if isinstance(item, Post):
            for m in item.messages:
                out.append(Post((m,)))
            moved[i] = len(out) - 1
        else:
            out.append(item._replace(waits_for=moved.get(item.waits_for)))
    return out


def test_one_line_errors():
    """Heads that a2a cannot split, a sequence that does not cut into 2 cp chunks, an
    unknown mode: each a ValueError naming the flag."""
    with pytest.raises(ValueError, match="--cp-mode a2a splits heads over --cp 4.*6 attention"):
        check_heads("a2a", cp=4, n_heads=6, n_kv_heads=2)
    with pytest.raises(ValueError, match="the 8 attention heads and the 2 key/value heads"):
        check_heads("a2a", cp=4, n_heads=8, n_kv_heads=2)
    check_heads("ring", cp=4, n_heads=6, n_kv_heads=2)  # ring and allgather split tokens
    with pytest.raises(ValueError, match="--cp-mode 'zigzag' is unknown"):
        check_heads("zigzag", cp=2, n_heads=4, n_kv_heads=4)
    with pytest.raises(ValueError, match="--seq-len 30 must be a multiple of 2 x --cp = 8"):
        ContextLayout(cp=4, seq_len=30)


def test_document_ids():
    """An end-of-text token closes its own document (the next token starts a new one)."""
    tokens = torch.tensor([[5, 9, 0, 7, 0, 3]])
    assert document_ids(tokens, eot=0).tolist() == [[0, 0, 0, 1, 1, 2]]


# ---------------------------------------------------------------- against one process

B, H, K, D, S = 2, 8, 4, 8, 32  # H / K = 2: grouped-query attention


def _inputs(documents: bool):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (H, K, K))
    w_out = torch.randn(B, H, S, D, generator=g)  # the loss: (out w_out + lse w_lse).sum()
    w_lse = torch.randn(B, H, S, generator=g)
    docs = None
    if documents:  # documents that cross chunk boundaries, a different cut per sequence
        ends = torch.zeros(B, S, dtype=torch.long)
        ends[0, [4, 13, 14, 27]] = 1
        ends[1, [9, 21]] = 1
        docs = ends.cumsum(-1) - ends
    return q, k, v, w_out, w_lse, docs


def _reference(q, k, v, w_out, w_lse, docs):
    """Plain attention in float64 on the whole sequence, torch's autograd for the
    gradients; and the magnitudes each error is bounded against (numerics.attention_chain).
    """
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    g, scale = H // K, 1 / math.sqrt(D)
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    pos = torch.arange(S)
    mask = (pos[None, :] <= pos[:, None])[None, None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    s = (q @ kr.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = p @ vr
    (out * w_out.double()).sum().add((lse * w_lse.double()).sum()).backward()
    with torch.no_grad():  # magnitudes
        a = (q.abs() @ kr.abs().transpose(-1, -2) * scale).max().item()
        dout, dlse = w_out.double().abs(), w_lse.double().abs()
        gm = dout @ vr.abs().transpose(-1, -2)  # |dO| |V|^T
        sm = p * (gm + (p * gm).sum(-1, keepdim=True) + dlse[..., None])
        mag = {
            "out": p @ vr.abs(),
            "lse": 1 + lse.abs(),
            "dq": sm @ kr.abs() * scale,
            "dk": (sm.transpose(-1, -2) @ q.abs() * scale).view(B, K, g, S, D).sum(2),
            "dv": (p.transpose(-1, -2) @ dout).view(B, K, g, S, D).sum(2),
        }
    ref = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: t.detach() for n, t in ref.items()}, mag, a


def _run_cases(rank, world):
    """Every rank: build cp rings of 4 ([0..3]) and 2 ([0,1], [2,3]); for each ring, mode
    and masking run the layer on this rank's shard and return the shards and the counts."""
    import torch.distributed as dist

    groups = {4: [list(range(4))], 2: [[0, 1], [2, 3]]}
    results = []
    made = {cp: [(r, dist.new_group(r)) for r in rings] for cp, rings in groups.items()}
    for cp, rings in made.items():
        ranks, pg = next((r, pg) for r, pg in rings if rank in r)
        index = ranks.index(rank)
        for documents in (False, True):
            q, k, v, w_out, w_lse, docs = _inputs(documents)
            layout = ContextLayout(cp=cp, seq_len=S, documents=docs)
            if documents:  # the whole sequence's ids rebuilt from the shards, on their own topo
                ring = Topology(dp=cp, rank=rank, groups={Axis.DP: pg}, place=(0, index, 0),
                                group_ranks={Axis.DP: ranks, Axis.PP: [rank], Axis.TP: [rank]},
                                world=world)  # fmt: skip
                local = shard(docs, cp=cp, index=index, dim=1)
                assert torch.equal(gather_documents(local, topo=ring, axis=Axis.DP), docs)
            for mode in ("ring", "allgather", "a2a"):
                topo = Topology(dp=cp, rank=rank, groups={Axis.DP: pg}, place=(0, index, 0),
                                group_ranks={Axis.DP: ranks, Axis.PP: [rank], Axis.TP: [rank]},
                                world=world)  # fmt: skip
                ql, kl, vl = (
                    shard(x, cp=cp, index=index, dim=2).requires_grad_() for x in (q, k, v)
                )
                out, lse = context_attention(ql, kl, vl, layout=layout, topo=topo, axis=Axis.DP,
                                             mode=mode)  # fmt: skip
                loss = (out * shard(w_out, cp=cp, index=index, dim=2)).sum()
                loss = loss + (lse * shard(w_lse, cp=cp, index=index, dim=2)).sum()
                loss.backward()
                got = {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
                results.append(((cp, tuple(ranks), documents, mode), index,
                                {n: t.detach() for n, t in got.items()}, dict(topo.stats.calls)))  # fmt: skip
    return results


def _expected_calls(cp, mode):
    """Collectives per layer forward + backward (module docstring's Communication)."""
    if mode == "ring":
        n = (cp - 1) + (cp - 1) + cp  # forward K/V, backward K/V and dK/dV batches
        return {("dp", "send"): n, ("dp", "recv"): n}
    if mode == "allgather":
        return {("dp", "all_gather"): 2, ("dp", "reduce_scatter"): 1}
    return {("dp", "all_to_all"): 6}  # q/k/v, out, lse; dout, dlse, dq/dk/dv


def test_every_mode_matches_one_process_in_float64():
    """cp 2 (two rings side by side) and cp 4, ring / allgather / a2a, causal and
    document-masked: output, LSE and dQ/dK/dV of the float32 layer, unsharded, within
    ``attention_chain * U32`` of the float64 single-process result times each quantity's
    magnitude (tests/numerics.py derives the chain); and the collectives each mode issues,
    counted; and gather_documents rebuilds the document ids from their shards. A mask that lets a token see a later chunk or another document, a block
    merged with the wrong weight, a gradient returned to the wrong rank or chunk: each
    moves some element by far more than the bound (~1e-5 of its magnitude)."""
    per_rank = run_workers(4, _run_cases)
    cases: dict = {}
    for rank_results in per_rank:
        for key, index, got, calls in rank_results:
            cases.setdefault(key, {})[index] = (got, calls)
    assert len(cases) == 2 * 3 + 2 * 2 * 3  # cp 4: one ring; cp 2: two rings
    refs = {docs: _reference(*_inputs(docs)) for docs in (False, True)}
    worst = 0.0
    for (cp, ranks, documents, mode), shards in cases.items():
        ref, mag, a = refs[documents]
        tol = attention_chain(head_dim=D, keys=S, score_sum=a, group=H // K, cp=cp) * U32
        assert tol < 1e-4
        for name in ref:
            got = unshard([shards[i][0][name] for i in range(cp)], dim=2).double()
            err = (got - ref[name]).abs()
            ratio = (err / (tol * mag[name])).max().item()
            worst = max(worst, ratio)
            assert ratio <= 1, (cp, ranks, documents, mode, name, err.max().item())
        for i in range(cp):
            assert shards[i][1] == _expected_calls(cp, mode), (cp, mode, shards[i][1])
    assert worst > 0  # the float32 layers did round: the comparison is not vacuous


def test_one_process_is_the_reference():
    """cp 1 (no exchange) against the float64 reference, document-masked: the local path
    through the same autograd Function."""
    q, k, v, w_out, w_lse, docs = _inputs(True)
    ref, mag, a = _reference(q, k, v, w_out, w_lse, docs)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    topo = Topology.single()
    out, lse = context_attention(q, k, v, layout=ContextLayout(cp=1, seq_len=S, documents=docs),
                                 topo=topo, axis=Axis.DP)  # fmt: skip
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    tol = attention_chain(head_dim=D, keys=S, score_sum=a, group=H // K, cp=1) * U32
    got = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, t in got.items():
        assert ((t.double() - ref[name]).abs() <= tol * mag[name]).all(), name
    assert sum(topo.stats.calls.values()) == 0


# ---------------------------------------------------------------- wired into the model


def test_context_shard_gives_each_rank_its_chunks_and_whole_documents():
    """The trainer's cut (``loop.context_shard``): each cp rank's inputs and targets are its
    head-tail chunks of the same windows (targets still the next token of each input), and
    both ranks carry the document ids of the whole sequences. Catches targets shifted after
    sharding (a chunk's last target would be the other chunk's first token) and document
    ids computed on a shard (they would restart at 0 on every rank)."""
    from plait.train.loop import context_shard

    rows = torch.tensor([[5, 1, 0, 2, 3, 0, 4, 6, 7], [0, 8, 9, 0, 1, 2, 3, 4, 5]])  # (B, T+1)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    for r in range(2):
        ((i, t, d),) = context_shard([rows], cp=2, cp_rank=r, eot=0)
        assert torch.equal(i, shard(inputs, cp=2, index=r))
        assert torch.equal(t, shard(targets, cp=2, index=r))
        assert torch.equal(d, document_ids(inputs, 0))
    assert document_ids(inputs, 0)[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert context_shard([rows], cp=1, cp_rank=0, eot=None) == [rows]  # untouched


def test_document_mask_keeps_each_document_to_itself():
    """LLaMA (rotary positions: attention sees only relative ones), float64: the logits of
    two documents packed into one sequence with ``documents`` equal each document's logits
    alone; without it the second document's differ. Catches a mask not applied, applied
    across the wrong axis, one that lets a token see the next document or its own future,
    or an end-of-text token counted into the next document."""
    from plait.model.config import preset
    from plait.model.transformer import build_model

    cfg = preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, vocab_size=256,
                 seq_len=32)  # fmt: skip
    model = build_model(cfg, seed=0).double().eval()
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 256, (1, 12), generator=g)
    a[0, -1] = 0  # end of text closes document a
    b = torch.randint(1, 256, (1, 20), generator=g)
    packed = torch.cat([a, b], dim=1)
    with torch.no_grad():
        masked = model(packed, documents=document_ids(packed, 0))
        plain = model(packed)
        alone_a, alone_b = model(a), model(b)
    # the rotary tables are fp32 (apply_rotary): equal to their rounding, not float64's
    torch.testing.assert_close(masked[:, :12], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked[:, 12:], alone_b, atol=1e-5, rtol=1e-5)
    assert (plain[:, 12:] - alone_b).abs().max() > 1e-2


def test_fused_cpu_blocks_equal_the_math_blocks():
    """A block on PyTorch's fused CPU kernel (no documents) against the math path (the same
    block with every token in one document: the same mask, computed from scores), float64,
    GQA: out, LSE and dq/dk/dv of a causal block whose keys run past its queries' start
    (split into the visible part and the causal square) and of a fully visible one. Catches
    a wrong split (the square not the last Tq keys), a backward fed the block's own LSE
    instead of the merged one, and GQA gradients not summed over the shared heads."""
    from plait.parallel.context import attend, attend_backward

    g = torch.Generator().manual_seed(0)
    B, H, K, D, Tq = 2, 4, 2, 8, 6
    for causal, Tk in ((True, 3 * Tq), (True, Tq), (False, 2 * Tq)):
        q = torch.randn(B, H, Tq, D, dtype=torch.float64, generator=g)
        k, v = (torch.randn(B, K, Tk, D, dtype=torch.float64, generator=g) for _ in range(2))
        dout = torch.randn(B, H, Tq, D, dtype=torch.float64, generator=g)
        k_pos = torch.arange(Tk)
        q_pos = k_pos[Tk - Tq :] if causal else torch.arange(Tk, Tk + Tq)
        one = dict(
            q_doc=torch.zeros(B, Tq, dtype=torch.long), k_doc=torch.zeros(B, Tk, dtype=torch.long)
        )
        kw = dict(q_pos=q_pos, k_pos=k_pos, causal=causal, scale=D**-0.5)
        out, lse = attend(q, k, v, **kw)
        ref_out, ref_lse = attend(q, k, v, **kw, **one)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
        delta = (dout * out).sum(-1)
        got = attend_backward(q, k, v, dout, delta, lse, out=out, **kw)
        want = attend_backward(q, k, v, dout, delta, lse, **kw, **one)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _stand_in_kernels(seen: list):
    """CPU stand-ins for CUDA's two fused kernels, honouring the contracts ``context.py``
    relies on (their schemas, and their outputs as the CUDA sources allocate them): flash
    takes fp16/bf16 only, returns out in the input type and lse fp32 (B, H, Tq); efficient
    returns lse padded to a multiple of 32 rows (garbage past Tq: NaN here) and its backward
    reads the padded lse back; both backwards take None (undefined) for the variable-length
    offsets, the bias and the dropout state of a dense call. Both are math attention in
    fp32 (or wider)."""

    def scores(q, k, causal, scale):
        dt = torch.promote_types(q.dtype, torch.float32)
        s = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale
        if causal:  # square blocks only: top-left and bottom-right agree
            assert s.shape[-1] == s.shape[-2]
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        return s, dt

    def math(q, k, v, causal, scale):
        s, dt = scores(q, k, causal, scale)
        lse = torch.logsumexp(s, -1)
        return torch.exp(s - lse[..., None]), lse, dt

    def grads(dout, q, k, v, out, lse, causal, scale):
        s, dt = scores(q, k, causal, scale)
        p = torch.exp(s - lse.to(dt)[..., None])  # P from the *given* lse, as the kernels do
        d, o = dout.to(dt), out.to(dt)
        dv = p.transpose(-1, -2) @ d
        ds = p * (d @ v.to(dt).transpose(-1, -2) - (d * o).sum(-1, keepdim=True))
        return (ds @ k.to(dt)) * scale, (ds.transpose(-1, -2) @ q.to(dt)) * scale, dv

    def flash(q, k, v, dropout, causal, debug, *, scale):
        assert q.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0
        seen.append("flash")
        p, lse, dt = math(q, k, v, causal, scale)
        return ((p @ v.to(dt)).to(q.dtype), lse.float(), *[None] * 7)

    def flash_backward(dout, q, k, v, out, lse, cq, ck, mq, mk, dropout, causal, s0, s1, *, scale):
        # a defined cum_seq (even empty) selects the variable-length kernel
        assert (cq, ck, s0, s1) == (None,) * 4 and dropout == 0.0
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
        assert (mq, mk) == (q.shape[-2], k.shape[-2]) and out.dtype == q.dtype
        return tuple(x.to(q.dtype) for x in grads(dout, q, k, v, out, lse, causal, scale))

    def efficient(q, k, v, bias, with_lse, dropout, causal, *, scale):
        assert bias is None and with_lse and dropout == 0.0
        seen.append("efficient")
        p, lse, dt = math(q, k, v, causal, scale)
        rows = -(-q.shape[-2] // 32) * 32
        padded = torch.full((*lse.shape[:-1], rows), float("nan"), dtype=lse.dtype)
        padded[..., : q.shape[-2]] = lse
        return (p @ v.to(dt)).to(q.dtype), padded, None, None

    def efficient_backward(dout, q, k, v, bias, out, lse, s0, s1, dropout, mask, causal, *, scale):
        # a defined bias (even empty) is read as a (B, H, Tq, Tk) attention bias
        assert (bias, s0, s1) == (None,) * 3 and dropout == 0.0
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[-2]
        assert list(mask) == [True, True, True, False]
        g = grads(dout, q, k, v, out, lse[..., : q.shape[-2]], causal, scale)
        return (*(x.to(q.dtype) for x in g), None)

    return {
        "_scaled_dot_product_flash_attention": flash,
        "_scaled_dot_product_flash_attention_backward": flash_backward,
        "_scaled_dot_product_efficient_attention": efficient,
        "_scaled_dot_product_efficient_attention_backward": efficient_backward,
    }


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_kernel_glue_equals_the_math_blocks(monkeypatch, kernel):
    """The glue around CUDA's fused kernels (not run here: no GPU), driven through CPU
    stand-ins that keep the kernels' contracts (``_stand_in_kernels``): out, LSE and
    dq/dk/dv of causal and visible blocks, GQA, against the math path. Catches an
    efficient-kernel LSE used unsliced (its NaN padding reaches the merge), a backward
    handed an unpadded LSE, a flash call in fp32, a causal flag on a non-square part,
    bf16 partial outputs merged in bf16 instead of fp32, and a backward handed defined
    (empty) tensors where the kernels take undefined ones (varlen offsets, bias)."""
    from plait.parallel import context
    from plait.parallel.context import attend, attend_backward

    seen: list = []
    ops = _stand_in_kernels(seen)
    monkeypatch.setattr(context, "_op", lambda name: ops[name])
    monkeypatch.setattr(
        context, "_kernel", lambda q, k, q_doc: None if q_doc is not None else kernel
    )
    # flash takes bf16: its partial outputs and gradients are rounded once each (u = 2^-8);
    # efficient runs float64 here, where only the summation order differs
    dt, tol = (torch.bfloat16, 4 * 2**-8) if kernel == "flash" else (torch.float64, 1e-10)
    g = torch.Generator().manual_seed(1)
    B, H, K, D, Tq = 2, 4, 2, 8, 6
    for causal, Tk in ((True, 3 * Tq), (True, Tq), (False, 2 * Tq)):
        q = torch.randn(B, H, Tq, D, generator=g).to(dt)
        k, v = (torch.randn(B, K, Tk, D, generator=g).to(dt) for _ in range(2))
        dout = torch.randn(B, H, Tq, D, generator=g).to(dt)
        k_pos = torch.arange(Tk)
        q_pos = k_pos[Tk - Tq :] if causal else torch.arange(Tk, Tk + Tq)
        one = dict(
            q_doc=torch.zeros(B, Tq, dtype=torch.long), k_doc=torch.zeros(B, Tk, dtype=torch.long)
        )
        kw = dict(q_pos=q_pos, k_pos=k_pos, causal=causal, scale=D**-0.5)
        seen.clear()
        out, lse = attend(q, k, v, **kw)
        assert seen == [kernel] * (2 if causal and Tk > Tq else 1)
        ref_out, ref_lse = attend(q, k, v, **kw, **one)
        assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(
            lse, ref_lse, rtol=1e-5 if dt != torch.float64 else tol, atol=tol
        )
        o = out.to(dt)
        delta = (dout.to(out.dtype) * o.to(out.dtype)).sum(-1)
        got = attend_backward(q, k, v, dout, delta, ref_lse, out=o, **kw)
        want = attend_backward(q, k, v, dout, delta, ref_lse, **kw, **one)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
