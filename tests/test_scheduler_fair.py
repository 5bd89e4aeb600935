"""The cloud scheduler's step token budget and its fairness across clients, pure (no sockets): a tree VERIFY's
nodes count as tokens (max_step_tokens, like vLLM's max_num_batched_tokens), one client's VERIFYs take at most its
share of a step while another's wait (before: first come first served, 48 sessions of 64-node trees made a legit
session's round trip 115x slower) and the rest wait for the next step while another client is active (a flood-only
step stays short, so a legit VERIFY arriving during it waits little), a client being its CURVE key's connections
together (protocol.client_of), and chunked prefill gives each
client with a pending context its part of the prefill budget (before: oldest session first, whoever sent it)."""

from __future__ import annotations

import types

from specrelay.cloud_worker.config import SchedulerConfig
from specrelay.cloud_worker.scheduler import ChunkedPrefill, Item, Scheduler
from specrelay.common import protocol as P

TREE = list(range(64))  # a full 64-node tree: 65 new tokens with the row after it


class Contexts:
    def __init__(self, lengths: dict[tuple[bytes, int], int] | None = None) -> None:
        self.sessions = {key: types.SimpleNamespace(tokens=list(range(n))) for key, n in (lengths or {}).items()}

    def cached(self, key) -> int:
        return 0


def tree(client: bytes, sid: int, t: float = 0.0) -> Item:
    return Item((client, sid), P.Verify(sid, 1, 1, draft=TREE, parents=[-1] + list(range(63))), t)


def chain(client: bytes, sid: int, t: float = 0.0) -> Item:
    return Item((client, sid), P.Verify(sid, 1, 1, draft=[1, 2, 3, 4]), t)


def scheduler(**config) -> Scheduler:
    return Scheduler(SchedulerConfig(**{"max_batch": 32, "max_wait_ms": 2.0, **config}), Contexts())


def test_a_tree_s_nodes_count_against_the_step_token_budget():
    s = scheduler(max_step_tokens=256)
    for sid in range(48):
        s.push(tree(b"flood", sid))
    step = s.plan(0.0, lambda it: None).step
    assert sum(it.tokens for it in step.verifies) <= 256 and len(step.verifies) == 3  # 3 x 65, not 32 x 65
    assert len(s.queue) == 45


def test_a_legit_chain_behind_48_trees_of_another_client_goes_in_the_first_step():
    s = scheduler(max_step_tokens=256)
    for sid in range(48):
        s.push(tree(b"flood", sid))
    s.push(chain(b"legit", 1))
    step = s.plan(0.0, lambda it: None).step
    assert (b"legit", 1) in [it.key for it in step.verifies]
    flood = sum(it.tokens for it in step.verifies if it.peer == b"flood")
    assert flood <= 256 - 5 and sum(it.tokens for it in step.verifies) <= 256


def test_a_client_past_its_share_waits_while_another_is_active_and_alone_gets_the_step():
    s = scheduler(max_step_tokens=256)
    s.last_seen[(b"legit", 1)] = 0.0  # the legit client was active lately (drafting its next block) ...
    for sid in range(8):
        s.push(tree(b"flood", sid))
    step = s.plan(0.0, lambda it: None).step
    assert [it.peer for it in step.verifies] == [b"flood"]  # ... so a flood-only step holds the flood's part only:
    s.push(chain(b"legit", 1))  # the legit VERIFY that comes during it waits for one short step, not three trees'
    step = s.plan(0.0, lambda it: None).step
    assert [it.peer for it in step.verifies] == [b"legit"]  # and the flood, held by its share, sits this one out
    assert [it.peer for it in s.plan(0.0, lambda it: None).step.verifies] == [b"flood"]  # nobody else: its turn
    s.last_seen.clear()  # the legit client went quiet: the flood alone gets the whole step again
    s._prune(100.0)
    assert len(s.plan(100.0, lambda it: None).step.verifies) == 3
    assert len(s.plan(100.0, lambda it: None).step.verifies) == 3  # held by the budget alone: it never sits out


def test_a_flood_step_waits_for_a_legit_session_just_answered_while_the_legit_client_ran_fewer_tokens():
    """Beside a flood of trees the legit chain's next VERIFY used to arrive just after a flood step began and wait
    all of it, then run alone (a round: a tree's step and its own; 256 flooding sessions: 2.2-3.6x its round trip
    at rest). Now a step of the capped flood only is held back, at most as long as the last step took, for the
    session answered in the last step while its client has run fewer tokens lately: the legit VERIFY goes alone,
    and the flood gets its step once the legit client has run as many tokens (or the legit does not come back)."""
    legit, flood = (b"legit", 1), [(b"flood", sid) for sid in range(8)]
    s = Scheduler(SchedulerConfig(max_batch=32, max_wait_ms=2.0, max_step_tokens=256),
                  Contexts({legit: 10, **{key: 10 for key in flood}}))
    s.last_seen[legit] = 0.0
    for sid in range(8):
        s.push(tree(b"flood", sid))
    assert [it.peer for it in s.plan(0.0, lambda it: None).step.verifies] == [b"flood"]
    now, rounds, flood_steps = 0.0, 0, 0
    s.push(chain(b"legit", 1, now))
    while flood_steps == 0:
        step = s.plan(now + 0.010, lambda it: None).step  # the flood's step ran 10 ms: the legit's goes alone
        assert [it.peer for it in step.verifies] == [b"legit"]
        rounds += 1
        hold = s.plan(now + 0.020, lambda it: None)  # its next VERIFY is being drafted: the flood is held ...
        if hold.step is not None:
            assert [it.peer for it in hold.step.verifies] == [b"flood"]  # ... until the legit ran its tokens
            flood_steps += 1
            now += 0.030
        else:
            assert 0 < hold.wait <= 0.010 + 1e-9 and not s.batch  # at most the last step's 10 ms
            now += 0.021
        s.push(chain(b"legit", 1, now))  # back within the hold: it goes alone, the flood sits out
    tree_cost, chain_cost = s._cost(tree(b"flood", 0)), s._cost(chain(b"legit", 1))  # 74 and 14: contexts carried
    assert rounds == -(-tree_cost // chain_cost)  # the legit client ran as many tokens as the flood's step, no more
    assert [it.peer for it in s.plan(now + 0.010, lambda it: None).step.verifies] == [b"legit"]
    assert s.plan(now + 0.020, lambda it: None).wait > 0  # right after it (the worker plans at once): held ...
    late = s.plan(now + 1.0, lambda it: None)  # ... but the legit does not come back: not past the window
    assert late.step is not None and [it.peer for it in late.step.verifies] == [b"flood"]


def test_a_verify_counts_the_context_its_row_still_carries():
    contexts = Contexts({(b"flood", sid): 64 for sid in range(8)})  # nothing cached: 63 context tokens a row
    s = Scheduler(SchedulerConfig(max_batch=32, max_wait_ms=2.0, max_step_tokens=256, prefill_tokens=64), contexts)
    for sid in range(8):
        s.push(tree(b"flood", sid))
    step = s.plan(0.0, lambda it: None).step
    assert len(step.verifies) == 2  # 65 + 63 = 128 tokens a row: two fill the 256 (counting 65: three)



def test_connections_of_one_client_share_its_part():
    tag = b"\x00" + bytes(P.CLIENT_TAG)  # broker 0, one client (a CURVE key) ...
    s = scheduler(max_step_tokens=256)
    s.last_seen[(b"\x00legit", 1)] = 0.0
    for conn in range(8):  # ... on 8 connections, a tree each
        s.push(tree(tag + bytes([conn]) * 16, 1))
    step = s.plan(0.0, lambda it: None).step
    assert len(step.verifies) == 1  # one part for the client, not one per connection
    anonymous = scheduler(max_step_tokens=256)
    anonymous.last_seen[(b"\x00legit", 1)] = 0.0
    for conn in range(8):  # anonymous connections: each its own client (the residual docs/fairness.md states)
        anonymous.push(tree(b"\x00" + bytes([conn]) * 24, 1))
    assert len(anonymous.plan(0.0, lambda it: None).step.verifies) == 3


def test_each_session_keeps_its_order_under_the_budget():
    s = scheduler(max_step_tokens=130)
    for it in [tree(b"a", 1), tree(b"a", 2), Item((b"a", 2), P.Close(2), 0.0), tree(b"a", 3)]:
        s.push(it)
    handled: list = []
    first = s.plan(0.0, lambda it: handled.append(it.msg)).step
    assert [it.key[1] for it in first.verifies] == [1, 2] and handled == []  # the budget: 2 x 65
    second = s.plan(0.0, lambda it: handled.append(it.msg)).step
    assert isinstance(handled[0], P.Close) and [it.key[1] for it in second.verifies] == [3]


def test_prefill_gives_each_client_its_part_oldest_session_first_within_it():
    contexts = Contexts({(b"flood", 1): 500, (b"flood", 2): 500, (b"flood", 3): 500, (b"legit", 1): 100})
    rows = ChunkedPrefill(contexts, 64).rows()
    given = {row.key: len(row.ids) for row in rows}
    assert given[(b"legit", 1)] == 32 and given[(b"flood", 1)] == 32 and sum(given.values()) == 64
    alone = ChunkedPrefill(Contexts({(b"flood", 1): 100, (b"flood", 2): 500, (b"legit", 1): 10}), 64).rows()
    assert {row.key: len(row.ids) for row in alone} == {(b"flood", 1): 64}  # legit's is ready: the flood's turn
