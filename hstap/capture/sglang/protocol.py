"""What the `sglang` engine's three pieces agree on: the server-side hook (capture/sglang/hook.py), the plugin
(capture/sglang/plugin.py) and the driver in the hstap process (capture/sglang/driver.py) each import this module and
never each other.

- `ENV_LAYERS`: the environment variable (canonical layer ids) that makes the plugin turn on aux capture;
- `HOOK_FACTORY` and `hook_spec(...)`: the `--forward-hooks` entry that loads the hook;
- request ids `hstap:<session>:<row>:<sha256(id)[:16]>:<attempt>` (`encode_rid` / `decode_rid`): ASCII, so that sample
  ids (any string) never travel to the server and are never used in paths;
- `EVENTS_DIR`: where in the store the hook writes the events (drops, errors) the driver reads;
- `end_marker(session)`: the file in EVENTS_DIR by which the driver ends a session: every DP rank's hook then closes
  its store rank (the end of writing that `hstap train --follow` waits on; spec in hstap/store/format.py).
"""

from __future__ import annotations

import hashlib
import os

ENV_LAYERS = "HSTAP_CAPTURE_LAYERS"
HOOK_FACTORY = "hstap.capture.sglang.hook:make_hook"
RID_PREFIX = "hstap:"
EVENTS_DIR = "sglang-events"  # inside the store; the store's reader ignores other files
END_PREFIX = "end-"


def end_marker(session: str) -> str:
    """The name, in EVENTS_DIR, of the file that ends a driver session."""
    return f"{END_PREFIX}{session}.json"


def sample_digest(sample_id: str) -> str:
    return hashlib.sha256(str(sample_id).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def encode_rid(session: str, row: int, sample_id: str, attempt: int = 0) -> str:
    return f"{RID_PREFIX}{session}:{int(row)}:{sample_digest(sample_id)}:{int(attempt)}"


def decode_rid(rid) -> tuple[str, int, str] | None:
    """(session, row, digest) of an hstap rid, None for anything else (other clients, hostile strings)."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX) or len(rid) > 128 or not rid.isascii():
        return None  # isascii: str.isdigit/isalnum also accept non-ASCII digits and letters
    parts = rid[len(RID_PREFIX):].split(":")
    if len(parts) != 4 or not parts[0].isalnum() or not parts[1].isdigit() or not parts[3].isdigit():
        return None
    if len(parts[2]) != 16 or any(c not in "0123456789abcdef" for c in parts[2]):
        return None
    return parts[0], int(parts[1]), parts[2]


def hook_spec(store: str, data: str, layers: list[int], name: str = "hstap", **extra) -> dict:
    """One `--forward-hooks` entry: `--forward-hooks '[<this as JSON>]'`."""
    return {"name": name, "target_modules": ["logits_processor"], "hook_factory": HOOK_FACTORY,
            "config": {"store": os.path.abspath(store), "data": os.path.abspath(data),
                       "layers": [int(i) for i in layers], **extra}}
