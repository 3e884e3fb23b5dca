"""Wire contract v1: the limits every peer enforces (sizes, ceilings, id patterns).

See docs/protocol.md §2 and §3."""

from __future__ import annotations

PROTOCOL_VERSION = "v1"

# A payload larger than this is refused with an Error before it is parsed. The server's own
# max_payload (1 MiB by default) is larger, so an oversize message still reaches us and gets
# a clear answer instead of a silent drop.
MAX_PAYLOAD_BYTES = 64 * 1024
# A Bid or Commit made from an order at the limit is a little longer than the order (an
# auction id, a worker id, defaults written out): receivers allow this much more for them.
DERIVED_OVERHEAD_BYTES = 1024

# Resource ceilings per request: big enough for any machine that exists, small enough that
# arithmetic and SQLite integers never overflow and a typo (memory_mb=10**12) is an error.
MAX_CPUS = 4096
# Fractional CPUs travel as millicores (``cpu_millis``, docs/protocol.md §4.1): 1000 = 1 CPU.
MILLIS_PER_CPU = 1000
MAX_CPU_MILLIS = MAX_CPUS * MILLIS_PER_CPU
MAX_MEMORY_MB = 64 * 1024 * 1024  # 64 TiB
MAX_DISK_MB = 1024 * 1024 * 1024  # 1 PiB, in MiB
MAX_GPUS = 256
MAX_DEADLINE_MS = 30_000
DEFAULT_DEADLINE_MS = 500
MAX_HOLD_MS = 60_000
# Offers in one Offers message (a supplier process's answer to one bid); a process with more
# sends several messages. Signed offers are ~0.5 KB each, so one message stays well under
# any server's max_payload.
MAX_BATCH_OFFERS = 64
# Bids (or releases, or prompt answers) in one Batch / Answers message (§4.4.4); more go in
# several. 128 bids of ~0.4 KB, or 128 answers of a few signed offers, stay far below the
# server's max_payload (1 MB by default).
MAX_BATCH_ITEMS = 128
# A NATS subject carried in a message body (a reply inbox).
MAX_SUBJECT = 256

# Patterns anchor with \Z (end of string), not $: in Python, $ also matches before a
# trailing newline, which would let "mad\n" through.
ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}\Z"
ORDER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z"
ORDER_ID_MAX = 128  # the pattern's length bound
MACHINE_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}~[A-Za-z0-9]{1,64}\Z"
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}\Z"
# An OCI content digest (sha256 only), or "" where none is known (a catalog image).
DIGEST_PATTERN = r"^(sha256:[0-9a-f]{64})?\Z"
# A machine's private address: a dotted IPv4 address, or "" (none).
PRIVATE_ADDRESS_PATTERN = r"^(([0-9]{1,3}\.){3}[0-9]{1,3})?\Z"
MAX_LAYERS = 128  # layers of one image a bid may list
# A machine's named ports and environment (protocol §4.2): names a shell can take as
# variables; Bourse's own variables (PORT, BOURSE_*) are set by the worker.
PORT_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,31}\Z"
ENV_KEY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z"
MAX_PORTS = 16
MAX_ENV = 128
MAX_ENV_VALUE = 4096
MAX_CHECKS = 16
# An http check's path goes into the probe's request line: no control character (C0, DEL,
# C1), so no CR or LF can end the line and inject a header or a request of its own.
CONTROL_CHARACTERS = r"\x00-\x1f\x7f-\x9f"  # a regex character range
CHECK_PATH_PATTERN = rf"^[^{CONTROL_CHARACTERS}]*\Z"
MAX_CHECK_PATH = 1024
MAX_LAYER_BYTES = 1 << 40  # 1 TiB: one layer's size
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}\Z"
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9._:/-]{0,128}\Z"
MACHINE_ID_SEPARATOR = "~"

# A command run inside a machine (docs/protocol.md §4.24): the bytes of one input or output
# chunk (base64 in JSON: ~43 KiB, under MAX_PAYLOAD_BYTES), the bytes either side may send
# unacknowledged (its window: a client's default and ceiling), the session's time limit,
# and how often each side says it is there (an ExecAck) and how long a silence ends it.
MAX_EXEC_CHUNK = 32 * 1024
EXEC_WINDOW_BYTES = 256 * 1024
MAX_EXEC_WINDOW_BYTES = 4 * 1024 * 1024
DEFAULT_EXEC_TIMEOUT_S = 3600
MAX_EXEC_TIMEOUT_S = 24 * 3600
EXEC_KEEPALIVE_S = 5
EXEC_SILENCE_S = 30
MAX_EXEC_ARGS = 256
MAX_EXEC_ARG = 4096
EXEC_SESSION_PATTERN = r"^[A-Za-z0-9]{1,64}\Z"
