"""The numerics gate of DESIGN.md section 3 -- every layout trains the single-process
curve -- with its tolerances derived, not tuned to one machine.

A layout computes the same function as the single process; in float32 only the order
of summation differs (the CPU's vector width, thread count, how collectives combine
partial sums). Higham's bound for a float32 sum of n terms, in any order, is
(n - 1) u times the sum of the terms' magnitudes, u = 2^-24. A loss is a chain of such
sums -- per layer: the q/k/v and output projections (h terms), attention scores (the head
size), the softmax's normaliser and the weighted values (the sequence), the MLP (h, then
the FFN width); then the head (h), the log-sum-exp over the vocabulary, and the mean over
the step's tokens -- so its relative error is at most u times the sum of those lengths
(``loss_tol``; ~1e-4 for the test models). A gradient norm adds the backward's chain
(the same lengths, plus the step's tokens that every weight gradient sums over) and the
sum of squares over the parameters (cascade-summed per tensor: log2 of its size, then one
term per tensor), ``grad_norm_tol``.

After step 1 the weights differ by what the optimizer made of those differences. AdamW
moves every weight by at most ~lr per step whatever its gradient, so an earlier step's
rounding cannot grow faster than the steps add their own: the curve over ``n`` steps is
held to ``n`` times the step-1 bound (``assert_same_run``).

Both columns are compared: a gradient mis-scaled by a constant is invisible in the loss
(AdamW divides it out, clipping rescales it) but not in ``grad_norm``.
"""

from __future__ import annotations

import math

from plait.model.config import ModelConfig

U32 = 2.0**-24


def forward_chain(cfg: ModelConfig, tokens: int) -> int:
    """Sum of the reduction lengths on the forward's longest chain (module docstring)."""
    s = cfg.seq_len
    per_layer = 2 * cfg.hidden + cfg.head_dim + 2 * s + cfg.hidden + cfg.ffn_hidden
    return cfg.n_layers * per_layer + cfg.hidden + cfg.vocab_size + tokens


def loss_tol(cfg: ModelConfig, tokens: int) -> float:
    """Relative bound on a step's loss difference between layouts (float32)."""
    return forward_chain(cfg, tokens) * U32


def grad_norm_tol(cfg: ModelConfig, tokens: int) -> float:
    """Relative bound on a step's gradient-norm difference between layouts (float32):
    forward and backward chains, every weight gradient's sum over the tokens, and the
    sum of squares (cascade-summed per tensor, then one term per tensor)."""
    biggest = max(cfg.vocab_size, cfg.ffn_hidden) * cfg.hidden
    tensors = 20 * cfg.n_layers + 4  # generous: plait's blocks hold 9 (llama) or 16 (gpt2)
    squares = math.log2(biggest) + tensors
    chain = 2 * forward_chain(cfg, tokens) + cfg.n_layers * tokens + squares
    return chain * U32


def assert_same_run(got: list[dict], ref: list[dict], cfg: ModelConfig, tokens: int, what=""):
    """``loss`` and ``grad_norm`` of every step of ``got`` (metrics.jsonl records) against
    the single-process ``ref``: step n within n times the step-1 bounds."""
    assert len(got) == len(ref), f"{what}: {len(got)} steps vs {len(ref)}"
    bounds = {"loss": loss_tol(cfg, tokens), "grad_norm": grad_norm_tol(cfg, tokens)}
    for i, (g, r) in enumerate(zip(got, ref), start=1):
        step = g.get("step", i)  # a resumed run continues the count
        for key, tol in bounds.items():
            a, b = g[key], r[key]
            assert abs(a - b) <= step * tol * abs(b), (
                f"{what}: step {step} {key} {a} vs {b} (relative {abs(a - b) / abs(b):.2e}, "
                f"bound {step * tol:.2e})"
            )


U16 = 2.0**-8  # bf16's unit roundoff (8 significant bits)


def assert_within_bf16_rounding(got: list[dict], ref: list[dict], what=""):
    """``loss`` and ``grad_norm`` of a bf16 run against the single-process bf16 ``ref``
    where the layout adds one bf16 rounding to some values the reference keeps in fp32
    (a pipeline's boundary activation; the norms and embeddings ZeRO-3 gathers in bf16),
    beside the bf16 roundings of every GEMM output both runs make. Step 1: that one
    rounding, within half an ulp (2^-9 relative). Later steps: each update carries one
    more relative rounding of u = 2^-8 into the weights; independent, they add up as a
    random walk, so step k is within u sqrt(k), and the loss -- a mean over every
    token -- within u (``test_pipeline``'s bf16 test derives and measures the same)."""
    assert len(got) == len(ref), f"{what}: {len(got)} steps vs {len(ref)}"
    for key in ("loss", "grad_norm"):
        errs = [abs(g[key] - r[key]) / abs(r[key]) for g, r in zip(got, ref)]
        assert errs[0] <= U16 / 2, (what, key, errs)
        assert all(e <= U16 * (k + 1) ** 0.5 for k, e in enumerate(errs)), (what, key, errs)
        if key == "loss":
            assert max(errs) <= U16, (what, errs)


def attention_chain(*, head_dim: int, keys: int, score_sum: float, group: int, cp: int) -> float:
    """Length of the float32 rounding chain of attention's output, log-sum-exp and dQ/dK/dV
    (context-parallel or not), each error bounded by ``attention_chain * U32`` times that
    quantity's magnitude (tests/test_context.py computes the magnitudes in float64).

    First order in u, Higham's bound for each sum (n - 1 terms' worth of u times the
    terms' magnitudes), D = ``head_dim``, T = ``keys`` (the longest row), A =
    ``score_sum`` (the largest scale * sum_d |q_d k_d|), g = ``group`` (query heads per
    key/value head), N = ``cp`` (blocks merged per row; partial dK/dV summed per key):

    - a score q.k: D terms and the scale, error (D + 1) u A;
    - the log-sum-exp: that, the T-term normaliser and its exps, the log, and one
      log-add-exp of a few roundings per merged block: (D + 1) A + T + 4N + 3, times u
      (1 + |lse|);
    - so each recomputed probability P = exp(s - lse) is within Lp u relative,
      Lp = 2 (D + 1) A + T + 4N + 4;
    - out = P V: Lp + T + 1 (magnitude P |V|); dV = P^T dO: Lp + T + N (P^T |dO|);
    - dP = dO V^T: D terms; Delta = rowsum(dO O) - dLSE: D + Lp + T + 1; so dS = P (dP -
      Delta) is within 2 Lp + 2 D + T + 2 of P (|dO| |V|^T + rowsum(...) + |dLSE|);
    - dQ = scale dS K and dK = scale dS^T Q: T more terms, and for dK g heads and N
      partial sums: 2 Lp + 2 D + 2 T + g + N + 3.

    The largest, used for all five: 4 (D + 1) A + 4 T + 2 D + g + 9 N + 12."""
    d, t = head_dim, keys
    return 4 * (d + 1) * score_sum + 4 * t + 2 * d + group + 9 * cp + 12
