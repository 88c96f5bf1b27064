"""Gradient codecs: what one rank puts on the wire for one gradient tensor, and how the
received messages become the summed gradient. Tensor arithmetic only -- no communication
(``compressed_grads.py`` moves the messages) -- so each codec is tested on its own.

Every codec works per tensor (a parameter's gradient, or under ZeRO 2/3 this rank's flat
shard of it), whatever bucket the tensor travels in: the result does not depend on the
bucket size or on the pipeline cut. The gradients being combined are the ranks' *shares*
(each loss is divided by the global token count), so the target is their sum.

- ``bf16``: the gradient cast to bfloat16 and all-reduced (summable): 2 bytes per element.
- ``qsgd:s`` (Alistarh et al. 2017): each block of ``QSGD_BLOCK`` = 512 elements v is sent
  as its norm |v| (fp32) and, per element, a signed level l_i in -s..s (one byte) drawn so
  that E[l_i] = s v_i / |v|: l_i = sign(v_i) (floor(s |v_i| / |v|) + Bernoulli(frac)).
  Decoding gives |v| l_i / s, an unbiased estimate of v whose variance is at most
  min(d / s^2, sqrt(d) / s) |v|^2 per block of d elements (their Lemma 3.1). Levels from
  different ranks have different scales, so messages are all-gathered and every rank
  decodes and sums them itself, in rank order (the same bits everywhere). Bytes per
  tensor of n elements: n + 4 ceil(n / 512).
- ``topk:ratio`` with EF21 error feedback (Richtarik et al. 2021): each rank keeps g_i, its
  running estimate of its own gradient, and every rank keeps g = sum_i g_i. A step sends
  c_i = top-k of (grad_i - g_i) by magnitude, k = ceil(ratio n) values (fp32) and their
  int32 positions; then g_i += c_i and g += sum_j c_j, and g is the gradient the
  optimizer sees. The residual grad_i - g_i is never lost: what is sent plus what remains
  equals it exactly (``TopK.encode`` sets the sent entries of g_i to the gradient itself,
  which is g_i + c_i without rounding). All-gathered; bytes per tensor: 8k. After plain
  warm-up steps (``--compress-warmup``) g_i and g start from the last plain step's
  gradients (EF21's initialisation), or from zero with ``--ef21-start zero``.
- ``powersgd:r`` (Vogels et al. 2019) with error feedback: a matrix gradient M (a
  tensor reshaped to rows x the rest) plus its error e becomes M' = M + e; P = M' Q is
  all-reduced (summable), orthonormalised to P^, then Q = M'^T P^ is all-reduced; the
  result is P^ Q^T, the new error M' - P^ P^T M', and Q warm-starts the next step (the
  same on every rank; it starts from a seeded Gaussian). Tensors with one dimension, or
  too small to gain (r (rows + cols) >= rows x cols), travel uncompressed. Bytes per
  matrix: 4 r (rows + cols) in two all-reduces.

- ``int8`` (per-step gradients, and local SGD / DiLoCo syncs; a summable stochastic
  quantisation with a scale shared by the R ranks that sum, the idea of THC, Li et al.
  2024): each block of ``QSGD_BLOCK``
  elements of a tensor v (its blocks restart at every tensor) gets the scale a = the
  largest |v_i| of the block over *all* replicas (one fp32 all-reduce with MAX), and each
  element a signed level l_i in -s..s, s = 127 // R, drawn so that E[l_i] = s v_i / a
  (stochastic rounding). The R replicas' levels sum in one int8 all-reduce without
  overflow (|sum| <= R s <= 127); decoding the sum gives a sum_i l_i / s, an unbiased
  estimate of sum_i v_i, each replica's error at most a / s per element (variance at
  most (a / s)^2 / 4). Unlike QSGD's norm scale, the max scale keeps the error small for
  every block size (the largest element of a block, not its norm, sets the grid).
  Bytes per tensor of n elements: n + 4 ceil(n / 512), all-reduced.

Where a codec keeps state (EF21's g_i and g, PowerSGD's error and Q) it is per tensor, under
the tensor's name, so checkpoints can store it (``state()`` / ``load_state``).
"""

from __future__ import annotations

import math
import zlib

import torch

# QSGD_BLOCK: elements per QSGD norm (the bucket size d of Alistarh et al.'s experiments)
from plait.dp_algos.volume import ENCODE_CHUNK, QSGD_BLOCK


def _blocks(n: int) -> int:
    return math.ceil(n / QSGD_BLOCK)


def encode_levels(x: torch.Tensor, scale_of, s: int, gen) -> torch.Tensor:
    """int8 levels (n,) of the tensor ``x``, ``ENCODE_CHUNK`` elements at a time (the
    working set, ``stochastic_levels``'s, under 64 MiB: a 128K-token table's gradient is
    262M elements at hidden 2048, 4 GiB of it encoded whole, in the backward):
    ``scale_of(v, first)`` gives the scale of each block of ``v``, a chunk's fp32 blocks
    whose first is block ``first`` of the tensor. The uniform draws come from ``gen`` in
    order, chunk after chunk, as one draw of the whole would (the same bits on a CPU)."""
    n = x.numel()
    flat = x.reshape(-1)
    out = torch.empty(n, dtype=torch.int8, device=x.device)
    for at in range(0, n, ENCODE_CHUNK):
        part = flat[at : at + ENCODE_CHUNK]
        v = _blocks_copy(part)
        levels = stochastic_levels(v, scale_of(v, at // QSGD_BLOCK), s, gen)
        out[at : at + part.numel()] = levels[: part.numel()]
    return out


def _blocks_copy(x: torch.Tensor) -> torch.Tensor:
    """A fp32 copy of ``x``, flat, zero-padded to whole blocks: (blocks, ``QSGD_BLOCK``)."""
    n = x.numel()
    v = torch.zeros(_blocks(n) * QSGD_BLOCK, dtype=torch.float32, device=x.device)
    v[:n].copy_(x.reshape(-1))
    return v.view(-1, QSGD_BLOCK)


def _decode_chunks(x: torch.Tensor, levels: torch.Tensor, step: torch.Tensor, write) -> None:
    """``write(x's part, levels x step)`` chunk after chunk: ``step`` a block's value of
    one level (fp32, one a block of ``levels``)."""
    flat = x.view(-1)
    for at in range(0, flat.numel(), ENCODE_CHUNK):
        part = levels[at : at + ENCODE_CHUNK]
        first = at // QSGD_BLOCK
        v = _blocks_copy(part)
        v.mul_(step[first : first + v.shape[0], None])
        write(flat[at : at + part.numel()], v.view(-1)[: part.numel()])


def stochastic_levels(v: torch.Tensor, scale: torch.Tensor, s: int, gen) -> torch.Tensor:
    """int8 levels (flat) of the fp32 blocks ``v`` (a copy, ``_blocks_copy``, which this
    overwrites): l_i = sign(v_i) (floor(m_i) + Bernoulli(m_i - floor(m_i))), m_i = |v_i| x
    the block's ``scale``, clamped to s. In place where it can be: three fp32 copies of
    the tensor at once (v, floor(m), the uniform draws) and a few bytes an element, where
    the plain expression held up to seven -- the codec runs in the backward, at a rank's
    peak. The same arithmetic in the same order, so the same bits."""
    neg = v.signbit()  # the sign, before v becomes |v| (a zero stays a zero level)
    mag = v.abs_().mul_(scale[:, None])  # in [0, s]
    low = mag.floor()
    u = torch.rand(mag.shape, generator=gen, device=v.device, dtype=mag.dtype)
    up = u.lt_(mag.sub_(low))  # the fraction's Bernoulli draw, as 0 / 1 in u's storage
    level = low.add_(up).clamp_(max=s).to(torch.int8)
    return torch.where(neg, level.neg(), level).view(-1)


class QSGD:
    """Unbiased stochastic quantisation to ``levels`` levels per sign (module docstring)."""

    name = "qsgd"
    summable = False

    def __init__(self, levels: int, *, seed: int = 0):
        self.levels, self.seed = int(levels), seed

    def nbytes(self, numel: int) -> int:
        return numel + 4 * _blocks(numel)

    def parts(self, numel: int) -> tuple[int, int, torch.dtype]:
        """(fp32 elements, small elements, small dtype) of one tensor's message."""
        return _blocks(numel), numel, torch.int8

    def generator(self, key: str, step: int, sender, device) -> torch.Generator:
        """The random stream of one tensor, one step, one sender: seeded, so a resumed run
        draws what the uninterrupted one drew."""
        g = torch.Generator(device=device)
        g.manual_seed(zlib.crc32(f"{self.seed}|{step}|{sender}|{key}".encode()))
        return g

    def encode(self, x: torch.Tensor, *, gen: torch.Generator):
        """(norms fp32 (blocks,), levels int8 (n,)) of the flat fp32 tensor ``x``."""
        norms = torch.empty(_blocks(x.numel()), dtype=torch.float32, device=x.device)

        def scale_of(v: torch.Tensor, first: int) -> torch.Tensor:
            got = norms[first : first + v.shape[0]]
            torch.linalg.vector_norm(v, dim=1, out=got)
            return torch.where(got > 0, self.levels / got, torch.zeros_like(got))

        return norms, encode_levels(x, scale_of, self.levels, gen)

    def decode(self, norms: torch.Tensor, levels: torch.Tensor, n: int) -> torch.Tensor:
        """fp32 (n,): |v| l_i / s per element."""
        out = torch.zeros(n, dtype=torch.float32, device=levels.device)
        self.add_decoded(out, norms, levels)
        return out

    def add_decoded(self, x: torch.Tensor, norms: torch.Tensor, levels: torch.Tensor) -> None:
        """``x += decode(norms, levels)``, ``ENCODE_CHUNK`` elements at a time: one fp32
        copy of a chunk, not of the tensor (it runs in the backward). The same bits."""
        _decode_chunks(x, levels, norms / self.levels, torch.Tensor.add_)


class Int8Sum:
    """Summable stochastic int8 quantisation with a scale shared by the ``replicas``
    (module docstring). Per tensor: ``scales`` (before the MAX all-reduce), ``encode``
    (after it), ``decode`` (of the summed levels)."""

    name = "int8"

    def __init__(self, replicas: int, *, seed: int = 0):
        self.levels = 127 // int(replicas)
        if self.levels < 1:
            raise ValueError(f"int8 holds at most 127 replicas' levels, got {replicas}")
        self.seed = seed

    @staticmethod
    def blocks(numel: int) -> int:
        return _blocks(numel)

    def generator(self, key: str, step: int, sender, device) -> torch.Generator:
        """One tensor's random stream at one sync of one replica: seeded, so a resumed run
        draws what the uninterrupted one drew, and keyed by the tensor's name, so a tied
        copy on another pipeline stage draws alike."""
        g = torch.Generator(device=device)
        g.manual_seed(zlib.crc32(f"int8|{self.seed}|{step}|{sender}|{key}".encode()))
        return g

    def scales(self, x: torch.Tensor) -> torch.Tensor:
        """This replica's largest |x_i| of each block (fp32, (blocks,)), ``ENCODE_CHUNK``
        elements at a time (one fp32 copy of a chunk: it runs in the backward)."""
        flat = x.reshape(-1)
        parts = [_blocks_copy(flat[at : at + ENCODE_CHUNK]).abs_().amax(dim=1)
                 for at in range(0, x.numel(), ENCODE_CHUNK)]  # fmt: skip
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=x.device)

    def encode(self, x: torch.Tensor, scales: torch.Tensor, *, gen: torch.Generator):
        """int8 levels (n,) of ``x`` on the grid of the shared ``scales`` (>= this
        replica's own, so every level is within -s..s)."""
        step = torch.where(scales > 0, self.levels / scales, torch.zeros_like(scales))
        return encode_levels(x, lambda v, first: step[first : first + v.shape[0]],
                             self.levels, gen)  # fmt: skip

    def decode(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 (n,) of (summed) ``levels``: sum_i l_i a / s per element."""
        out = torch.empty(levels.numel(), dtype=torch.float32, device=levels.device)
        _decode_chunks(out, levels, scales / self.levels, torch.Tensor.copy_)
        return out

    # one message of several tensors: what a bucket or a chunk sends

    def scales_of(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """This rank's block scales of the flat tensors ``xs``, one fp32 message (to be
        all-reduced with MAX)."""
        return torch.cat([self.scales(x) for x in xs])

    def _cuts(self, xs, scales: torch.Tensor) -> list[torch.Tensor]:
        cuts, at = [], 0
        for x in xs:
            cuts.append(scales[at : at + _blocks(x.numel())])
            at += _blocks(x.numel())
        return cuts

    def encode_all(self, items, scales: torch.Tensor, *, step: int, sender) -> torch.Tensor:
        """One int8 message of the (key, flat tensor) ``items`` on the shared ``scales``
        (``scales_of`` after the MAX), each tensor on its own random stream."""
        xs = [x for _, x in items]
        return torch.cat([
            self.encode(x, a, gen=self.generator(key, step, sender, x.device))
            for (key, x), a in zip(items, self._cuts(xs, scales))
        ])  # fmt: skip

    def decode_into(self, levels: torch.Tensor, scales: torch.Tensor, xs) -> None:
        """Each tensor of ``xs`` set to its part of the summed ``levels`` decoded, as
        ``decode_all`` gives it, ``ENCODE_CHUNK`` elements at a time (one fp32 copy of a
        chunk beside the tensors)."""
        offset = 0
        for x, a in zip(xs, self._cuts(xs, scales)):
            _decode_chunks(x, levels[offset : offset + x.numel()], a / self.levels,
                           torch.Tensor.copy_)  # fmt: skip
            offset += x.numel()

    def decode_all(self, levels: torch.Tensor, scales: torch.Tensor, xs) -> list[torch.Tensor]:
        """The summed ``levels`` of one message decoded, one flat fp32 tensor per tensor
        of ``xs`` (their sizes)."""
        out, offset = [], 0
        for x, a in zip(xs, self._cuts(xs, scales)):
            out.append(self.decode(levels[offset : offset + x.numel()], a))
            offset += x.numel()
        return out


class TopK:
    """Top-k sparsification with EF21 error feedback (module docstring)."""

    name = "topk"
    summable = False

    def __init__(self, ratio: float, *, warm_start: bool = True):
        self.ratio = float(ratio)
        # plain warm-up steps set g_i and g to the gradients (True: EF21's initialisation
        # from full gradients) or leave them at zero (False: compression then starts from
        # zero estimates, as PowerSGD's error does)
        self.warm_start = warm_start
        self.local: dict[str, torch.Tensor] = {}  # g_i: this rank's estimate
        self.total: dict[str, torch.Tensor] = {}  # g = sum_i g_i, the same on every rank

    def k(self, numel: int) -> int:
        return math.ceil(self.ratio * numel) if numel else 0

    def nbytes(self, numel: int) -> int:
        return 8 * self.k(numel)

    def parts(self, numel: int) -> tuple[int, int, torch.dtype]:
        return self.k(numel), self.k(numel), torch.int32

    def _state(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.local:
            self.local[key] = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
            self.total[key] = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        return self.local[key], self.total[key]

    def encode(self, key: str, x: torch.Tensor):
        """(values fp32 (k,), positions int32 (k,)) of grad - g_i; g_i takes them in."""
        local, _ = self._state(key, x)
        flat = x.reshape(-1).float()
        k = self.k(flat.numel())
        if k:  # |grad - g_i| in one fp32 copy (it runs in the backward); the k values
            # sent are the same differences, taken again at the k positions
            idx = torch.topk(flat.sub(local).abs_(), k, sorted=False).indices
        else:
            idx = flat.new_zeros(0, dtype=torch.long)
        values = flat[idx] - local[idx]
        local[idx] = flat[idx]  # = g_i + c_i, exactly: nothing of the residual is lost
        return values, idx.to(torch.int32)

    def follow_local(self, key: str, x: torch.Tensor) -> None:
        """A plain warm-up step: g_i = this rank's gradient ``x`` (a no-op without
        ``warm_start``: g_i stays zero until compression starts)."""
        if self.warm_start:
            self._state(key, x)[0].copy_(x.reshape(-1))

    def follow_total(self, key: str, x: torch.Tensor) -> None:
        """A plain warm-up step: g = the all-reduced gradient ``x`` (the sum of the g_i)."""
        if self.warm_start:
            self._state(key, x)[1].copy_(x.reshape(-1))

    def add_to_total(self, key: str, values: torch.Tensor, idx: torch.Tensor, n: int) -> None:
        """g += one sender's c (call for every sender, in rank order)."""
        if key not in self.total:
            self._state(key, values.new_empty(n))
        self.total[key].index_add_(0, idx.long(), values)

    def result(self, key: str) -> torch.Tensor:
        return self.total[key]

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {"ef21_local": self.local[k], "ef21_total": self.total[k]} for k in self.local}


class PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback (module docstring)."""

    name = "powersgd"
    summable = True

    def __init__(self, rank: int, *, seed: int = 0):
        self.rank, self.seed = int(rank), seed
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._m: dict[str, torch.Tensor] = {}  # M + e between ``first`` and ``second``

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(rows, cols) the tensor is compressed as, or None when it travels whole."""
        if len(shape) < 2:
            return None
        rows = shape[0]
        cols = math.prod(shape) // rows if rows else 0
        r = min(self.rank, rows, cols)
        if r == 0 or r * (rows + cols) >= rows * cols:
            return None
        return rows, cols

    def r(self, shape: tuple[int, ...]) -> int:
        rows, cols = self.matrix_shape(shape)
        return min(self.rank, rows, cols)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        mat = self.matrix_shape(shape)
        if mat is None:
            return 4 * math.prod(shape)
        return 4 * self.r(shape) * (mat[0] + mat[1])

    def _q(self, key: str, cols: int, r: int, device) -> torch.Tensor:
        if key not in self.q:
            g = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{self.seed}|{key}".encode()))
            self.q[key] = torch.randn(cols, r, generator=g).to(device)
        return self.q[key]

    def first(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """P = (M + e) Q for one matrix gradient. M' = M + e is formed in the error's own
        storage and kept there for ``second``, which turns it into the next error in
        place: one fp32 copy of the gradient a matrix, not two (a separate M' beside the
        error held a second copy of every compressed gradient from the backward to
        ``finish()``)."""
        rows, cols = self.matrix_shape(tuple(grad.shape))
        g = grad.reshape(rows, cols)
        if key in self.error:
            m = self.error.pop(key).add_(g)  # e + M: the same bits as M + e
        else:  # the first step: a copy, never a view of the gradient (overwritten later)
            m = g.to(torch.float32, copy=True)
        self._m[key] = m
        return m @ self._q(key, cols, self.r(tuple(grad.shape)), grad.device)

    def second(self, key: str, p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(P^, Q = M'^T P^) from the all-reduced P; the error M' - P^ Q^T is set here,
        in M''s storage."""
        m = self._m.pop(key)
        p_hat = orthonormalise(p_sum)
        q = m.T @ p_hat
        self.error[key] = m.sub_(p_hat @ q.T)
        return p_hat, q

    def finish(self, key: str, p_hat: torch.Tensor, q_sum: torch.Tensor) -> torch.Tensor:
        """The summed gradient's approximation P^ Q^T; Q is kept for the next step."""
        self.q[key] = q_sum
        return p_hat @ q_sum.T

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {"powersgd_error": e} for k, e in self.error.items()}


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Columns of ``p`` made orthonormal by Gram-Schmidt, in order (as PowerSGD does; a
    zero column stays zero). Deterministic: every rank gets the same bits from the same
    input."""
    out = p.clone()
    for j in range(out.shape[1]):
        col = out[:, j]
        for i in range(j):
            col -= (out[:, i] @ col) * out[:, i]
        norm = torch.linalg.vector_norm(col)
        # on the device, without asking the host (a zero column divided by 1 stays zero):
        # an ``if norm > 0`` here was one host synchronisation per column and matrix
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
    return out
