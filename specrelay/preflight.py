"""The cheap checks a command runs before anything loads (torch, a model, a socket): the model directories and
the device, ports already taken, CURVE key files. Each mistake is one line (cliargs.UsageError or ConfigError)."""

from __future__ import annotations

import socket

from .cliargs import UsageError


def client_curve(args):
    """--curve-secret / --broker-key -> the client side of CURVE for each --broker, in its order (a tuple of
    transport.Curve), or None (both flags or neither). --broker-key names one key for all brokers or one per
    broker; any other count is refused in one line."""
    if (args.curve_secret is None) != (args.broker_key is None):
        raise UsageError("--curve-secret and --broker-key go together")
    if args.curve_secret is None:
        return None
    from .common import auth
    from .common.brokers import per_broker
    from .common.errors import FatalError

    try:
        keys = per_broker(tuple(args.broker_key), len(args.broker))
        loaded = {key: auth.client(args.curve_secret, key) for key in dict.fromkeys(keys)}
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except FatalError as exc:  # a key file that is not there or not a key: the flag is wrong
        raise UsageError(f"--curve-secret / --broker-key: {exc}") from None
    return tuple(loaded[key] for key in keys)


def check_edge_models(args) -> None:
    """The cheap checks before torch loads: the draft directory, the target tokenizer, the device."""
    from .common.modelsource import check_device, check_model

    check_model(args.draft_model, "--draft-model")
    if args.target_tokenizer:
        check_model(args.target_tokenizer, "--target-tokenizer", weights=False)
    check_device(args.device)


# the flags a command listens on: ZeroMQ endpoints (tcp:// or ipc://) and HTTP ports (host, port)
ZMQ_LISTEN = ("frontend", "backend", "listen")


def check_ports(args) -> None:
    """An endpoint or port this command would listen on that is taken fails now, in one line naming the flag that
    moves it, not after the models have loaded (nor after a stats line at shutdown)."""
    from .common.errors import ConfigError
    from .common.ipc import refuse_held

    wanted = [("--http", *args.http)] if getattr(args, "http", None) else []
    wanted += [("--health-port", args.health_host, args.health_port)] if getattr(args, "health_port", None) else []
    for dest in ZMQ_LISTEN:
        endpoint, flag = getattr(args, dest, None), "--" + dest
        if not isinstance(endpoint, str):
            continue
        refuse_held(endpoint, flag)
        host, sep, number = endpoint.removeprefix("tcp://").rpartition(":")
        if endpoint.startswith("tcp://") and sep and number.isdigit() and int(number):
            wanted.append((flag, "0.0.0.0" if host == "*" else host.strip("[]"), int(number)))
    for flag, host, number in wanted:
        try:
            family = socket.getaddrinfo(host, number, type=socket.SOCK_STREAM)[0][0]
        except OSError:
            continue  # a name that does not resolve: the bind itself will say so
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, number))
            except OSError as exc:
                raise ConfigError(f"{flag}: cannot listen on {host}:{number}: {exc.strerror or exc} (another "
                                  f"process holds it: stop it, or pass {flag} with another port)") from None
