"""The wire contract's published forms agree with its types: the JSON Schemas in
docs/schema/ are what bourse/wire/schema.py generates from them, docs/protocol.md links
every one, and every example message on that page decodes as the type it names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bourse.wire import schema
from bourse.wire.codec import decode

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "protocol.md"


def test_the_schemas_in_docs_are_generated_from_the_wire_types() -> None:
    want = schema.schemas()
    have = {p.name: p.read_text() for p in schema.SCHEMA_DIR.glob("*.json")}
    drifted = sorted(name for name in want.keys() | have.keys() if want.get(name) != have.get(name))
    assert not drifted, (
        f"docs/schema/ differs from the wire types in {drifted}: "
        f"regenerate it with `{schema.COMMAND}` and commit the result"
    )


def test_every_message_and_reply_union_has_a_schema() -> None:
    names = set(schema.wire_types())
    assert {"PlaceOrder", "Placed", "Unfilled", "Error", "Offer", "Bid", "Commit"} <= names
    assert {"OrderReply", "CommitReply", "BidReply", "MachineReply"} <= names
    assert "Message" not in names  # the base class is no message of its own


def test_the_schemas_anchor_patterns_as_json_schema_reads_them() -> None:
    """JSON Schema patterns are ECMA-262, where Python's ``\\Z`` means a literal ``Z``."""
    patterns = [
        (name, pattern)
        for name, text in schema.schemas().items()
        for pattern in re.findall(r'"pattern": "(.*)"', text)
    ]
    assert len(patterns) > 20
    bad = [p for p in patterns if not (p[1].startswith("^") and p[1].endswith("$"))]
    assert not bad
    assert not [p for p in patterns if "\\Z" in p[1]]


def test_each_schema_names_its_type_and_the_draft() -> None:
    placed = json.loads(schema.schemas()["Placed.json"])
    assert placed["$schema"] == schema.DRAFT
    assert placed["$ref"] == "#/$defs/Placed"
    assert placed["$defs"]["Placed"]["required"][0] == "type"
    reply = json.loads(schema.schemas()["OrderReply.json"])
    assert {ref["$ref"] for ref in reply["anyOf"]} == {
        "#/$defs/Placed",
        "#/$defs/Unfilled",
        "#/$defs/Error",
    }


def test_protocol_md_links_every_schema() -> None:
    text = PROTOCOL.read_text()
    unlinked = [name for name in schema.schemas() if f"(schema/{name})" not in text]
    assert not unlinked, f"docs/protocol.md does not link {unlinked}"


def json_examples(text: str) -> list[dict[str, Any]]:
    """Every JSON object in the page's ```json blocks (a block may hold several; a block
    that is a fragment, not whole objects, is skipped)."""
    found: list[dict[str, Any]] = []
    parser = json.JSONDecoder()
    for block in re.findall(r"```json\n(.*?)```", text, re.S):
        at, objects = 0, []
        try:
            while at < len(block):
                if block[at].isspace():
                    at += 1
                    continue
                obj, at = parser.raw_decode(block, at)
                objects.append(obj)
        except json.JSONDecodeError:
            continue
        found += [obj for obj in objects if isinstance(obj, dict)]
    return found


EXAMPLES = [e for e in json_examples(PROTOCOL.read_text()) if "type" in e]


def test_the_page_has_an_example_of_the_main_messages() -> None:
    named = {e["type"] for e in EXAMPLES}
    assert {"PlaceOrder", "Placed", "Unfilled", "Error", "Bid", "Offer", "Commit"} <= named


@pytest.mark.parametrize(
    "example", EXAMPLES, ids=[f"{i}-{e['type']}" for i, e in enumerate(EXAMPLES)]
)
def test_every_example_on_the_page_decodes_as_the_type_it_names(example: dict[str, Any]) -> None:
    typ = schema.wire_types()[example["type"]]
    decode(json.dumps(example).encode(), typ)  # raises BadMessage naming the field


NATS_REQ_BODIES = [
    json.loads(body)
    for block in re.findall(r"```sh\n(.*?)```", PROTOCOL.read_text(), re.S)
    for body in re.findall(r"'(\{.*?\})'", block.replace("\\\n", ""))
]


def test_the_pages_nats_req_commands_send_valid_messages() -> None:
    assert len(NATS_REQ_BODIES) >= 4
    for body in NATS_REQ_BODIES:
        decode(json.dumps(body).encode(), schema.wire_types()[body["type"]])
