"""Every CLI mistake a user can make, through the real `specrelay` command: exit code, seconds, stderr lines.

    python scripts/cli_errors.py [--json FILE]

Each case must end in <= 10 s with exactly one line on stderr that names the problem, no traceback, exit 2 for
a usage error and 1 for something missing at run time. tests/test_cli.py runs the same cases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specrelay.cluster import free_port

ROOT = Path(__file__).resolve().parent.parent
DRAFT = ROOT / "models" / "demo-draft"
BAR_S = 10.0


@dataclass
class Case:
    name: str
    setup: Callable[[Path], contextlib.AbstractContextManager]  # tmp dir -> (argv, extra env, cwd)
    code: int
    says: str  # a piece of the one line


@dataclass
class Outcome:
    name: str
    code: int
    seconds: float
    lines: list[str]
    ok: bool


# generate waits up to --connect-timeout (60 s) for a broker or worker that is still starting and says so after
# 2 s; these cases check the one-line failure at the end of a short wait
FAIL_FAST = ("--connect-timeout", "1.5")


def gen(*args: str) -> list[str]:
    return ["generate", "--prompt", "def f():", *args]


@contextlib.contextmanager
def plain(argv: list[str], env: dict | None = None, cwd: Path | None = None) -> Iterator[tuple]:
    yield argv, env or {}, cwd


def bad_prompts(tmp: Path):
    path = tmp / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"text": "c"}\n')
    return plain(["generate", "--prompts", str(path)])


def no_tokenizer(tmp: Path):
    model = tmp / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(DRAFT / name, model / name)
    return plain(gen("--draft-model", str(model)))


def relative_typo(tmp: Path):
    (tmp / "models" / "demo-draft").mkdir(parents=True)
    return plain(gen("--draft-model", "models/demo-draf"), cwd=tmp)  # "models/x" also looks like a hub id


@contextlib.contextmanager
def broker_without_workers(tmp: Path) -> Iterator[tuple]:
    frontend = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "broker", "--frontend", frontend, "--backend",
                             f"tcp://127.0.0.1:{free_port()}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=clean_env())
    try:
        yield gen("--broker", frontend, *FAIL_FAST), {}, None
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def broker_keys_miscounted(tmp: Path):
    """Three brokers, two broker keys: neither one for all nor one each."""
    from specrelay.common import auth

    for name in ("edge", "broker-0", "broker-1"):
        auth.generate(tmp, name)
    brokers = [x for i in range(3) for x in ("--broker", f"tcp://127.0.0.1:{5555 + i}")]
    return plain(gen(*brokers, "--curve-secret", str(tmp / "edge.key_secret"), "--broker-key",
                     f"{tmp / 'broker-0.key'},{tmp / 'broker-1.key'}"))


@contextlib.contextmanager
def port_in_use(tmp: Path) -> Iterator[tuple]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield ["edge-worker", "--http", f"127.0.0.1:{taken.getsockname()[1]}"], {}, None


@contextlib.contextmanager
def broker_port_in_use(tmp: Path) -> Iterator[tuple]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield ["broker", "--frontend", f"tcp://127.0.0.1:{taken.getsockname()[1]}"], {}, None


CASES = [
    Case("bad flag value", lambda t: plain(gen("--draft-len", "abc")), 2, "--draft-len"),
    Case("bad flag value (range)", lambda t: plain(gen("--top-p", "1.5")), 2, "--top-p"),
    Case("bad environment value", lambda t: plain(gen(), {"SPECRELAY_MAX_NEW_TOKENS": "many"}), 2,
         "SPECRELAY_MAX_NEW_TOKENS"),
    Case("missing required flag", lambda t: plain(["generate"]), 2, "--prompt"),
    Case("unknown flag", lambda t: plain(gen("--temprature", "0.8")), 2, "--temprature"),
    Case("unknown flag, a close one", lambda t: plain(gen("--max-tokens", "5")), 2,
         "--max-tokens: did you mean --max-new-tokens?"),
    Case("a prefix of two flags (no prefix matching)", lambda t: plain(gen("--draft", str(DRAFT))), 2,
         "--draft: did you mean --draft-model or --draft-len?"),
    Case("conflicting flags", lambda t: plain(gen("--mode", "greedy", "--temperature", "0.8")), 2, "--mode greedy"),
    Case("half a key pair", lambda t: plain(gen("--curve-secret", str(t / "edge.key_secret"))), 2,
         "--curve-secret and --broker-key go together"),
    Case("key file missing", lambda t: plain(gen("--curve-secret", str(t / "edge.key_secret"), "--broker-key",
                                                 str(t / "broker.key"))), 2, "edge.key_secret"),
    Case("prompts file missing", lambda t: plain(["generate", "--prompts", str(t / "nope.jsonl")]), 2, "nope.jsonl"),
    Case("prompts file bad line", bad_prompts, 2, "prompts.jsonl:3:"),
    Case("model directory missing", lambda t: plain(gen("--draft-model", str(DRAFT) + "x")), 2, "does not exist"),
    Case("model directory typo (relative)", relative_typo, 2, "did you mean"),
    Case("no tokenizer files", no_tokenizer, 2, "no tokenizer files"),
    Case("not a model directory", lambda t: plain(gen("--draft-model", str(t))), 2, "no config.json"),
    Case("target tokenizer missing", lambda t: plain(gen("--target-tokenizer", str(t / "tok"))), 2,
         "--target-tokenizer"),
    Case("hub id, hub unreachable", lambda t: plain(gen("--draft-model", "specrelay-test/no-such-model"),
                                                    {"HF_ENDPOINT": "https://hub.invalid"}), 2, "cannot be reached"),
    Case("cloud worker model missing", lambda t: plain(["cloud-worker", "--model", str(t / "target")]), 2,
         "--model"),
    Case("--device cuda without CUDA", lambda t: plain(gen("--device", "cuda")), 2, "cuda"),
    Case("unknown device", lambda t: plain(gen("--device", "tpu")), 2, "--device"),
    Case("HTTP port in use", port_in_use, 2, "cannot listen"),
    Case("broker port in use", broker_port_in_use, 2, "pass --frontend with another port"),
    Case("broker unreachable", lambda t: plain(gen("--broker", f"tcp://127.0.0.1:{free_port()}", *FAIL_FAST)), 1,
         "cannot reach the broker at tcp://127.0.0.1:"),
    Case("broker host unknown", lambda t: plain(gen("--broker", "tcp://broker.invalid:5555")), 1, "does not resolve"),
    Case("no live cloud worker", broker_without_workers, 1, "no live cloud worker"),
    Case("a broker given twice", lambda t: plain(gen("--broker", "tcp://127.0.0.1:5555,tcp://127.0.0.1:5555")), 2,
         "given twice"),
    Case("broker keys for some brokers", broker_keys_miscounted, 2, "2 given for 3 brokers"),
    Case("no broker reachable (two)", lambda t: plain(gen("--broker", f"tcp://127.0.0.1:{free_port()}", "--broker",
                                                          f"tcp://127.0.0.1:{free_port()}", *FAIL_FAST)), 1,
         "none of the 2 brokers answered"),
]


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECRELAY_")}
    return env | (extra or {})


def run_case(case: Case, tmp: Path) -> Outcome:
    """The case through `python -m specrelay.cli` (the console script's code), timed from process start."""
    with case.setup(tmp) as (argv, env, cwd):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "specrelay.cli", *argv], capture_output=True, text=True,
                              env=clean_env(env), cwd=cwd or tmp, timeout=60)
        seconds = time.perf_counter() - t0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    ok = (proc.returncode == case.code and len(lines) == 1 and case.says in lines[0] and "Traceback" not in
          proc.stderr and seconds <= BAR_S and not proc.stdout)
    return Outcome(case.name, proc.returncode, seconds, lines, ok)


def main() -> int:
    import tempfile

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the outcomes here")
    args = ap.parse_args()
    outcomes = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out = run_case(case, Path(tmp))
        outcomes.append(out)
        print(f"{'ok ' if out.ok else 'BAD'} {out.seconds:5.2f} s  exit {out.code}  {case.name:32}  "
              f"{out.lines[0] if out.lines else '(no stderr)'}")
        for extra in out.lines[1:]:
            print(f"{'':52}{extra}")
    print(f"{sum(o.ok for o in outcomes)}/{len(outcomes)} cases: one line, no traceback, the right exit code, "
          f"<= {BAR_S:g} s (slowest {max(o.seconds for o in outcomes):.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
