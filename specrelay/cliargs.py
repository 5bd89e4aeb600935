"""The command line's plumbing: every flag also reads a SPECRELAY_* environment variable (one mechanism),
usage errors are one line (exit 2), and --help shows each flag's default and variable.

Precedence: a flag on the command line > SPECRELAY_<COMMAND>_<FLAG> > SPECRELAY_<FLAG> > the default.
<FLAG> is the long option upper-cased with - as _ (--max-batch -> MAX_BATCH); <COMMAND> the subcommand
(cloud-worker -> CLOUD_WORKER), so one environment file can serve several commands
(SPECRELAY_CLOUD_WORKER_BROKER=tcp://b:5556, SPECRELAY_EDGE_WORKER_BROKER=tcp://b:5555). A flag added to the
parser gets its variables without any further code. An environment value goes through the flag's own type and
choices; a bad one is a usage error that names the variable. Booleans take 1/true/yes/on and 0/false/no/off.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping

PREFIX = "SPECRELAY_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()  # an option's parse-time default: "not on the command line"


class UsageError(Exception):
    """A mistake in the command line or a file it names: one line on stderr, exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (argparse prints the whole usage block first) and exit code 2, no
    prefix matching (`--draft` is not silently `--draft-model`: a flag added later would change its meaning) and
    a close match suggested for an unknown flag (`--max-tokens`: did you mean --max-new-tokens?)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # said by the chosen command's parser (its flags, its --help)
            *_, chosen = _chosen(self, namespace)
            chosen.error(unrecognized(chosen, extras))
        return namespace

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=110)


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" line, with the flags of `parser` an unknown one is a prefix of, else
    its closest one."""
    import difflib

    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for word in (w.split("=", 1)[0] for w in extras if w.startswith("--")):
        close = [f for f in flags if f.startswith(word)] or difflib.get_close_matches(word, flags, n=1, cutoff=0.75)
        hints += [f"{word}: did you mean {' or '.join(close)}?"] if close else []
    return "unrecognized arguments: " + " ".join(extras) + (f" ({'; '.join(hints)})" if hints else "")


# ------------------------------------------------------------------------------------------ building

def finish(parser: argparse.ArgumentParser, aliases: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Call once every flag is added: each option's default moves aside (so `parse` can tell a flag given on the
    command line from one left out) and its help gains `[default: X] [env: SPECRELAY_...]`. `aliases` maps a
    flag's dest to one more variable name, read last (e.g. models_dir -> SPECRELAY_MODELS)."""
    for command, p in _parsers(parser):
        for action in p._actions:
            if not _is_option(action) or hasattr(action, "fallback"):
                continue
            action.fallback, action.default = action.default, UNSET
            alias = [aliases[action.dest]] if aliases and action.dest in aliases else []
            action.env = env_names(command, action.dest) + alias
            shown = "" if action.fallback is None or action.nargs == 0 else f" [default: {action.fallback}]"
            suffix = f"{shown} [env: {(alias or action.env[1:])[0]}]".replace("%", "%%")
            action.help = (action.help or "") + suffix
        for group in p._mutually_exclusive_groups:
            group.env_required, group.required = group.required, False
    return parser


def env_names(command: str, dest: str) -> list[str]:
    """[SPECRELAY_<COMMAND>_<FLAG>, SPECRELAY_<FLAG>] for a subcommand's flag; two equal names at top level."""
    flag = PREFIX + dest.upper()
    scoped = PREFIX + f"{command}_{dest}".upper().replace("-", "_").replace(" ", "_") if command else flag
    return [scoped, flag]


def _is_option(action: argparse.Action) -> bool:
    return bool(action.option_strings) and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))


def _parsers(parser: argparse.ArgumentParser, command: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield command, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{command} {name}".strip())


# ------------------------------------------------------------------------------------------ parsing

def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None,
          environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """parse_args, then every flag left off the command line from the environment, else its default."""
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    for p in _chosen(parser, args):
        given = {a.dest for a in p._actions if _is_option(a) and getattr(args, a.dest, UNSET) is not UNSET}
        for group in p._mutually_exclusive_groups:
            _resolve_group(p, group, args, environ, given)
        for action in p._actions:
            if _is_option(action) and getattr(args, action.dest, UNSET) is UNSET:
                setattr(args, action.dest, _from_env(p, action, environ))
    return args


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[argparse.ArgumentParser]:
    """The top-level parser and the subcommand parser(s) this command line selected."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                yield from _chosen(action.choices[name], args)


def _resolve_group(p, group, args, environ: Mapping[str, str], given: set[str]) -> None:
    """Exclusive flags: one given on the command line silences the others' variables; at most one variable may
    be set; a required group needs one of its flags from either place."""
    members = [a for a in group._group_actions if _is_option(a)]
    if not any(a.dest in given for a in members):
        from_env = [a for a in members if _env_value(a, environ) is not None]
        if len(from_env) > 1:
            p.error("only one of " + ", ".join(_env_value(a, environ)[0] for a in from_env) + " may be set")
        for a in members:
            if a not in from_env:
                setattr(args, a.dest, a.fallback)
        for a in from_env:
            setattr(args, a.dest, _from_env(p, a, environ))
        if group.env_required and not from_env:
            p.error("one of " + " ".join(a.option_strings[0] for a in members) + " is required (or its "
                    + " / ".join(a.env[1] for a in members) + ")")
    else:
        for a in members:
            if a.dest not in given:
                setattr(args, a.dest, a.fallback)


def _env_value(action: argparse.Action, environ: Mapping[str, str]) -> tuple[str, str] | None:
    for name in action.env:
        if name in environ:
            return name, environ[name]
    return None


def _from_env(p: argparse.ArgumentParser, action: argparse.Action, environ: Mapping[str, str]):
    """The flag's value from its first variable that is set (through its type and choices), else its default."""
    found = _env_value(action, environ)
    if found is None:  # argparse's rule: a string default goes through the flag's type
        return action.type(action.fallback) if isinstance(action.fallback, str) and action.type else action.fallback
    name, raw = found
    if action.nargs == 0:  # store_true / store_false / store_const
        if raw.strip().lower() not in TRUE + FALSE:
            p.error(f"{name}={raw!r}: expected one of 1, true, yes, on, 0, false, no, off")
        return action.const if raw.strip().lower() in TRUE else action.fallback
    try:
        value = action.type(raw) if action.type else raw
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        p.error(f"{name}={raw!r}: {exc}")
    if action.choices is not None and value not in action.choices:
        p.error(f"{name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    if isinstance(action, Extend) and action.refusal(value):
        p.error(f"{name}={raw!r}: {action.refusal(value)}")
    return value


# ------------------------------------------------------------------------------------------ value types

def _number(kind, low=None, high=None, *, low_open: bool = False, name: str = ""):
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name or 'a number'} expected, got {text!r}") from None
        if value != value or (low is not None and (value <= low if low_open else value < low)) or \
                (high is not None and value > high):
            bounds = f"{'>' if low_open else '>='} {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    convert.__name__ = kind.__name__
    return convert


positive_int = _number(int, 1, name="an integer")
count = _number(int, 0, name="an integer")
port = _number(int, 0, 65535, name="a port number")
seconds = _number(float, 0, low_open=True, name="seconds")
nonneg_float = _number(float, 0, name="a number")


def probability(text: str) -> float:
    value = _number(float, 0, 1, name="a number")(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be in (0, 1], got 0")
    return value


def draft_len(text: str) -> str:
    """'auto' or an integer in [0, 64] (kept as text: 'auto' travels as is)."""
    if text == "auto":
        return text
    _number(int, 0, 64, name="an integer or 'auto'")(text)
    return str(int(text))


def host_port(text: str) -> tuple[str, int]:
    """HOST:PORT (or :PORT, or [v6]:PORT) -> (host, port)."""
    host, sep, number = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", port(number)


def endpoint_list(text: str) -> tuple[str, ...]:
    """One --broker value: an endpoint or a comma list of them (common/brokers.py's rules)."""
    from .common.brokers import broker_list

    try:
        return broker_list(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None


def path_list(text: str) -> tuple[str, ...]:
    """One value of a repeatable file flag: a path or a comma list of them."""
    paths = tuple(part.strip() for part in text.split(","))
    if not all(paths):
        raise argparse.ArgumentTypeError(f"an empty path in {text!r}")
    return paths


class Extend(argparse.Action):
    """A repeatable flag whose values are comma lists (its type returns a tuple): every occurrence adds to one
    tuple; a value given twice, or more than `limit` values, is a usage error. From its environment variable it
    gets one comma list."""

    def __init__(self, *args, limit: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limit = limit

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        joined = (current if isinstance(current, tuple) else ()) + tuple(values)
        problem = self.refusal(joined)
        if problem:
            parser.error(f"{option_string}: {problem}")
        setattr(namespace, self.dest, joined)

    def refusal(self, values: tuple) -> str | None:
        repeated = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if repeated is not None:
            return f"{repeated} is given twice"
        if self.limit is not None and len(values) > self.limit:
            return f"{len(values)} values; at most {self.limit}"
        return None


class Append(argparse.Action):
    """A repeatable flag collecting a list (argparse's "append" cannot start from `finish`'s UNSET default);
    from its environment variable it gets one value."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, (list(current) if isinstance(current, list) else []) + [values])
