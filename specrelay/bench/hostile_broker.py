"""`specrelay bench hostile-broker`: a hostile broker in a cloud worker's `--broker` list beside an honest one
(real processes: `specrelay broker`, `specrelay cloud-worker --broker HONEST,HOSTILE`; the hostile one is a
ROUTER in this process). For `--flood-s` seconds it floods the worker with 1-token OPENs under fresh client ids
(a VERIFY for each, so they queue), while 8 greedy generations run through the honest broker. Measured: the
honest outputs against the target alone, the worker's RSS growth, its queue and sessions per broker (/readyz,
/metrics), the requests it refused past the hostile broker's share. Prints and writes JSON (OUT/hostile_broker.json).

    python -m specrelay.bench.hostile_broker [--flood-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

from .fuzz import legit
from .runs import load_prompts, model_flags, write_result


MAX_RSS_GROWTH_MIB = 32  # the bar: the hostile broker's queue share (2 x 512 small requests) is far less


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def flood(endpoint: str, seconds: float) -> dict:
    """Bind a ROUTER at `endpoint`, wait for a worker, then heartbeat it and flood OPEN + VERIFY under fresh ids."""
    import zmq
    import zmq.asyncio

    from ..common import protocol as P

    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(endpoint)
    worker, *_ = await sock.recv_multipart()
    beat, sent, answers = P.encode(P.Heartbeat()), 0, 0
    t0 = last_beat = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if time.monotonic() - last_beat > 0.3:
            await sock.send_multipart([worker, b"", *beat])
            last_beat = time.monotonic()
        for _ in range(200):
            client = sent.to_bytes(8, "big")
            await sock.send_multipart([worker, client, *P.encode(P.Open(1, [5]))])
            await sock.send_multipart([worker, client, *P.encode(P.Verify(1, 1, 1, draft=[5]))])
            sent += 1
        while await sock.poll(0):
            await sock.recv_multipart()
            answers += 1
        await asyncio.sleep(0)
    sock.close()
    return {"clients_opened": sent, "answers": answers}


def run(args) -> dict:
    from ..cluster import LocalCluster, free_port
    from ..common.runner import ModelRunner
    from ..speculative import target_generate

    prompts = load_prompts(args.prompts, 8)
    target = ModelRunner.load(args.target)
    refs = [target_generate(target, target.tokenizer(p).input_ids, args.max_new_tokens) for p in prompts]
    hostile = f"tcp://127.0.0.1:{free_port()}"
    with LocalCluster(args.target, workers=0, threads=1) as cluster:
        port = free_port()
        worker = cluster._spawn("cloud-worker", "--broker", f"{cluster.backend},{hostile}", "--model", args.target,
                                "--health-port", str(port))
        cluster._wait_healthy(port, worker, "cloud worker")
        rss0 = _rss_kib(worker.pid)

        async def both():
            attack = asyncio.create_task(flood(hostile, args.flood_s))
            await asyncio.sleep(2.0)
            t0 = time.monotonic()
            outs, _ = await legit(cluster.frontend, args.draft, prompts, args.max_new_tokens)
            return outs, time.monotonic() - t0, await attack

        outs, legit_s, attacker = asyncio.run(both())
        rss1 = _rss_kib(worker.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            metrics = {line.split()[0]: float(line.split()[-1]) for line in r.read().decode().splitlines()
                       if line.startswith("specrelay_cloud_") and " " in line and "{" not in line}
        alive = worker.poll() is None
    return {"flood_s": args.flood_s, "attacker": attacker,
            "honest_outputs_exact": sum(o == r for o, r in zip(outs, refs)), "honest_generations": len(refs),
            "honest_wall_s": round(legit_s, 2), "worker_rss_growth_mib": round((rss1 - rss0) / 1024, 1),
            "worker_queue_refusals": metrics.get("specrelay_cloud_queue_refusals_total"),
            "worker_budget_refusals": metrics.get("specrelay_cloud_budget_refusals_total"),
            "worker_evictions": metrics.get("specrelay_cloud_evictions_total"),
            "worker_alive": alive, "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench hostile-broker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags(ap, max_new_tokens=32)
    ap.add_argument("--flood-s", type=float, default=30.0)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    result = run(args)
    write_result(args.out, "hostile_broker", result)
    print(json.dumps(result, indent=1))
    ok = (result["honest_outputs_exact"] == result["honest_generations"] and result["worker_alive"]
          and result["worker_evictions"] == 0 and result["worker_rss_growth_mib"] < MAX_RSS_GROWTH_MIB)
    print("bars met" if ok else "bars NOT met", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
