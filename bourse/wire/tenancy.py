"""Buyers as tenants (docs/security.md): a tenant's orders and machines are its own.

A tenant is a buyer user of its own (``bourse auth init --buyer NAME``); it may publish only
under ``<root>.tenant.<NAME>.``, so the exchange learns who asks from the subject, which the
nats-server attests: no buyer can speak as another. The exchange scopes every order id a
tenant sends as ``<NAME>:<order id>`` before the auction, so the machine a worker records
carries its owner in its ``order_id`` (nothing new on the workers), order ids of different
tenants never meet (one cannot be handed another's machine by reusing its id), and a
machine verb or listing is checked against the prefix. Replies go back with the tenant's
own order ids.

Pure functions; the exchange (exchange/service.py) is the shell.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from bourse.wire.codec import BadMessage
from bourse.wire.limits import ORDER_ID_MAX
from bourse.wire.messages import Machine, MachineList, Placed, PlaceOrder, Unfilled
from bourse.wire.subjects import is_valid_id

SEPARATOR = ":"
# The owner token of a machine's state subject (§4.21) when no tenant owns it (the shared
# buyer key's): no tenant name can be it.
SHARED_OWNER = "_"

M = TypeVar("M", bound=Placed | Unfilled | Machine)


def scope(tenant: str) -> str:
    return tenant + SEPARATOR


def scoped_order(tenant: str, order: PlaceOrder) -> PlaceOrder:
    """The order as the market sees it: its id under the tenant's scope."""
    order_id = scope(tenant) + order.order_id
    if len(order_id) > ORDER_ID_MAX:
        raise BadMessage(
            f"order id {order.order_id!r} is too long for tenant {tenant!r}: at most "
            f"{ORDER_ID_MAX - len(scope(tenant))} characters"
        )
    return msgspec.structs.replace(order, order_id=order_id)


def owns(tenant: str, order_id: str) -> bool:
    """Whether a machine placed for ``order_id`` belongs to ``tenant``."""
    return order_id.startswith(scope(tenant))


def tenant_of_order(order_id: str) -> str:
    """The tenant whose machine an order id places (``<tenant>:<id>``), or "" (the shared
    buyer key's; an id whose part before ``:`` is no tenant name is the shared key's too)."""
    head, sep, _ = order_id.partition(SEPARATOR)
    return head if sep and is_valid_id(head) else ""


def owner_token(order_id: str) -> str:
    """The owner token of a machine's state subject: its tenant, or SHARED_OWNER."""
    return tenant_of_order(order_id) or SHARED_OWNER


def unscoped(tenant: str, message: M) -> M:
    """A reply as the tenant sees it: its own order id (the scope taken off)."""
    if owns(tenant, message.order_id):
        return msgspec.structs.replace(message, order_id=message.order_id[len(scope(tenant)) :])
    return message


def own_machines(tenant: str, listing: MachineList) -> MachineList:
    """A worker's listing, cut to the tenant's machines (with its own order ids)."""
    mine = [unscoped(tenant, m) for m in listing.machines if owns(tenant, m.order_id)]
    return msgspec.structs.replace(listing, machines=mine)
