"""Collective communication as an alpha-beta model: which link a group uses, and how long
one all-reduce, all-gather, reduce-scatter or point-to-point message takes on it.

Per rank, n ranks, S bytes of the full tensor, bus bandwidth B of the group's link:

    ring all-reduce                    2 L + 2 (n-1)/n S / B
    tree all-reduce                    2 L_tree + 2 S / B      (the faster of the two is used)
    all-gather / reduce-scatter (ring) L + (n-1)/n S / B       (S: the all-gather's output)
    point-to-point                     alpha + S / B

B is a *bus bandwidth* per device, as nccl-tests reports it, so the ring factors apply on
top of it. The latency L is what a message crossing the whole ring pays: the sum of its
hops' latencies. A ring of n ranks over N nodes has n - N hops inside nodes and N - 1
between them (a pipelined ring visits each node's devices in a row), so

    L = (n - N) alpha_intra + (N - 1) alpha_inter

per pass, the form of NCCL's own tuning model (``src/graph/tuning.cc``: ring latency
= intra-node steps x the NVLink hop latency + inter-node steps x the network's); a tree
all-reduce pays 2 ((n/N - 1) alpha_intra + ceil(log2 N) alpha_inter). On one host (every
calibrated CPU file) N = 1 and L is (n - 1) alpha, the classic ring term. At thousands
of ranks L reaches milliseconds per collective: what a runtime that issues one
collective per parameter tensor (``runtime.Runtime.zero3_gather_per_tensor``) pays per
tensor.

Which link: ranks fill nodes in order (``Hardware.devices_per_node`` each). A group of
``size`` ranks ``stride`` apart that spans at most one node's worth of ranks uses the
intra-node link (NVLink). Otherwise the network, where k members per node drive k rails
at once (NCCL's multi-ring over one NIC per GPU), capped by NVLink; the group's latency
per hop is then the average of its hops' (``group_link``).
"""

from __future__ import annotations

import math

from plait.sim.hardware import Hardware, Link


def group_nodes(hw: Hardware, size: int, stride: int) -> int:
    """Nodes spanned by a group of ``size`` ranks ``stride`` apart (ranks fill nodes in
    order). 8 per node, tp=2 dp=16 (stride 2): 4 members per node, 4 nodes."""
    dpn = hw.devices_per_node
    if size * stride <= dpn:
        return 1
    per_node = max(1, min(size, dpn // stride)) if stride < dpn else 1
    return math.ceil(size / per_node)


def group_link(hw: Hardware, size: int, stride: int) -> Link | None:
    """The link a group of ``size`` ranks spaced ``stride`` apart communicates over (module
    docstring), with ``latency`` the mean hop latency of its ring: (n - N) intra-node
    hops and N - 1 network hops over n - 1. None for a group of one."""
    if size <= 1:
        return None
    nodes = group_nodes(hw, size, stride)
    if nodes == 1:
        return hw.intra_node
    per_node = math.ceil(size / nodes)
    bandwidth = min(hw.intra_node.bandwidth, per_node * hw.inter_node.bandwidth)
    hops = (size - nodes) * hw.intra_node.latency + (nodes - 1) * hw.inter_node.latency
    return Link(bandwidth=bandwidth, latency=hops / (size - 1), per_op=hw.inter_node.per_op)


def ring_latency(n: int, link: Link | None, op: str = "all_gather") -> float:
    """Seconds one pass of a message around a ring of ``n`` ranks takes to start up:
    (n - 1) hops at the link's mean hop latency (``group_link``)."""
    if n <= 1 or link is None:
        return 0.0
    return (n - 1) * link.op(op).latency


def all_reduce_time(nbytes: float, n: int, link: Link | None) -> float:
    if n <= 1 or link is None or nbytes <= 0:
        return 0.0
    link = link.op("all_reduce")
    a, b = link.latency, link.bandwidth
    ring = 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b
    tree = 2 * math.ceil(math.log2(n)) * a + 2 * nbytes / b
    return min(ring, tree)


def all_gather_time(nbytes: float, n: int, link: Link | None, op: str = "all_gather") -> float:
    """All-gather whose *output* is ``nbytes`` (reduce-scatter of an ``nbytes`` input: the
    same formula, with the link's reduce-scatter pair)."""
    if n <= 1 or link is None or nbytes <= 0:
        return 0.0
    link = link.op(op)
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter_time(nbytes: float, n: int, link: Link | None) -> float:
    return all_gather_time(nbytes, n, link, op="reduce_scatter")


def p2p_time(nbytes: float, link: Link | None) -> float:
    if link is None or nbytes <= 0:
        return 0.0
    link = link.op("p2p")
    return link.latency + nbytes / link.bandwidth


def hidden_behind(comm, work, hw: Hardware):
    """Seconds a collective of ``comm`` seconds adds to ``work`` seconds of compute it runs
    beside: what outlasts the work, and the work's own slowdown while the two share the
    device (``Hardware.overlap_slowdown`` of the time they overlap). Floats, or numpy
    arrays of them."""
    import numpy as np

    k = hw.overlap_slowdown
    if np.ndim(comm) or np.ndim(work):
        return np.maximum(0.0, np.subtract(comm, work)) + k * np.minimum(comm, work)
    return max(0.0, comm - work) + k * min(comm, work)
