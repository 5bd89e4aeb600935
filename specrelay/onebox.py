"""`specrelay serve`: one box, one process. A broker, a cloud worker (target model) and an edge worker (draft
model) on in-process ZeroMQ sockets, behind the OpenAI-compatible HTTP API: the quickest way to try a pair, and
the same code path as the distributed deployment (only the endpoints are inproc://)."""

from __future__ import annotations

import asyncio
import os

import zmq.asyncio


async def serve(args, http_limits=None) -> None:
    from .broker.server import Broker
    from .cloud_worker.server import CloudWorker, WorkerConfig
    from .common.runner import ModelRunner
    from .edge_worker.http import HttpFrontend, HttpStats
    from .edge_worker.loading import EdgeHealth, load_edge
    from .edge_worker.server import EdgeConfig
    from .runtime import serve_all

    ctx = zmq.asyncio.Context.instance()
    frontend, backend = (f"inproc://specrelay-{name}-{os.getpid()}" for name in ("frontend", "backend"))
    runner = await asyncio.to_thread(ModelRunner.load, args.model, args.device, args.dtype)
    worker = CloudWorker(backend, runner, WorkerConfig(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms),
                         context=ctx)
    edge = await load_edge(frontend, args.draft_model, args.target_tokenizer, device=args.device, dtype=args.dtype,
                           config=EdgeConfig(max_context=args.max_model_len or runner.max_context), context=ctx)
    stats = HttpStats()
    services = [Broker(frontend, backend, context=ctx), worker, edge,
                HttpFrontend(edge, *args.http, args.served_model_name, stats, http_limits)]
    if args.health_port is not None:
        services.append(EdgeHealth(edge, stats, args.health_host, args.health_port))
    await serve_all(*services)
