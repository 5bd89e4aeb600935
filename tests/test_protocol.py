"""The wire protocol: every message round-trips; defects raise InvalidRequest naming the field."""

from __future__ import annotations

import msgspec
import pytest

from specrelay.common import protocol as P
from specrelay.common.errors import InvalidRequest
from specrelay.common.packing import enum_value, f32, from_f32


@pytest.mark.parametrize("msg", [
    P.Open(7, [1, 2, 3], P.Mode.SAMPLE, 0.7, 40, 0.9, 11, P.Strategy.SRDV, b"\xff\x01", 8192),
    P.Verify(7, 3, 10, [5], [1, 2, 3, 4], f32([0.1, 0.2, 0.3, 0.4])),
    P.Verdict(7, 3, 2, 99), P.Verdict(7, 3, 1, -1, candidates=[4, 5], cand_p=f32([0.5, 0.25])),
    P.Resample(7, 3, P.ResampleKind.CANDIDATES, 1), P.Resampled(7, 3, 12), P.Close(7),
    P.Error(7, 3, P.ErrorCode.BAD_REQUEST, "x"),
    P.Ready("m", 8192, 10, 32), P.Heartbeat(3), P.Disconnect("bye"),
    P.Generate(1, "def f():\n", 16, 0.5, 0, 1.0, 3, -1, P.Mode.COUPLED, P.Strategy.HR), P.Cancel(1),
    P.Generate(1, "def f():\n"), P.Tokens(1, [1], "a"),
    P.Done(1, {"wall_s": 0.1}),
])
def test_round_trip(msg):
    frames = P.encode(msg)
    assert frames[0] == bytes((P.PROTOCOL_VERSION, P.TYPE_OF[type(msg)]))
    assert P.decode(frames) == msg


def bad(msg_type: P.MsgType, body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        P.decode([P.header(msg_type), body if isinstance(body, bytes) else msgspec.msgpack.encode(body)])
    return info.value


def test_wrong_type_names_the_field():
    err = bad(P.MsgType.VERIFY, [5, "x", 1])
    assert err.field == "seq" and "Verify.seq" in str(err)


def test_enums_decode_only_to_members_and_name_the_field():
    assert bad(P.MsgType.OPEN, [5, [1], 7]).field == "mode"
    assert bad(P.MsgType.OPEN, [5, [1], 1, 1.0, 0, 1.0, 0, "srdv"]).field == "resample"
    assert bad(P.MsgType.RESAMPLE, [5, 1, 9]).field == "kind"
    assert bad(P.MsgType.ERROR, [5, 1, 99, "x"]).field == "code"
    assert P.decode(P.encode(P.Open(5, [1], P.Mode.SAMPLE, 1.0))).resample == P.DEFAULT_STRATEGY
    with pytest.raises(InvalidRequest, match="resample must be one of full, hr, srdv"):
        enum_value(P.Strategy, "coupled", "resample")
    assert enum_value(P.Mode, "Coupled", "mode") is P.Mode.COUPLED


def test_enums_cost_one_byte():
    greedy = P.encode(P.Verdict(3, 4, 2, 100))[1]
    assert len(P.encode(P.Error(3, 4, P.ErrorCode.UNKNOWN_SESSION))[1]) == 4  # [3, 4, 2]: array + 3 fixints
    assert len(greedy) == 5


def test_a_hinted_verdicts_theta_o_costs_one_byte():
    """A hinted VERDICT must carry theta_o (0.0) before its load hint: it goes as the int 0 and decodes as the float
    0.0 (issue 20: ~8 downlink bits per token of coupled cross-vocabulary sampling); other values keep float64."""
    hint = P.LoadHint(16, 5, 41000, 3000, 80)
    hinted = P.encode(P.Verdict(3, 4, 2, 100, load=hint))
    assert len(hinted[1]) == len(msgspec.msgpack.encode([3, 4, 2, 100, [], b"", b"", 0.0, hint])) - 8
    back = P.decode(hinted)
    assert back == P.Verdict(3, 4, 2, 100, load=hint) and type(back.theta_o) is float
    for theta in (0.1, 2.0):
        assert P.decode(P.encode(P.Verdict(3, 4, 1, -1, theta_o=theta, load=hint))).theta_o == theta


def test_huge_arrays_rejected_cheaply():
    assert bad(P.MsgType.VERIFY, [5, 1, 1, [], list(range(P.MAX_DRAFT + 1))]).field == "draft"
    assert bad(P.MsgType.OPEN, [5, list(range(P.MAX_CONTEXT + 1))]).field == "tokens"


def test_out_of_range_and_garbage():
    assert bad(P.MsgType.VERIFY, [-1, 1, 1]).field == "session"
    assert bad(P.MsgType.VERIFY, b"\xc1\xc1").field == "body"
    with pytest.raises(InvalidRequest, match="version"):
        P.decode([bytes((99, 2)), b""])
    with pytest.raises(InvalidRequest, match="unknown message type"):
        P.decode([bytes((P.PROTOCOL_VERSION, 200)), b""])
    with pytest.raises(InvalidRequest, match="2 frames"):
        P.decode([b"x"])


def test_probabilities_are_checked():
    with pytest.raises(InvalidRequest, match="finite"):
        from_f32(f32([float("nan")]))
    with pytest.raises(InvalidRequest, match="expected 2"):
        from_f32(f32([0.5]), 2)


def test_session_of_reads_only_the_first_field():
    assert P.session_of(P.encode(P.Verify(123, 4, 5, draft=[1]))[1]) == 123
