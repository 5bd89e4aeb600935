"""`specrelay serve`: one box, one process. A broker, a cloud worker (target model) and an edge worker (draft
model) on in-process ZeroMQ sockets, behind the OpenAI-compatible HTTP API: the quickest way to try a pair, and
the same code path as the distributed deployment (only the endpoints are inproc://). Its health port (/healthz,
/readyz, /metrics) is on by default, beside the HTTP API's."""

from __future__ import annotations

import asyncio
import os

import zmq.asyncio


async def serve(args, http_limits=None) -> None:
    from .broker.server import Broker
    from .cloud_worker.server import CloudWorker, WorkerConfig
    from .common import transport
    from .common.runner import ModelRunner
    from .edge_worker.config import EdgeConfig
    from .edge_worker.http.server import HttpFrontend, HttpStats
    from .edge_worker.server import EdgeHealth, load_edge

    ctx = zmq.asyncio.Context.instance()
    frontend, backend = (f"inproc://specrelay-{name}-{os.getpid()}" for name in ("frontend", "backend"))
    runner = await asyncio.to_thread(ModelRunner.load, args.model, args.device, args.dtype)
    worker = CloudWorker(backend, runner, WorkerConfig(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms),
                         context=ctx)
    edge = await load_edge(frontend, args.draft_model, args.target_tokenizer, device=args.device, dtype=args.dtype,
                           config=EdgeConfig(max_context=args.max_model_len or runner.max_context,
                                             default_objective=args.objective, default_trees=args.trees),
                           context=ctx)
    stats = HttpStats()
    # the health port before the API's: a probe or a test that sees the API up finds /readyz up too
    await transport.serve_all(Broker(frontend, backend, context=ctx), worker, edge,
                              EdgeHealth(edge, stats, args.health_host, health_port(args)),
                              HttpFrontend(edge, *args.http, args.served_model_name, stats, http_limits))


def health_port(args) -> int:
    """--health-port, else the port after --http's (8001 beside the default 127.0.0.1:8000; any free port when
    --http's is 0 or the last one)."""
    if args.health_port is not None:
        return args.health_port
    http_port = args.http[1]
    return http_port + 1 if 0 < http_port < 65535 else 0
