"""A request's Host header -> the key of the app it asks for, pure.

The rule: ``<app>.<domain>`` is the app of no tenant, ``<app>.<tenant>.<domain>`` a
tenant's app (two tenants may both have ``web``). The key is the Host's labels before the
domain (``web``, ``web.acme``), as edge/routing.py's table names apps.
"""

from __future__ import annotations

import re

from bourse.errors import BourseError

# A label: an app or tenant name (bourse/wire/limits.py ID_PATTERN).
_LABEL = re.compile(r"[a-z0-9][a-z0-9-]{0,62}\Z")
_PORT = re.compile(r":[0-9]{1,5}\Z")
MAX_HOST = 255


class BadHost(BourseError, ValueError):
    """A Host header no request may carry (answered 400)."""


class NotRouted(BourseError, LookupError):
    """A Host that names no app under the edge's domain (answered 404 with the rule)."""


def rule(domain: str) -> str:
    """The domain rule, as a 404 says it."""
    return f"apps are reached at <app>.{domain} or <app>.<tenant>.{domain}"


def control_characters(value: bytes) -> bool:
    """Whether ``value`` holds a C0 control character or DEL."""
    return any(c < 0x20 or c == 0x7F for c in value)


def app_of(host: bytes, domain: str) -> str:
    """The app key ``host`` (a Host header's raw value) asks for under ``domain``.

    Raises BadHost (missing, too long, control characters) or NotRouted (not under the
    domain, or not one or two labels before it)."""
    if not host:
        raise BadHost("no Host header")
    if len(host) > MAX_HOST:
        raise BadHost("Host header too long")
    if control_characters(host):
        raise BadHost("Host header has control characters")
    try:
        name = host.decode("ascii").lower()
    except UnicodeDecodeError:
        raise BadHost("Host header is not ASCII") from None
    name = _PORT.sub("", name).rstrip(".")
    suffix = "." + domain
    if not name.endswith(suffix):
        raise NotRouted(f"host {name!r} is not under {domain!r}: {rule(domain)}")
    labels = name[: -len(suffix)].split(".")
    if len(labels) > 2 or not all(_LABEL.match(label) for label in labels):
        raise NotRouted(f"host {name!r} names no app: {rule(domain)}")
    return ".".join(labels)
