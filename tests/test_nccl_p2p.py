"""The one model of NCCL's point-to-point semantics (``plait/nccl_p2p.py``), on lists small
enough to work out by hand. Its callers' uses are tested where they are: the pipeline
schedules in test_schedules.py, the simulator's replay in test_sim.py, gossip's batches in
test_dp_algos.py."""

import pytest

from plait.nccl_p2p import (
    RECV,
    SEND,
    Compute,
    Message,
    P2PDeadlock,
    P2PMismatch,
    Post,
    Timeline,
    pair,
    resolve,
    timed,
)


def send(peer, tag=None, hop=0):
    return Message(SEND, peer, tag, hop)


def recv(peer, tag=None):
    return Message(RECV, peer, tag)


def test_crossing_messages_deadlock_one_at_a_time_and_complete_in_one_batch():
    """The module docstring's example: each rank sends first, then receives."""
    alone = [[Post((send(1),)), Post((recv(1),))], [Post((send(0),)), Post((recv(0),))]]
    with pytest.raises(P2PDeadlock) as err:
        resolve(alone)
    assert str(err.value) == (
        "batches deadlock under NCCL's point-to-point semantics: rank 0's batch at item 0 "
        "[>1]; rank 1's batch at item 0 [>0] wait forever"
    )
    together = [[Post((send(1), recv(1)))], [Post((send(0), recv(0)))]]
    assert len(resolve(together).steps) == 6  # post, start, finish on each rank


def test_receives_first_on_both_sides_deadlock_through_the_computes():
    """Each rank's compute reads a message the other sends only after its own compute: the
    batches the computes wait for are named."""
    programs = [
        [Post((recv(1),)), Compute(0), Post((send(1),))],
        [Post((recv(0),)), Compute(0), Post((send(0),))],
    ]
    with pytest.raises(P2PDeadlock, match=r"rank 0's batch at item 0 \[<1\]; rank 1's batch at"):
        resolve(programs)


def test_timed_by_hand():
    """rank 0: compute (1), then posts [>1]; rank 1: posts [<0], then a compute (2) that
    reads it. Transfer 0.5: rank 1's batch starts at 0, rank 0's at 1, the message arrives
    at 1.5, so rank 1 computes over [1.5, 3.5]."""
    programs = [[Compute(None, 0), Post((send(1, hop=0),))], [Post((recv(0),)), Compute(0, 1)]]
    resolution = resolve(programs)
    times = timed(resolution, [1.0, 2.0], [0.5])
    timeline = Timeline.of([["c", "b"], ["b", "c"]], resolution, times)
    assert timeline.events == [
        [("c", 0.0, 1.0), ("b", 1.0, 1.5)],
        [("b", 0.0, 1.5), ("c", 1.5, 3.5)],
    ]
    assert times.ends == [1.5, 3.5]
    assert times.flight[resolution.offsets[1]] == 0.5  # rank 1's batch ended with the transfer
    # the same lists with other costs: one more pass, no new resolution
    assert timed(resolution, [3.0, 1.0], [0.0]).ends == [3.0, 4.0]


def test_messages_between_two_ranks_pair_in_posting_order():
    """NCCL pairs the k-th send with the k-th receive; tags that disagree are an error,
    a side without its partner is a deadlock."""
    sent = [Post((send(1, "a"),)), Post((send(1, "b"),))]
    assert pair([sent, [Post((recv(0, "a"), recv(0, "b")))]]) == [
        ((0, 0), (1, 0), 0),
        ((0, 1), (1, 0), 0),
    ]
    with pytest.raises(P2PMismatch, match=r"rank 0 to rank 1 .* different orders \(message 0"):
        pair([sent, [Post((recv(0, "b"), recv(0, "a")))]])
    with pytest.raises(P2PDeadlock, match="message 1 from rank 0 to rank 1 has no receive"):
        resolve([sent, [Post((recv(0, "a"),))]])
