"""What `--draft-len auto` optimises (`--objective speed|balanced|cloud`, docs/draftlen.md): the choice per
objective, the cloud's utilisation as the price of a call, the cross-vocabulary draft's steps per token, and the
objective's way in (CLI, session config, client GENERATE, HTTP) with old peers' messages still decoding."""

from __future__ import annotations

import msgspec
import pytest

from specrelay.common import protocol as P
from specrelay.common.errors import InvalidRequest
from specrelay.common.metrics import Utilisation
from specrelay.common.protocol import LoadHint, Objective
from specrelay.edge_worker import api
from specrelay.edge_worker.draftlen import BUSY_FULL, SATURATED, TOLERANCE, best_length, tolerance
from specrelay.edge_worker.config import EdgeConfig, SessionConfig

from test_draftlen import goodput, trained

WORLD = dict(alpha=0.85, rtt=0.02, draft_per_token=0.003, forward=(0.02, 0.0004))


def rate_curve(ctl, top: int = 32) -> tuple[list[float], list[float]]:
    """(rate E(d) / T(d), calls per token 1 / E(d)) for d = 0..top, as the controller sees the world."""
    a, model = ctl.cautious_rates(top + 1), ctl.edge.round_model()  # what speed and balanced choose on
    rates = [goodput(a, d, model(d, 0.0)) for d in range(top + 1)]
    return rates, [goodput(a, d, 1.0) ** -1 for d in range(top + 1)]


@pytest.mark.parametrize("objective", [Objective.SPEED, Objective.BALANCED])
def test_speed_and_balanced_take_the_fewest_calls_within_their_tolerance(objective):
    ctl = trained(**WORLD, objective=objective)
    rates, calls = rate_curve(ctl)
    d = ctl.choose(33)
    if objective == Objective.SPEED:
        assert rates[d] >= 0.99 * max(rates)
    else:  # the longest (fewest calls) among the lengths within the tolerance of the best rate
        within = [k for k, r in enumerate(rates) if r >= (1 - TOLERANCE[objective]) * max(rates)]
        assert d == max(within) and calls[d] == min(calls[k] for k in within)


def test_cloud_takes_the_least_cloud_time_per_token():
    ctl = trained(**WORLD, objective=Objective.CLOUD)
    a, edge = ctl.rates(34), ctl.edge
    cost = [edge.row_share(d) / goodput(a, d, 1.0) for d in range(34)]  # the row's pass share / E(d)
    d = ctl.choose(34)
    balanced = trained(**WORLD, objective=Objective.BALANCED).choose(34)
    assert d == balanced or (cost[d] <= 1.01 * min(cost) and all(c > 1.01 * min(cost) for c in cost[d + 1:]))
    # a dearer pass per token (the cloud verifies every rejected token) shortens it, a dearer call lengthens it
    assert trained(**(WORLD | {"forward": (0.02, 0.004)}), objective=Objective.CLOUD).choose(34) < d
    assert trained(**(WORLD | {"forward": (0.2, 0.0004)}), objective=Objective.CLOUD).choose(34) >= d


def test_objectives_order_speed_balanced_cloud():
    speed, balanced, cloud = (trained(**WORLD, objective=o).choose(33) for o in Objective)
    assert speed < balanced <= cloud
    world = WORLD | {"draft_per_token": 0.01}  # a slow edge: drafting costs the session, not the cloud
    balanced, cloud = (trained(**world, objective=o).choose(33) for o in (Objective.BALANCED, Objective.CLOUD))
    assert balanced < cloud


def test_a_saturated_cloud_moves_speed_and_balanced_toward_fewer_calls():
    for objective in (Objective.SPEED, Objective.BALANCED):
        idle = trained(**WORLD, objective=objective, busy=300).choose(33)
        saturated = trained(**WORLD, objective=objective, busy=1000)
        assert saturated.edge.busy.value == pytest.approx(1.0)
        assert saturated.choose(33) > idle
    assert tolerance(Objective.SPEED, 0.5) == 0 and tolerance(Objective.SPEED, BUSY_FULL) == SATURATED
    assert tolerance(Objective.BALANCED, 0.9) > TOLERANCE[Objective.BALANCED]


def test_longest_within_tolerance_is_not_fooled_by_a_later_bump():
    # rates fall then rise a little: the longest d within the tolerance, wherever it is
    rates_at = {0: 10.0, 1: 9.5, 2: 8.0, 3: 9.2}
    assert best_length([0.5] * 4, lambda d, p: goodput([0.5] * 4, d, 1.0) / rates_at[d], 3, 0.1) == 3


def test_cross_vocabulary_steps_per_token_make_drafting_dearer():
    plain = trained(**WORLD)
    xv = trained(**WORLD)
    for _ in range(200):  # the draft writes ~2.5 of its own tokens per target token, one target token past d
        xv.edge.observe_block_steps(25, 9)
    assert xv.edge.steps_per_token.value == pytest.approx(2.5, rel=0.05)
    assert xv.edge.round_time(4, 0.0) > plain.edge.round_time(4, 0.0)
    assert xv.choose(33) < plain.choose(33)


def test_utilisation_is_the_busy_share_of_wall_time():
    now = [0.0]
    u = Utilisation(lambda: now[0], window_s=2.0)
    for _ in range(4):  # 0.4 s of forward pass every 0.5 s
        now[0] += 0.5
        u.add(0.4)
    assert u.per_mille() == 800
    now[0] += 10.0  # idle for 10 s, then one pass: the window shows the idle time
    u.add(0.1)
    assert u.per_mille() == 10


def test_old_peers_messages_still_decode():
    class OldHint(msgspec.Struct, array_like=True, omit_defaults=True):  # a worker from before `busy`
        batch: int = 0
        width: int = 0
        forward_us: int = 0
        queue_us: int = 0
        tokens: int = 0
        prefill: int = 0

    old = msgspec.msgpack.encode(OldHint(4, 5, 1000, 20, 22, 0))
    assert msgspec.msgpack.decode(old, type=LoadHint) == LoadHint(4, 5, 1000, 20, 22, 0, 0)
    assert P.decode(P.encode(P.Generate(1, "x"))).objective is None  # the edge's default then
    with pytest.raises(InvalidRequest):
        P.decode(P.encode(P.Verdict(1, 1, 0, 5, load=LoadHint(busy=5000))))  # bounded where it enters


def test_objective_reaches_the_session_config():
    assert SessionConfig().objective == Objective.BALANCED  # the default
    assert SessionConfig(objective="cloud").objective == Objective.CLOUD
    with pytest.raises(InvalidRequest) as err:
        SessionConfig(objective="fastest")
    assert err.value.field == "objective"
    req = msgspec.json.decode(b'{"model": "m", "prompt": "x", "objective": "speed"}', type=api.CompletionRequest)
    assert api.session_config(req, 8, EdgeConfig()).objective == Objective.SPEED
    with pytest.raises(api.APIError):
        api.session_config(msgspec.json.decode(b'{"model": "m", "prompt": "x", "objective": "max"}',
                                               type=api.CompletionRequest), 8, EdgeConfig())


def test_cli_objective_flag_everywhere():
    from specrelay import cli

    from specrelay import cliargs

    for argv in (["generate", "--prompt", "x"], ["edge-worker"], ["serve"]):
        assert cliargs.parse(cli.parser(), argv, environ={}).objective == "balanced"
        assert cliargs.parse(cli.parser(), [*argv, "--objective", "cloud"], environ={}).objective == "cloud"


def test_a_client_generate_takes_the_edges_default_objective_unless_it_names_one():
    from types import SimpleNamespace

    from specrelay.edge_worker.frontend import session_config
    from specrelay.edge_worker.server import EdgeConfig

    edge = SimpleNamespace(config=EdgeConfig(default_objective="cloud"))
    assert session_config(edge, P.Generate(1, "x")).objective == Objective.CLOUD
    assert session_config(edge, P.Generate(1, "x", objective=Objective.SPEED)).objective == Objective.SPEED


def test_sweep_runs_auto_once_per_objective():
    from specrelay.bench.sweep import is_auto, objective_of, parse_lens

    lens = parse_lens("2,auto", "speed,cloud")
    assert lens == [0, 2, "auto:speed", "auto:cloud"]
    assert [objective_of(d) for d in lens] == [None, None, "speed", "cloud"]
    with pytest.raises(SystemExit):
        parse_lens("auto", "fastest")
    assert not is_auto("fixed") and is_auto("auto:cloud")  # the edge keys of fixed lengths are "fixed"


def test_report_merge_regenerates_only_what_was_rerun(tmp_path):
    import json

    from specrelay.bench.report import render_docs

    docs, out = tmp_path / "benchmarks.md", tmp_path / "out"
    out.mkdir()
    docs.write_text("# Measured numbers\n\n## sweep-s16\n\nold sweep table\n\n## calls\n\nold calls\n\n"
                    "## JSON schema\n\nold schema\n")
    (out / "calls.json").write_text(json.dumps({"bench": "calls", "meta": {}, "cloud_calls_per_token": 0.23}))
    text = render_docs(out, docs, tmp_path / "img", merge=True).read_text()
    assert "old sweep table" in text and "old calls" not in text and "0.23" in text
    assert "old schema" not in text and text.count("## JSON schema") == 1


def test_at_d_0_probes_back_off_while_they_confirm_it():
    from specrelay.edge_worker.draftlen import EXPLORE_AFTER, PROBE_EVERY, GoodputController
    from specrelay.edge_worker.estimators import PROBE_MAX

    ctl = GoodputController(objective=Objective.SPEED)
    ctl.edge.acceptance.observe(8, 0)  # the draft's first token was rejected, on an edge ...
    for _ in range(4):  # ... whose cloud passes are cheap and whose draft is slow: d = 0 is best
        ctl.observe_round(1, 0.05, 0.01, 2, 1, LoadHint(1, 2, 9000, 0, 2, 0, 0))
    assert ctl.choose(64) == 0
    due = []
    for _ in range(PROBE_EVERY * (1 + 2 + 4) + 3):
        due.append(ctl.probes)
        ctl.observe_block(0, 0, bonus_match=False if ctl.probes else None)  # each probe: the draft's guess missed
    gaps = [i for i, p in enumerate(due) if p]
    assert gaps == [PROBE_EVERY, 3 * PROBE_EVERY + 1, 7 * PROBE_EVERY + 2]  # 4, then 8, then 16 idle rounds
    for _ in range(40):
        ctl.observe_block(0, 0, bonus_match=False if ctl.probes else None)
    assert ctl.edge.zero.interval(PROBE_EVERY) <= PROBE_MAX
    ctl.observe_block(3, 2)  # drafting by choice: the interval starts over
    assert ctl.edge.zero.interval(PROBE_EVERY) == PROBE_EVERY and not ctl.probes
    ctl.edge.observe_block_steps(9, 3)  # a cross-vocabulary draft: its guess is dearer, the first interval longer
    seen = []
    for _ in range(EXPLORE_AFTER + 1):
        seen.append(ctl.probes)
        ctl.observe_block(0, 0)
    assert seen == [False] * EXPLORE_AFTER + [True]
