"""structlog set-up shared by every program: key-value lines (or JSON) to stderr.

A command line that answers and exits (the buyer reading its view) mostly logs nothing, and
structlog's import costs it ~40 ms (its dev renderer loads rich's tracebacks and pygments).
So the modules on that path log through :func:`get_logger`, which imports structlog at the
first line that gets through the level, and the buyer sets its level with
``configure(..., lazy=True)``: applied when structlog is first needed, not imported for it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

# configure(lazy=True)'s level and format while structlog is not imported yet
_pending: tuple[int, bool] | None = None


def _level(level: str) -> int:
    lvl = logging.getLevelNamesMapping().get(level.upper())
    if lvl is None:
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    return lvl


def configure(level: str = "info", json: bool = False, lazy: bool = False) -> None:
    """Log lines at ``level`` and above to stderr (``json``: one JSON object each).
    ``lazy``: not now if structlog is not imported yet, but when a :func:`get_logger`
    logger first logs at that level or above (what is below is dropped unseen)."""
    global _pending
    lvl = _level(level)
    if lazy and "structlog" not in sys.modules:
        _pending = (lvl, json)
        return
    _pending = None
    _apply(lvl, json)


def _apply(lvl: int, json: bool) -> None:
    import structlog

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


class Logger:
    """A module's structlog logger, structlog imported at its first line logged (see the
    module doc); ``bind`` as structlog's."""

    def __init__(self, name: str, bound: dict[str, Any] | None = None) -> None:
        self._name = name
        self._bound = bound or {}

    def bind(self, **values: Any) -> Logger:
        return Logger(self._name, self._bound | values)

    def _log(self, level: int, method: str, event: str, values: dict[str, Any]) -> None:
        global _pending
        if _pending is not None:
            lvl, json = _pending
            if level < lvl and "structlog" not in sys.modules:
                return  # below the level: structlog would drop it too
            _pending = None
            _apply(lvl, json)
        import structlog

        log = structlog.get_logger(self._name)
        getattr(log.bind(**self._bound) if self._bound else log, method)(event, **values)

    def debug(self, event: str, **values: Any) -> None:
        self._log(logging.DEBUG, "debug", event, values)

    def info(self, event: str, **values: Any) -> None:
        self._log(logging.INFO, "info", event, values)

    def warning(self, event: str, **values: Any) -> None:
        self._log(logging.WARNING, "warning", event, values)

    def error(self, event: str, **values: Any) -> None:
        self._log(logging.ERROR, "error", event, values)


def get_logger(name: str) -> Logger:
    """A logger for a module on a command line's path (see the module doc)."""
    return Logger(name)
