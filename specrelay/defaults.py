"""The defaults every entry point shares (CLI, Client, README, deploy files): one place, no torch import."""

EDGE_ENDPOINT = "ipc:///tmp/specrelay-edge.sock"  # edge-worker --listen and Client(); deploy files override it
BROKER_FRONTEND = "tcp://127.0.0.1:5555"          # edges connect here
BROKER_BACKEND = "tcp://127.0.0.1:5556"           # cloud workers connect here
HTTP = "127.0.0.1:8000"                            # the OpenAI-compatible API of `specrelay serve`
CONNECT_TIMEOUT_S = 60.0                           # how long a command waits for the broker and a live worker
#   (long enough for a worker to load the demo target on a busy 2-core machine; a wait is announced after 2 s)
from .edge_worker.config import SERVED_MODEL_NAME  # noqa: E402,F401  the `model` the HTTP API answers to (the edge's)
