"""structlog setup. Logs always go to stderr: stdout belongs to results (the CLI) or to the calling program.

`configure` is the CLI's: key-value lines on a terminal, JSON lines otherwise. `library_default` runs on
`import specrelay`: unless the application has configured structlog itself, specrelay's log calls go through
the standard `logging` module (so the application's logging config decides; with none, warnings and errors
reach stderr and nothing ever reaches stdout).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

LEVELS = ("debug", "info", "warning", "error")
# exceptions as structured JSON, without each frame's local variables (they can hold keys and whole prompts)
_DICT_TRACEBACKS = structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(
    show_locals=False))


def configure(level: str | None = None) -> None:
    """The CLI's logging: `level`, else SPECRELAY_LOG_LEVEL (or the older SPECRELAY_LOG), else info."""
    level = (level or os.environ.get("SPECRELAY_LOG_LEVEL") or os.environ.get("SPECRELAY_LOG") or "info").upper()
    # a JSON line carries the exception as a structured "exception" field (type, message, frames); the console
    # renderer prints the traceback itself
    renderer = ([structlog.dev.ConsoleRenderer(colors=False)] if sys.stderr.isatty()
                else [_DICT_TRACEBACKS, structlog.processors.JSONRenderer()])
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    quiet_libraries()


def library_default() -> None:
    """Route structlog through stdlib logging unless the application configured structlog already
    (structlog's own default prints to stdout, which belongs to the caller)."""
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, structlog.contextvars.merge_contextvars,
                    structlog.processors.add_log_level, structlog.processors.format_exc_info,
                    structlog.processors.KeyValueRenderer(
                        key_order=["event"], drop_missing=True)],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def quiet_libraries() -> None:
    """transformers' progress bars and notices are noise in a service log."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
