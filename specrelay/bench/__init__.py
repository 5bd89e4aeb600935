"""Benchmarks: programs that print the numbers the issues ask for and write them as JSON, markdown and plots.

    specrelay bench sweep  [--link 50ms,20mbit] [--sessions 16] --draft-lens 0,2,4,8,auto [--json]
    specrelay bench stress --edges 4 --sessions-per-edge 16 --cloud-workers 2 --duration 600 [--link 50ms]
    specrelay bench calls | concurrency | hf | xvocab | wire | srdv_k | all     (the first benchmarks)
    specrelay bench report                                         (bench_results/benchmarks.md)
    specrelay bench schema                                                     (the JSON schema)
    specrelay bench kv | fuzz | xvdraft | draft | archs | broker | httpfuzz | worker-abuse   (modules of their own)

`python -m specrelay.bench ...` is the same program. Results go to ./bench_results (`--out DIR`).
"""

from .cli import main
from .runs import run_edge, totals

__all__ = ["main", "run_edge", "totals"]
