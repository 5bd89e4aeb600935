"""The docs are read against the code, so a stale sentence fails here: every `specrelay ...` command of README.md,
ARCHITECTURE.md and the docs pages below is parsed and each of its flags must exist in the CLI's argparse parsers
(specrelay/cliflags.py, the benchmarks' specrelay/bench/cli.py); a default the text quotes ("`--flag` (default
N)") must equal the parser's; a port must be one the code or the deploy files use; a file path or link must exist;
a `make` target must be in the Makefile. A test edits a copy of the README (a stale flag, default and port) and
shows the checker finds each.

Pages written on other branches (PENDING_PAGES) and commands added there (PENDING_COMMANDS) are tolerated while
they are missing from this tree and checked like the rest once they exist."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from specrelay import cli, defaults
from specrelay.bench import cli as bench_cli

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["README.md", "ARCHITECTURE.md", *(f"docs/{name}.md" for name in (
    "architectures", "benchmarks", "broker-tier", "configuration", "design", "exactness", "http-api", "kv-store",
    "limits", "models", "modes", "protocol", "reliability", "security", "testing", "vocab"))]
PENDING_PAGES = {"docs/policy.md", "docs/real-models.md", "docs/fairness.md", "docs/gpu.md", "docs/single-host.md"}
PENDING_COMMANDS = {("bench", "first"), ("make", "real-models")}
NOT_IN_TREE = ("models/real/", "bench_results/", "path/to/", "/")  # made by a command, a placeholder, or absolute
PLACEHOLDER = re.compile(r"(^|/)[A-Z][A-Z_-]*(/|$)")  # models/NAME, DIR/NAME.key: a name the reader chooses
README_MAX_LINES = 250
HISTORY = re.compile(r"round [0-9]|issue [0-9]|main's code|engineer")
POLICY_NOTEBOOKS = {"docs/draftlen.md", "docs/trees.md"}  # replaced by docs/policy.md on its branch


# ------------------------------------------------------------------------------------------ the CLI's parsers

def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Every option string of a parser -> its default (`cliargs.finish` keeps it as `fallback`)."""
    return {flag: getattr(action, "fallback", action.default) for action in parser._actions
            for flag in action.option_strings}


MAIN = cli.parser()
COMMANDS = _subparsers(MAIN)
BENCH = _subparsers(bench_cli.parser())
GLOBAL = _options(MAIN)


def _all_options() -> dict[str, list[object]]:
    """Every flag of every command and benchmark -> the defaults it has (one per parser that has it)."""
    found: dict[str, list[object]] = {}
    parsers = [*COMMANDS.values(), *(p for name, p in BENCH.items() if name not in bench_cli.EXTERNAL)]
    parsers += [*_subparsers(COMMANDS["keys"]).values()]
    for parser in parsers:
        for flag, default in _options(parser).items():
            found.setdefault(flag, []).append(default)
    return found


OPTIONS = _all_options()


# ------------------------------------------------------------------------------------------ reading the text

def _code(text: str) -> list[str]:
    """Shell lines of the text: fenced code blocks (continuations joined) and inline `specrelay ...` spans."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):  # shell blocks, not python
        lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += re.findall(r"`((?:\.venv/bin/)?(?:specrelay|make) [^`]+)`", prose)
    return lines


def commands(text: str) -> list[list[str]]:
    """Each `specrelay ...` and `make ...` command as argv (from its name on; `[optional]` brackets dropped)."""
    found = []
    for line in _code(text):
        try:
            words = shlex.split(line.replace("[", " ").replace("]", " "), comments=True)
        except ValueError:  # an unbalanced quote in an example: read it unsplit
            words = line.split()
        for i, word in enumerate(words):
            if word in ("specrelay", ".venv/bin/specrelay", "make"):
                argv = []
                for arg in words[i + 1:]:
                    if arg in ("|", "||", "&&", ";", "&", ">", "2>&1"):
                        break
                    argv.append(arg)
                found.append(["make", *argv] if word == "make" else argv)
                break
    return found


def _flags(argv: list[str]) -> list[str]:
    return [part.split("=", 1)[0] for arg in argv if arg.startswith("--") for part in arg.split("/")
            if part.startswith("--")]


def check_command(argv: list[str], makefile: str) -> list[str]:
    """What is wrong with one command of a page (an empty list: nothing)."""
    if not argv or not re.fullmatch(r"[a-z][a-z-]*", argv[0]):
        return []  # `specrelay COMMAND --help`: a placeholder
    if argv[0] == "make":
        return [f"make {target}: no such Makefile target" for target in argv[1:2]
                if not re.search(rf"^{re.escape(target)}:", makefile, flags=re.M)
                and ("make", target) not in PENDING_COMMANDS]
    words = [a for a in argv if not a.startswith("-")]
    if argv[0] not in COMMANDS:
        return [f"specrelay {argv[0]}: no such command"]
    parser = COMMANDS[argv[0]]
    if argv[0] == "bench":
        name = words[1] if len(words) > 1 else ""
        if not re.fullmatch(r"[a-z][a-z_-]*", name):
            return []  # `specrelay bench NAME`: a placeholder
        if name not in BENCH:
            return [] if ("bench", name) in PENDING_COMMANDS else [f"specrelay bench {name}: no such benchmark"]
        if name in bench_cli.EXTERNAL:
            return []  # its module parses its own flags
        parser = BENCH[name]
    elif argv[0] == "keys":
        parser = _subparsers(parser).get(words[1] if len(words) > 1 else "", parser)
    known = _options(parser) | GLOBAL
    return [f"specrelay {' '.join(words[:2])}: no flag {flag}" for flag in _flags(argv) if flag not in known]


def _same(quoted: str, default: object) -> bool:
    value = quoted.strip("`").replace(",", "").replace("_", "")
    try:
        return default is not None and not isinstance(default, bool) and float(value) == float(default)
    except (TypeError, ValueError):
        return str(default).lower() == value.lower()


QUOTED_DEFAULT = re.compile(r"`(?:[^`]*?\s)?(--[a-z0-9-]+)(?:\s[^`]*)?`,?\s\(?default:?\s(`[^`]+`|[0-9][0-9,._]*[0-9]|[0-9]|\w+)")


def check_defaults(text: str) -> list[str]:
    """Every "`--flag ...` (default X)" of the text against the parsers that have the flag."""
    wrong = []
    for flag, quoted in QUOTED_DEFAULT.findall(text):
        if flag not in OPTIONS:
            wrong.append(f"{flag} (quoted with a default): no command has this flag")
        elif not any(_same(quoted, default) for default in OPTIONS[flag]):
            wrong.append(f"{flag}: the text says default {quoted}, the parsers say {OPTIONS[flag]}")
    return wrong


DEPLOY_PORT = re.compile(r"(?:port[\w\"']*[:=\s,]+\"?|:)(\d{4,5})\b", re.I)  # containerPort: N, *_PORT=N, host:N


def _known_ports(text: str) -> set[int]:
    """Ports of the code (specrelay/defaults.py, `serve`'s health port: --http's + 1), of the deploy files, and
    those the page itself passes to a flag in one of its commands."""
    sources = [(ROOT / "specrelay" / "defaults.py").read_text()]
    sources += [p.read_text() for sub in ("kubernetes", "systemd", "docker") for p in (ROOT / "deploy" / sub).rglob("*")
                if p.is_file()]
    ports = {int(n) for source in sources for n in DEPLOY_PORT.findall(source)}
    ports.add(int(defaults.HTTP.rsplit(":", 1)[1]) + 1)
    for argv in commands(text):
        ports |= {int(n) for arg in argv if not arg.startswith("--") for n in re.findall(r":(\d{4,5})\b", arg)}
        ports |= {int(b) for a, b in zip(argv, argv[1:]) if a.endswith("-port") and b.isdigit()}
    return ports


PORT = re.compile(r"(?::|\bports? |\bon )(\d{4,5})\b")  # how a page says a port: host:N, port N, listens on N


def check_ports(text: str) -> list[str]:
    known = _known_ports(text)
    return sorted({f"port {n}: neither the code nor the deploy files use it" for n in PORT.findall(text)
                   if int(n) not in known})


PATH = re.compile(r"`((?:\.?[\w-]+/)+[\w.-]*)`|`([\w-]+\.(?:md|py|toml|txt|jsonl|yaml|env))`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def check_paths(text: str, page: str) -> list[str]:
    """Backticked paths (from the repository root) and markdown links (from the page's folder) exist."""
    wanted = {(ROOT / m).resolve() for groups in PATH.findall(text) for m in groups if m and "/" in m
              and not m.startswith(NOT_IN_TREE) and not m.startswith(("tcp:", "ipc:", "http"))
              and not PLACEHOLDER.search(m)}
    wanted |= {(ROOT / page).parent.joinpath(link).resolve() for link in LINK.findall(text)
               if not link.startswith(("http://", "https://", "mailto:"))}
    for argv in commands(text):
        wanted |= {(ROOT / arg).resolve() for arg in argv if re.match(r"(models|deploy|docs|scripts|tests)/", arg)
                   and not arg.startswith(NOT_IN_TREE)}
    pending = {(ROOT / p).resolve() for p in PENDING_PAGES}
    return sorted(f"{p.relative_to(ROOT)}: no such file" for p in wanted if not p.exists() and p not in pending)


CONSTANT = re.compile(r"`([A-Z][A-Z0-9_]{2,})`? = `?([0-9][0-9._]*)")  # `SRDV_MAX_ROUNDS` = 6, `HEARTBEAT_LIVENESS = 3`


def _constants() -> dict[str, set[str]]:
    """Module-level `NAME = number` of the package's code -> the values it is given (a name may recur)."""
    found: dict[str, set[str]] = {}
    for folder in ("broker", "cloud_worker", "edge_worker", "common", "specrelay"):
        for path in (ROOT / folder).rglob("*.py"):
            for name, value in re.findall(r"^([A-Z][A-Z0-9_]+)(?:: [\w\[\], ]+)? = ([0-9][0-9._]*)\b", path.read_text(),
                                          flags=re.M):
                found.setdefault(name, set()).add(value)
    return found


def check_constants(text: str) -> list[str]:
    """A constant the text quotes with its value has that value in the code."""
    code = _constants()
    return [f"{name} = {value}: the code says {sorted(code.get(name, ())) or 'no such constant'}"
            for name, value in CONSTANT.findall(text) if not any(float(value) == float(v) for v in code.get(name, ()))]


def problems(text: str, page: str) -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    found = [problem for argv in commands(text) for problem in check_command(argv, makefile)]
    return found + check_defaults(text) + check_ports(text) + check_paths(text, page) + check_constants(text)


# ------------------------------------------------------------------------------------------ the tests

@pytest.mark.parametrize("page", CHECKED)
def test_the_page_agrees_with_the_code(page):
    wrong = problems((ROOT / page).read_text(), page)
    assert not wrong, f"{page}: {wrong}"


def test_the_checker_reads_commands_defaults_and_ports():
    text = (ROOT / "README.md").read_text()
    argvs = commands(text)
    assert ["broker"] in argvs and any(a[:2] == ["bench", "calls"] for a in argvs)
    assert ["make", "demo"] in argvs and ["make", "test"] in argvs
    assert any(a[0] == "generate" and "--max-new-tokens" in a for a in argvs)
    assert ("--max-concurrent-requests", "64") in QUOTED_DEFAULT.findall(text)
    assert "5555" in PORT.findall(text) and 5555 in _known_ports(text)


@pytest.mark.parametrize("edit, says", [
    (("--prompt $'def fibonacci(n):\\n' --max-new-tokens 64", "--prompt $'def fibonacci(n):\\n' --max-new-tokenz 64"),
     "no flag --max-new-tokenz"),
    (("`--max-concurrent-requests` (default 64)", "`--max-concurrent-requests` (default 32)"),
     "--max-concurrent-requests: the text says default 32"),
    (("frontend tcp://127.0.0.1:5555 (edges)", "frontend tcp://127.0.0.1:5565 (edges)"), "port 5565"),
    (("[docs/modes.md](docs/modes.md)", "[docs/modes.md](docs/mode.md)"), "docs/mode.md: no such file"),
    (("specrelay bench calls --xv", "specrelay bench callz --xv"), "specrelay bench callz: no such benchmark"),
])
def test_a_stale_readme_fails(edit, says):
    """A copy of the README with one stale flag, default, port, link or benchmark: the checker names it."""
    old, new = edit
    text = (ROOT / "README.md").read_text()
    assert old in text and not problems(text, "README.md")
    found = problems(text.replace(old, new, 1), "README.md")
    assert any(says in problem for problem in found), found


def test_a_stale_constant_fails():
    text = (ROOT / "docs" / "modes.md").read_text()
    assert "`SRDV_MAX_ROUNDS` = 6" in text and not check_constants(text)
    assert check_constants(text.replace("`SRDV_MAX_ROUNDS` = 6", "`SRDV_MAX_ROUNDS` = 4")) == \
        ["SRDV_MAX_ROUNDS = 4: the code says ['6']"]


def test_pending_pages_and_commands_are_checked_once_they_exist(tmp_path):
    text = "[policy](docs/policy.md) `specrelay bench first` and `make real-models`\n"
    missing = [p for p in ("docs/policy.md",) if not (ROOT / p).exists()]
    assert problems(text, "README.md") == []  # tolerated while missing, and checked like any page once present
    assert problems("[x](docs/not-a-page.md)\n", "README.md") == ["docs/not-a-page.md: no such file"]
    assert missing or not check_paths(text, "README.md")


def test_the_readme_is_short_and_states_the_present():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
    pages = ["README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
    history = [f"{page}:{n}: {line.strip()}" for page in pages if page not in POLICY_NOTEBOOKS
               for n, line in enumerate((ROOT / page).read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not history, f"history of the work in user docs: {history}"
