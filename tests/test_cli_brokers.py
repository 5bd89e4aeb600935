"""Several brokers on the command line: --broker repeated, as a comma list and from SPECRELAY_BROKER, on every
command that connects to a broker; one-line usage errors for a bad list; --broker-key one for all or one per
broker (a mismatch refused in one line); the help says what several mean."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrelay import cliargs
from specrelay.cli import describe, parser
from specrelay.cliargs import UsageError
from specrelay.common import auth
from specrelay.common.brokers import MAX_BROKERS
from specrelay.preflight import client_curve
from test_cli import parse, usage_error

COMMANDS = (["cloud-worker"], ["edge-worker"], ["generate", "--prompt", "x"])
A, B, C = "tcp://a:5555", "tcp://b:5555", "tcp://c:5555"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_broker_repeated_comma_list_and_environment(command):
    assert parse([*command, "--broker", A]).broker == (A,)
    assert parse([*command, "--broker", A, "--broker", B]).broker == (A, B)
    assert parse([*command, "--broker", f"{A}, {B}", "--broker", C]).broker == (A, B, C)
    assert parse(command, {"SPECRELAY_BROKER": f"{A},{B}"}).broker == (A, B)
    assert parse([*command, "--broker", C], {"SPECRELAY_BROKER": f"{A},{B}"}).broker == (C,)  # the flag wins
    assert len(parse(command).broker) == 1  # the default: one local broker


@pytest.mark.parametrize("argv, env, words", [
    (["--broker", f"{A},{A}"], {}, "given twice"),
    (["--broker", A, "--broker", A], {}, "given twice"),
    (["--broker", f"{A},"], {}, "empty endpoint"),
    (["--broker", "a:5555"], {}, "is not an endpoint"),
    ([], {"SPECRELAY_BROKER": f"{A},,{B}"}, "SPECRELAY_BROKER"),
    ([], {"SPECRELAY_BROKER": f"{A},{A}"}, "given twice"),
    ([*(x for i in range(MAX_BROKERS + 1) for x in ("--broker", f"tcp://h{i}:1"))], {}, f"at most {MAX_BROKERS}"),
])
def test_a_bad_broker_list_is_one_line(argv, env, words):
    for command in COMMANDS:
        assert words in usage_error([*command, *argv], env)


def test_help_says_what_several_brokers_mean():
    helps = {}
    for command, p in cliargs._parsers(parser()):
        for action in p._actions:
            if action.dest == "broker":
                helps[command] = " ".join(action.help.split())
    assert "registers with every one and serves them all from one KV store" in helps["cloud-worker"]
    for command in ("edge-worker", "generate"):
        assert "each session goes to one of them" in helps[command]
        assert "re-open on another" in helps[command]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("keys")
    for name in ("edge", "broker-0", "broker-1", "broker-2"):
        auth.generate(root, name)
    return root


def curves(keys: Path, brokers: list[str], broker_keys: list[str]):
    argv = ["edge-worker", "--curve-secret", str(keys / "edge.key_secret")]
    argv += [x for b in brokers for x in ("--broker", b)] + [x for k in broker_keys for x in ("--broker-key", k)]
    return client_curve(parse(argv))


def test_broker_keys_one_for_all_or_one_per_broker(keys):
    server = {n: auth.client(keys / "edge.key_secret", keys / f"{n}.key").server_key for n in ("broker-0", "broker-1")}
    one = curves(keys, [A, B], [str(keys / "broker-0.key")])
    assert [c.server_key for c in one] == [server["broker-0"]] * 2
    each = curves(keys, [A, B], [f"{keys / 'broker-0.key'},{keys / 'broker-1.key'}"])
    assert [c.server_key for c in each] == [server["broker-0"], server["broker-1"]]
    assert len({c.public for c in each}) == 1  # one key pair of this edge for every broker


def test_a_broker_key_count_that_matches_neither_is_refused_in_one_line(keys):
    with pytest.raises(UsageError) as info:
        curves(keys, [A, B, C], [str(keys / "broker-0.key"), str(keys / "broker-1.key")])
    code, line = describe(info.value)
    assert code == 2 and "\n" not in line
    assert "2 given for 3 brokers" in line and "one per --broker" in line
