"""The pure rules of several brokers (common/brokers.py): the endpoint list, one value per broker, and which
broker a session goes to (stable, spread, only a lost broker's sessions move)."""

from __future__ import annotations

from collections import Counter

import pytest

from specrelay.common.brokers import MAX_BROKERS, broker_list, choose, per_broker


def test_broker_list_reads_a_string_a_comma_list_or_a_sequence():
    assert broker_list("tcp://a:1") == ("tcp://a:1",)
    assert broker_list(" tcp://a:1 , ipc:///run/b ") == ("tcp://a:1", "ipc:///run/b")
    assert broker_list(["tcp://a:1", "tcp://b:1,inproc://c"]) == ("tcp://a:1", "tcp://b:1", "inproc://c")


@pytest.mark.parametrize("value, words", [
    ("", "empty endpoint"), ([], "empty endpoint"), ("tcp://a:1,,tcp://b:1", "empty endpoint"),
    ("a:1", "is not an endpoint"), ("tcp://a:1,tcp://a:1", "given twice"),
    (",".join(f"tcp://h{i}:1" for i in range(MAX_BROKERS + 1)), f"at most {MAX_BROKERS}"),
])
def test_a_bad_list_is_one_sentence_naming_the_flag(value, words):
    with pytest.raises(ValueError) as info:
        broker_list(value, "--broker")
    assert words in str(info.value) and str(info.value).startswith("--broker:") and "\n" not in str(info.value)


def test_per_broker_one_for_all_or_one_each():
    assert per_broker(None, 3) == [None] * 3
    assert per_broker("k", 2) == ["k", "k"]
    assert per_broker(("k",), 2) == ["k", "k"]
    assert per_broker(("k0", "k1"), 2) == ["k0", "k1"]
    with pytest.raises(ValueError, match="2 given for 3 brokers"):
        per_broker(["k0", "k1"], 3)


def test_choice_is_stable_and_spreads():
    picks = [choose(sid, [0, 1, 2], b"edge") for sid in range(1, 3001)]
    assert picks == [choose(sid, [0, 1, 2], b"edge") for sid in range(1, 3001)]  # the same every time
    counts = Counter(picks)
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 850  # ~1000 each
    assert Counter(choose(sid, [0, 1], b"edge") for sid in range(1, 17)).keys() == {0, 1}


def test_losing_a_broker_moves_only_its_sessions_and_its_return_takes_its_own_back():
    before = {sid: choose(sid, [0, 1, 2], b"s") for sid in range(1, 1001)}
    after = {sid: choose(sid, [0, 2], b"s") for sid in before}  # broker 1 lost
    assert all(after[sid] == before[sid] for sid in before if before[sid] != 1)
    assert all(after[sid] in (0, 2) for sid in before)
    assert {sid: choose(sid, [0, 1, 2], b"s") for sid in before} == before  # back: the same choice again


def test_edges_with_the_same_session_ids_spread_differently():
    a = [choose(sid, [0, 1], b"edge-a") for sid in range(1, 65)]
    b = [choose(sid, [0, 1], b"edge-b") for sid in range(1, 65)]
    assert a != b
    with pytest.raises(ValueError):
        choose(1, [])
