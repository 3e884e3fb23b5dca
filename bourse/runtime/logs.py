"""structlog set-up shared by every program: key-value lines (or JSON) to stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", json: bool = False) -> None:
    lvl = logging.getLevelNamesMapping().get(level.upper())
    if lvl is None:
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.processors.KeyValueRenderer(
            key_order=["timestamp", "level", "event"], drop_missing=True
        )
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # Resolve sys.stderr when a logger is made, not now: a swapped stream (a test
        # runner's capture) must not be kept after it is closed.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
