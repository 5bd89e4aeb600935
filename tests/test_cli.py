"""The command line: SPECRELAY_* variables for every flag (flag > env > default), --help and --version, and every
user mistake through the real CLI ending in <= 10 s with one line and no traceback (scripts/cli_errors.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from specrelay import cliargs
from specrelay.cli import describe, parser
from specrelay.common.errors import SettingError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import cli_errors  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def parse(argv: list[str], env: dict | None = None) -> argparse.Namespace:
    return cliargs.parse(parser(), argv, env or {})


def usage_error(argv: list[str], env: dict | None = None) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        parse(argv, env)
    assert info.value.code == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ------------------------------------------------------------------------------------------ environment

def test_precedence_flag_then_command_variable_then_variable_then_default():
    base = ["cloud-worker"]
    assert parse(base).max_batch == 32
    assert parse(base, {"SPECRELAY_MAX_BATCH": "8"}).max_batch == 8
    env = {"SPECRELAY_MAX_BATCH": "8", "SPECRELAY_CLOUD_WORKER_MAX_BATCH": "4"}
    assert parse(base, env).max_batch == 4
    assert parse([*base, "--max-batch", "2"], env).max_batch == 2
    # the command-scoped variable is for that command only
    assert parse(["serve"], {"SPECRELAY_CLOUD_WORKER_MAX_BATCH": "4"}).max_batch == 32


def test_one_environment_file_serves_every_command():
    env = {"SPECRELAY_CLOUD_WORKER_BROKER": "tcp://b:5556", "SPECRELAY_EDGE_WORKER_BROKER": "tcp://b:5555",
           "SPECRELAY_BROKER_FRONTEND": "tcp://0.0.0.0:5555", "SPECRELAY_LOG_LEVEL": "warning"}
    assert parse(["cloud-worker"], env).broker == ("tcp://b:5556",)
    assert parse(["edge-worker"], env).broker == ("tcp://b:5555",)
    assert parse(["broker"], env).frontend == "tcp://0.0.0.0:5555"
    assert parse(["broker"], env).log_level == "warning"


def test_every_flag_of_every_command_has_its_variables():
    """Including flags added later: the mechanism is generic. Also no command-scoped name is another flag's
    generic name (SPECRELAY_BROKER_FRONTEND must not mean two things)."""
    generic, scoped = set(), set()
    for command, p in cliargs._parsers(parser()):
        for action in p._actions:
            if cliargs._is_option(action):
                assert action.env[:2] == cliargs.env_names(command, action.dest), (command, action.dest)
                assert f"[env: {action.env[-1] if action.dest == 'models_dir' else action.env[1]}]" in action.help
                generic.add(action.env[1])
                if command:
                    scoped.add(action.env[0])
    assert not generic & scoped, generic & scoped
    extra = cliargs.finish(cliargs.Parser(prog="x"))
    extra.add_argument("--brand-new-flag", type=int, default=1)
    cliargs.finish(extra)
    assert cliargs.parse(extra, [], {"SPECRELAY_BRAND_NEW_FLAG": "5"}).brand_new_flag == 5


def test_environment_values_go_through_types_and_choices():
    assert parse(["edge-worker"], {"SPECRELAY_HTTP": "0.0.0.0:8000"}).http == ("0.0.0.0", 8000)
    assert parse(["serve"]).http == ("127.0.0.1", 8000)  # a string default goes through the type as well
    assert parse(["generate", "--prompt", "x"], {"SPECRELAY_JSON": "yes"}).json is True
    assert parse(["generate", "--prompt", "x"], {"SPECRELAY_JSON": "0"}).json is False
    assert "SPECRELAY_DTYPE" in usage_error(["cloud-worker"], {"SPECRELAY_DTYPE": "int4"})
    assert "SPECRELAY_JSON" in usage_error(["generate", "--prompt", "x"], {"SPECRELAY_JSON": "maybe"})
    assert "SPECRELAY_MAX_BATCH" in usage_error(["cloud-worker"], {"SPECRELAY_MAX_BATCH": "0"})


def test_serve_has_a_health_port_by_default_the_others_only_when_asked():
    from specrelay.onebox import health_port

    assert health_port(parse(["serve"])) == 8001  # beside the default --http 127.0.0.1:8000
    assert health_port(parse(["serve", "--http", "127.0.0.1:9000"])) == 9001
    assert health_port(parse(["serve", "--http", "127.0.0.1:0"])) == 0  # any free port, as the API's
    assert health_port(parse(["serve", "--health-port", "7000"])) == 7000
    for command in (["broker"], ["cloud-worker"], ["edge-worker"]):
        assert parse(command).health_port is None


def test_exclusive_flags_from_the_environment():
    assert parse(["generate"], {"SPECRELAY_PROMPT": "hi"}).prompt == "hi"
    args = parse(["generate", "--prompts", "f.jsonl"], {"SPECRELAY_PROMPT": "hi"})  # the flag wins
    assert args.prompts == "f.jsonl" and args.prompt is None
    assert "only one of" in usage_error(["generate"], {"SPECRELAY_PROMPT": "a", "SPECRELAY_PROMPTS": "b"})
    assert "--prompt" in usage_error(["generate"])


def test_models_dir_also_reads_specrelay_models():
    assert parse(["demo"], {"SPECRELAY_MODELS": "/m"}).models_dir == "/m"
    assert parse(["demo", "--models-dir", "/x"], {"SPECRELAY_MODELS": "/m"}).models_dir == "/x"


# ------------------------------------------------------------------------------------------ help, version

def test_help_shows_defaults_and_variables():
    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "cloud-worker", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "[default: 32] [env: SPECRELAY_MAX_BATCH]" in text
    assert "[default: tcp://127.0.0.1:5556]" in text


def test_no_prefix_matching_in_any_command():
    """`--draft` must not silently mean `--draft-model` (argparse's allow_abbrev): a flag added later would change
    what an old command line means."""
    for command, p in cliargs._parsers(parser()):
        assert p.allow_abbrev is False, command
    assert "did you mean --draft-model or --draft-len?" in usage_error(["generate", "--prompt", "x", "--draft", "d"])


def test_version():
    import specrelay

    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"specrelay {specrelay.__version__}"


def test_one_default_edge_endpoint_everywhere():
    import inspect

    from specrelay import defaults
    from specrelay.client import Client

    assert inspect.signature(Client).parameters["endpoint"].default == defaults.EDGE_ENDPOINT
    assert parse(["edge-worker"]).listen == defaults.EDGE_ENDPOINT
    readme = (ROOT / "README.md").read_text()
    others = {e for e in ("ipc:///tmp/edge.sock", "ipc:///tmp/specrelay-edge\"") if e in readme}
    assert not others and defaults.EDGE_ENDPOINT in readme


def test_parser_and_broker_do_not_import_torch():
    code = ("import sys; from specrelay.cli import parser; parser(); from specrelay.broker.server import Broker; "
            "from specrelay.edge_worker.routing.probe import probe_broker; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------------ mistakes

@pytest.mark.parametrize("case", cli_errors.CASES, ids=lambda c: c.name)
def test_every_mistake_is_one_line_within_ten_seconds(case, tmp_path):
    out = cli_errors.run_case(case, tmp_path)
    assert out.code == case.code, out.lines
    assert len(out.lines) == 1, out.lines
    assert case.says in out.lines[0] and "Traceback" not in out.lines[0]
    assert out.seconds <= cli_errors.BAR_S, f"{out.seconds:.1f} s"


def test_debug_shows_the_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "--debug", "generate", "--prompt", "x",
                          "--draft-model", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60,
                         env=cli_errors.clean_env())
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr


def test_library_logs_never_reach_stdout():
    """structlog's own default prints to stdout; importing specrelay routes it through logging (stderr)."""
    code = ("import structlog, specrelay; structlog.get_logger('specrelay.edge').warning('hello', x=1); "
            "print('result')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == "result\n" and "hello" in out.stderr


def test_every_argument_parser_in_the_project_refuses_prefixes():
    """allow_abbrev everywhere, the benchmarks and scripts too: a prefix is an unknown flag, never another one."""
    import re

    sources = [p for d in ("specrelay", "common", "broker", "cloud_worker", "edge_worker", "scripts")
               for p in (ROOT / d).rglob("*.py")]
    loose = [f"{p.relative_to(ROOT)}:{n}" for p in sources for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bArgumentParser\(", line) and "allow_abbrev=False" not in line]
    assert not loose, loose
    from specrelay.bench.cli import parser as bench_parser

    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):  # --sess is not --sessions
        bench_parser().parse_args(["sweep", "--sess", "3"])


def test_a_setting_out_of_its_range_exits_2_in_one_line_not_as_an_internal_error():
    """A value the config dataclass refuses (before: "internal error: ValueError ... run with --debug")."""
    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "cloud-worker", "--model", "models/demo-target",
                          "--broker", "tcp://127.0.0.1:1", "--max-step-tokens", "100"], capture_output=True, text=True,
                         timeout=60)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, err
    assert "max_step_tokens must be >= 129" in err[0] and "internal error" not in err[0]
    code, line = describe(SettingError("request_timeout_s must be > 0"))
    assert code == 2 and line == "request_timeout_s must be > 0"
