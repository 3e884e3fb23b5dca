"""nftables, in the supplier's process: libnftables (the library the ``nft`` command is
made of, installed with it) through ctypes, the way nftables' own Python binding uses it,
so that publishing a machine's ports on its start costs a library call (~0.1 ms) rather
than an ``nft`` process (~7 ms on a busy host). Where the library cannot be loaded, the
``nft`` command runs the same script.

One context for the process, used under a lock (libnftables contexts are not shared
between threads). Scripts are nft's own syntax; ``json=True`` asks for JSON output (what
``nft -j`` prints).
"""

from __future__ import annotations

import ctypes
import subprocess
import threading

from bourse.errors import BourseError

NFT = "nft"
LIBRARY = "libnftables.so.1"
OUTPUT_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON


class NftError(BourseError, RuntimeError):
    """nftables refused a script (its words)."""


class _Library:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._ctx: int | None = None
        self._tried = False

    def _load(self) -> bool:
        if self._tried:
            return self._ctx is not None
        self._tried = True
        try:
            lib = ctypes.CDLL(LIBRARY, use_errno=True)
        except OSError:
            return False
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.nft_ctx_output_get_flags.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            return False
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        self._lib, self._ctx = lib, ctx
        return True

    def run(self, script: str, json: bool) -> tuple[int, str, str] | None:
        """(status, output, error) of the script, or None without the library."""
        with self._lock:
            if not self._load():
                return None
            lib, ctx = self._lib, self._ctx
            assert lib is not None and ctx is not None
            flags = lib.nft_ctx_output_get_flags(ctx)
            wanted = flags | OUTPUT_JSON if json else flags & ~OUTPUT_JSON
            lib.nft_ctx_output_set_flags(ctx, wanted)
            code = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = lib.nft_ctx_get_output_buffer(ctx) or b""
            err = lib.nft_ctx_get_error_buffer(ctx) or b""
            return code, out.decode(errors="replace"), err.decode(errors="replace")


_LIBRARY = _Library()


def nft(script: str, json: bool = False) -> str:
    """Run an nftables script (one transaction); its output. NftError with nft's words."""
    done = _LIBRARY.run(script, json)
    if done is None:
        argv = [NFT, *(["-j"] if json else []), "-f", "-"]
        ran = subprocess.run(argv, input=script, capture_output=True, text=True, check=False)
        done = ran.returncode, ran.stdout, ran.stderr
    code, out, err = done
    if code != 0:
        # nft's words are the error, the command and a caret line under it: one line here
        lines = [line.strip() for line in err.splitlines() if line.strip(" ^\t")]
        raise NftError("nft: " + (": ".join(lines[:2]) or f"status {code}"))
    return out


def installed() -> bool:
    """Whether nftables can be used here (the library, else the command)."""
    if _LIBRARY.run("list tables", False) is not None:
        return True
    try:
        return subprocess.run([NFT, "--version"], capture_output=True, check=False).returncode == 0
    except OSError:
        return False
