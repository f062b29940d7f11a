"""The hidden-state store's on-disk format (this docstring is the spec) and what its reader and writer share: the
constants, bytes per token, fp8 quantization, header checks, manifest and part files, their union, `merge_manifest`
and the file checksum. The reader (`Store`, `open_store`) is `hstap.store.reader`, the writer (`StoreWriter`) is
`hstap.store.writer`.

Format `hstap-store`, versions 1 and 2
======================================

Version 2 is version 1 plus side branches (below), and only a store whose samples carry them is written as version 2;
every other store is written as version 1, byte for byte as before, and read by older hstap.

Layout: a store is a directory::

    STORE/manifest.json                                  header + merged list of committed shards
    STORE/parts/rank{rank:03d}.json                      per-rank list of committed shards (the commit record)
    STORE/shards/r{rank:03d}-{seq:06d}.safetensors       one shard: many samples concatenated along tokens
    STORE/shards/.r{rank:03d}-{seq:06d}.safetensors.tmp  a shard being written (never read; deleted on resume)
    STORE/consumer.json                                  optional: shards a trainer consumed, its window (below)
    STORE/vocab_map.safetensors                          optional: the draft vocabulary map (`vocab_map` below)

Other files in STORE (e.g. the capture run's `config.json`) are ignored by the store. Sample ids are strings, unique
in a store.

Shard tensors: a valid safetensors file; T = tokens in the shard, N = samples, K = len(layers), H = hidden_size.
Samples are concatenated along T with no padding; sample j is rows `offsets[j]:offsets[j+1]` of every per-token tensor.

| name | dtype | shape | meaning |
|---|---|---|---|
| `offsets` | I64 | [N+1] | `offsets[0] = 0`, `offsets[N] = T`, strictly increasing (a sample has >= 1 token) |
| `input_ids` | I32 | [T] | token ids |
| `aux_scale` | F32 | [T, K] | fp8 stores only: per token per layer dequantization scale |
| `final_scale` | F32 | [T] | fp8 stores only |
| `aux` | BF16 / F32 / F8_E4M3 | [T, K, H] | outputs of decoder layers `layers` (canonical ids, hstap.layers) |
| `final` | BF16 / F32 / F8_E4M3 | [T, H] | output of the final norm (what lm_head consumes) |
| `loss_mask` | U8 | [T] | 1 = token is trained on (assistant), 0 = not |

Tensors are stored in that order (descending alignment: every tensor starts at an offset aligned to its element size);
the JSON header is padded with spaces to a multiple of 8 bytes, as safetensors does. `__metadata__` (string values)
holds `format` ("hstap-store"), `version` ("1"), `ids` (JSON list of the N sample ids, in order), `dtype`, `layers`
(JSON list) and `rank`.

Side branches (version 2; manifest `side_branches` = {producer, rows, max_accepted}, the tap's settings that kept
them): next to the accepted sequence a sample carries S >= 0 side rows, the target's states at drafts a serving engine
verified and rejected (`hstap.store.side`). Row r was fed token `side_input_ids[r]` at position `side_pos[r]` of its
sample; its context is the sample's tokens 0..p and then, when `side_parent[r] < 0`, the chain of earlier side rows
-1-side_parent[r], ... back to a row whose parent is the sample's position p = side_pos - 1 (>= 0). Every tensor of
version 1, plus, in each shard (N samples, S side rows in all; sample j's rows are `side_offsets[j]:side_offsets[j+1]`):

| name | dtype | shape | meaning |
|---|---|---|---|
| `side_offsets` | I64 | [N+1] | after `offsets` |
| `side_input_ids`, `side_pos`, `side_parent` | I32 | [S] | after `input_ids`: the draft token fed, its position, its parent (above) |
| `side_step`, `side_accepted` | I32 | [S] | the request's target forward that verified it, drafts that forward accepted |
| `side_aux_scale`, `side_final_scale` | F32 | [S, K], [S] | fp8 stores only, after `final_scale` |
| `side_aux`, `side_final` | as `aux` | [S, K, H], [S, H] | after `final`: the target's states at the row |

A version-2 shard entry adds `side_rows` (rows per sample, file order); its `__metadata__` says `version` "2". Side
rows take the bytes of a token each and count toward the shard limit. Commit, checksums and resume are version 1's;
a store is resumed only by a writer of its own version (side branches or none).

Dtypes (`dtype`): `bf16` (default), `fp32` (exact; CPU tests), `fp8` = float8_e4m3fn with one float32 scale per token
per layer: `scale = amax(|x|, last dim) / 448` (1.0 for an all-zero row), `q = x / scale`, `x ~= q * scale`
(`quantize_fp8`, `dequantize_fp8`). Bytes per token (`store_bytes_per_token`): bf16 `(K+1)*H*2 + 5`,
fp32 `(K+1)*H*4 + 5`, fp8 `(K+1)*(H+4) + 5`; plus per shard 8 + the JSON header + 8*(N+1) bytes of offsets.
Nothing is ever padded.

`manifest.json` (a JSON object)::

    format        "hstap-store"
    version       1, or 2 with side branches (readers refuse a higher version than theirs)
    target        {path, model_type, num_layers, hidden_size, config_sha256, weights_fingerprint, tokenizer_sha256,
                   chat_template_sha256}
    engine        {name, version, device, compute_dtype}
    dtype         "bf16" | "fp8" | "fp32"
    layers        canonical layer ids of `aux` (K = len(layers))
    hidden_size   H
    writers       W, set by the writer: the writer ranks of the session that created the store, or that last
                  resumed it with another world size ("Writers and the end of writing"); absent in older stores
    vocab_map     optional (added without a version bump: readers ignore keys they do not know): {file
                  ("vocab_map.safetensors", relative to STORE), sha256 (of the file's bytes), size (draft ids N)}, the
                  prepared set's draft vocabulary map (d2t, t2d: hstap/data/vocab.py), copied by capture atomically after
                  the manifest is created; `hstap train --store STORE` uses it unless given another map
    contents      optional (no version bump): {kind, what, loss_mask, ...} for samples that are not a prepared set's
                  conversations: "generated" (`hstap generate --capture`: the target's answers, captured while it
                  generated them) or "served traffic" (a server's tap: requests from any client); absent = prepared
    work          optional (no version bump; every hstap writer records it): the store's identity beside its
                  target, layers and dtype, {kind, producer, data}: kind "prepared" | "generated" | "served traffic"
                  (as `contents`), producer the command that writes it ("hstap capture", "hstap generate --capture",
                  "vllm tap", "sglang tap"), data what its samples come from ({"path": the prepared set, "sha256": of
                  its meta.json's content} for capture, {"path": [conversation files], "sha256": their edges fingerprint,
                  `hstap.data.conversations.files_fingerprint`} for generate --capture, null for served traffic); a store without it is read as {kind: `contents.kind`
                  (absent: "prepared"), producer: unknown, data: unknown}
    capture_config, git_commit, ...   any other keys of the writer's header, stored as given
    created       ISO-8601 UTC creation time; created_unix: the same in seconds since the epoch
    checksum      "sha256-chunked-16MiB": how the shard entries' `sha256` field is computed (see below)
    shards        list of shard entries, ordered by (rank, seq)

A shard entry (same in manifest and part files): `file` (path relative to STORE, "shards/r000-000007.safetensors"),
`rank`, `seq`, `sha256` (the file's checksum: sha256 over the concatenated sha256 digests of its consecutive 16 MiB
chunks, `file_checksum`; manifest key `checksum` names the scheme), `bytes` (file size), `tokens` (T), `ids`
(sample ids, file order), `lengths` (tokens per sample, file order). A part file is {"format": "hstap-store-part",
"version": 1, "rank": r, "closed": bool, "shards": [entries of rank r]}. Writers put one top-level key and one shard
entry per line (readers must not rely on it).

Commit protocol (one writer per rank; ranks never touch each other's files):
 1. The shard is written to `shards/.rRRR-SSSSSS.safetensors.tmp` (one sequential writer; its 16 MiB chunks are
    hashed in parallel beside it), fsynced, renamed to `shards/rRRR-SSSSSS.safetensors`, and the directory fsynced.
 2. The rank's part file, holding all of the rank's entries, is atomically replaced (temp + fsync + rename).
    **This is the commit point**: a shard is committed iff an entry in a part file or in manifest.json names it.
 3. `merge_manifest` (rank 0 at `close()`, or by hand) folds all part files into manifest.json, atomically and
    idempotently. Part files are kept; they stay consistent with the manifest.

Creation: rank 0 creates STORE, `shards/`, `parts/` and writes manifest.json with the header, `writers` = its world
size and `shards: []`. Ranks > 0 never create or wipe anything; they wait for manifest.json (or a `barrier` callable
given by the caller). A rank-0 writer that resumes a store with another world size rewrites `writers` (atomically).

Resume rules (a `StoreWriter` on an existing store):
 - The header must match in target.{config_sha256, weights_fingerprint, tokenizer_sha256, chat_template_sha256},
   layers, dtype and hidden_size, and the resume must continue the same work (`work`: the same kind always; the same
   producer and data where both headers record them, data by its sha256 where both have one, else by path), else
   HstapError naming the field; `new=True` removes manifest.json, parts/ and shards/ first. Other keys (engine,
   capture_config, paths) may differ; the store keeps those it was created with.
 - A writer creates a store only in a new or empty directory, or one holding a store's own files without a manifest
   (an interrupted creation's shards/ and parts/, a waiting trainer's consumer.json, an hstap run record, an engine's
   events); it never writes into, nor with `new=True` wipes, a directory of other files, nor one whose manifest.json
   is not an hstap store's (`check_store_dir`).
 - Committed ids = the ids of all entries of manifest.json and of every part file. The caller skips them
   (`committed_ids()`, `committed_ids_of`); adding one raises. Consumed shards (below) keep their entries, so their
   samples stay committed: a resumed capture never captures them again.
 - At open, rank r deletes its own temp files and its own shard files that no entry names (a kill between rename
   and part-file write); its sequence numbers continue after its highest committed seq. `new=True` also deletes
   consumer.json (it describes the store being replaced).

Reader guarantees (`open_store`): the store is the union of manifest.json's and the part files' entries, so the
shards of a killed run are visible before any merge. Sample order is shard order (rank, seq), then file order. If two
entries claim one sample id (the protocol never does that), the later entry is ignored and reported by
`merge_manifest` and `Store.verify()`. Shards are read memory-mapped through the safetensors library. ENOSPC or any
other OSError while writing a shard removes the temp file and leaves every committed shard intact. Consumed shards
are gone for a reader: `open_store` drops their entries (so `verify()` checks what remains). A reader opens a shard
only at the size its entry records (`bytes`); `Store.check`, which train and capture's resume run before they read or
extend a store, also hashes every shard against its entry's `sha256`.

Writers and the end of writing (`writing_state`; what `hstap train --follow` waits on):
 - The store's ranks are 0..max(W, 1 + the highest rank with a part file) - 1, W = manifest `writers`.
 - Rank r is finished when its part file says `closed: true`, or when r >= W and its part file exists (a rank of an
   earlier, wider session that the current one does not run). A rank r < W without a part file has not started: not
   finished. A writer that resumes its rank re-opens it (`closed: false`).
 - Writing has ended when every rank is finished. Stores without `writers`: the ranks with part files, each finished
   iff closed.
 - The SGLang hook's writers live in the server, beyond one capture: the driver creates the store with `writers` = the
   server's attention-DP size and no part file of its own; at the end of its session (every sample committed or
   dropped) it writes `sglang-events/end-<session>.json`, and each DP rank's hook closes its rank (opening it first
   if it wrote nothing), then re-opens it on the next session's first sample.

Consumed shards and back-pressure (`hstap.store.consumer`; `hstap train --follow --consume --keep-shards N`):
 `consumer.json` = {"format": "hstap-store-consumer", "version": 1, "run": the trainer's run directory,
 "store_created_unix": the manifest's created_unix (null while the store did not exist yet), "active": bool,
 "keep_shards": N, "consumed": {"<rank>": c, ...}, "updated_unix": ...}
 - Written only by the consuming trainer (its rank 0), atomically (temp + fsync + rename); one consuming trainer per
   store. Writers and readers only read it, and the trainer writes no other file of the store (it deletes consumed
   shard files; their entries stay in the part files, which only their writer rank writes).
 - Shard (r, s) is consumed iff s < consumed[r]. The trainer consumes shards in its stream order, which takes each
   rank's shards in seq order, so a rank's consumed shards are always a seq prefix.
 - Order: the trainer's checkpoint that covers the shard's last use is committed, then consumer.json is replaced
   (the commit point of consumption), then the shard files are deleted. A consumed shard's file still on disk (a kill
   between the last two) is ignored by readers and deleted by the trainer's next start.
 - A record whose store_created_unix is neither null nor the manifest's created_unix was made for an earlier store at
   this path: ignored.
 - Back-pressure: while the record is active, writer rank r of a world of W writes a shard only when fewer than
   max(1, N // W) of its own shard files (`rRRR-*.safetensors`, committed or consumed-but-not-yet-deleted) are on
   disk; otherwise it waits, re-reading the record (`wait_for_room`), before it creates the temp file. Its temp file
   is then the only one it has, so from the moment the record exists the store never holds more than N shard files
   (peak bytes <= N * (the writer's shard limit + one sample)). No record, or an inactive one (the trainer ended
   normally): writers never wait.
 - `writers` and consumer.json were added within version 1; a reader that predates them sees a consumed shard as a
   missing file (its verify() reports it), so read a consumed store with an hstap that knows consumer.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hstap.common import HstapError, atomic_write_bytes
from hstap.artifacts.outputs import read_record

FORMAT = "hstap-store"
PART_FORMAT = "hstap-store-part"
VERSION = 2
"""The highest store version this hstap reads and writes (a store without side branches is written as 1)."""
PART_VERSION = 1
DTYPES = ("bf16", "fp8", "fp32")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
ST_NAMES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16",
            torch.float8_e4m3fn: "F8_E4M3"}  # torch dtype -> safetensors dtype name
# Header fields that decide whether stored hidden states are the ones this run would produce.
CHECKED_FIELDS = ("target.config_sha256", "target.weights_fingerprint", "target.tokenizer_sha256",
                  "target.chat_template_sha256", "layers", "dtype", "hidden_size")
_RESERVED = ("format", "version", "created", "created_unix", "shards")
SHARD_RE = re.compile(r"^r(\d{3,})-(\d{6,})\.safetensors$")
TEMP_RE = re.compile(r"^\.r(\d{3,})-(\d{6,})\.safetensors\.tmp$")
TEMP_OF_RE = re.compile(r"^\..+\.[^.]+\.tmp$")
"""An atomic write's temporary file (`.NAME.RANDOM.tmp` beside NAME) left by a process killed before its rename."""
log = logging.getLogger("hstap.store")


def store_bytes_per_token(num_aux: int, hidden_size: int, dtype: str = "bf16") -> int:
    """Bytes per token in a shard (aux + final + fp8 scales + int32 id + uint8 mask), without per-shard overhead."""
    if dtype not in DTYPES:
        raise HstapError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    elem, scale = {"bf16": (2, 0), "fp32": (4, 0), "fp8": (1, 4)}[dtype]  # bytes per value, per row (fp8 scale)
    return (num_aux + 1) * (hidden_size * elem + scale) + 5


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H) float -> (q (..., H) float8_e4m3fn, scale (...) float32), one scale per row; runs on x's device."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (..., 1)
    # tiny floor: a denormal amax would make amax/448 underflow to 0; all-zero rows get scale 1 so q = 0 exactly.
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # (..., H)
    return q, scale.squeeze(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., H) float8 and (...) float32 scales -> (..., H) `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def work_of(header: dict) -> dict:
    """The store's `work` (kind, producer, data; the spec above), read the same way for stores that predate it."""
    w = header.get("work") if isinstance(header.get("work"), dict) else {}
    kind = w.get("kind") or (header.get("contents") or {}).get("kind") or "prepared"
    return {"kind": kind, "producer": w.get("producer"), "data": w.get("data")}


def _same_data(a, b) -> bool:
    if a is None or b is None:
        return True  # unknown on one side (a store older than `work`): not compared
    if isinstance(a, dict) and isinstance(b, dict) and a.get("sha256") and b.get("sha256"):
        return a["sha256"] == b["sha256"]  # a prepared set by its content: one moved elsewhere is the same work
    return a == b


def header_diff(old: dict, new: dict) -> tuple[str, object, object] | None:
    """The first of CHECKED_FIELDS, then of work.{kind, producer, data}, that differs: (dotted name, old value, new
    value)."""
    for name in CHECKED_FIELDS:
        a, b = old, new
        for k in name.split("."):
            a, b = (a.get(k) if isinstance(a, dict) else None), (b.get(k) if isinstance(b, dict) else None)
        if a != b:
            return name, a, b
    wa, wb = work_of(old), work_of(new)
    if wa["kind"] != wb["kind"]:
        return "work.kind", wa["kind"], wb["kind"]
    if wa["producer"] and wb["producer"] and wa["producer"] != wb["producer"]:
        return "work.producer", wa["producer"], wb["producer"]
    if not _same_data(wa["data"], wb["data"]):
        return "work.data", wa["data"], wb["data"]
    return None


def refuse_other_header(path: Path, manifest: dict, header: dict) -> None:
    """HstapError naming the first field (`header_diff`) in which the store at `path` (its manifest) differs from the
    header of a run that would extend it."""
    diff = header_diff(manifest, header)
    if diff:
        name, old, now = diff
        if name.startswith("work."):
            raise HstapError(f"{path / 'manifest.json'}:1: {name}: the store holds {_work_name(work_of(manifest))}; "
                             f"this run writes {_work_name(work_of(header))}: a store is resumed only by the same "
                             f"work; pass --new to replace it, or write to another directory")
        raise HstapError(f"{path / 'manifest.json'}:1: {name}: the store was made with {old!r}, this run has "
                         f"{now!r}; pass new=True (--new) to replace it, or write to another directory")


_PRODUCERS = {"prepared": "hstap capture", "generated": "hstap generate --capture", "served traffic": "a server's tap"}


def _work_name(w: dict) -> str:
    """'prepared samples (hstap capture, from /data/prepared)': a store's work in words."""
    data = w["data"].get("path") if isinstance(w["data"], dict) else None
    src = f", from {', '.join(map(str, data)) if isinstance(data, list) else data}" if data else ""
    return f"{w['kind']} samples ({w['producer'] or _PRODUCERS.get(w['kind'], 'an unknown producer')}{src})"


STORE_FILES = ("manifest.json", "parts", "shards", "consumer.json", "vocab_map.safetensors")
"""What a store's directory holds of its own (besides run records and engine event directories, `check_store_dir`)."""


def check_store_dir(path: str | os.PathLike) -> bool:
    """Before a writer creates, resumes or replaces (--new) the store at `path`: whether there is a store to resume
    or replace (a manifest.json of the hstap-store format). HstapError naming the path when it is a file, holds a
    manifest.json of another format, or holds other files than a store's own (shards/ and parts/ of shard and part
    files, a following trainer's consumer.json, a run record, an engine's event directory: what an interrupted
    creation, or a trainer waiting for the store, leaves): a store is never written into, nor wiped from, a directory
    of the user's files."""
    p = Path(path)
    if not p.exists():
        return False
    if not p.is_dir():
        raise HstapError(f"{p}: exists and is not a directory (a store is a directory)")
    if (p / "manifest.json").is_file():
        load_manifest(p)  # one of another format is refused by name
        return True
    for f in sorted(p.iterdir()):
        if f.name == "shards" and f.is_dir() and all(SHARD_RE.match(x.name) or TEMP_RE.match(x.name)
                                                     for x in f.iterdir()):
            continue
        if f.name == "parts" and f.is_dir() and all(x.name.startswith(("rank", ".rank")) for x in f.iterdir()):
            continue
        if f.name in STORE_FILES and f.is_file() or f.is_dir() and f.name.endswith("-events"):
            continue  # e.g. a following trainer's consumer.json, written before the store is created
        if f.name == "config.json" and read_record(f) is not None:
            continue
        if f.is_file() and any(TEMP_OF_RE.match(f.name) and f.name[1:].startswith(n + ".")
                               for n in (*STORE_FILES, "config.json")):
            continue  # an atomic write of the store's own file, killed before its rename: the creation was cut short
        raise HstapError(f"{p}: holds {f.name!r} and no manifest.json: not an hstap store; a store is created only "
                         f"in a new or empty directory (nothing there was touched): choose another directory")
    return False



def check_resumable(path: str | os.PathLike, header: dict) -> None:
    """Before a run loads anything to extend the existing store at `path`: its header must be this run's (what
    `StoreWriter` refuses later, said before the run spends any time)."""
    p = Path(path)
    refuse_other_header(p, load_manifest(p), check_header(header))


def check_header(header: dict) -> dict:
    if not isinstance(header, dict):
        raise HstapError(f"store header: expected a dict, got {type(header).__name__}")
    for k in _RESERVED:
        if k in header:
            raise HstapError(f"store header: key {k!r} is reserved for the manifest")
    if header.get("dtype") not in DTYPES:
        raise HstapError(f"store header: dtype: expected one of {', '.join(DTYPES)}, got {header.get('dtype')!r}")
    layers = header.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise HstapError(f"store header: layers: expected a non-empty list of canonical layer ids, got {layers!r}")
    if not isinstance(header.get("hidden_size"), int) or header["hidden_size"] < 1:
        raise HstapError(f"store header: hidden_size: expected a positive int, got {header.get('hidden_size')!r}")
    try:  # the header goes into JSON: fail now, not at the first commit
        return json.loads(json.dumps(header))
    except (TypeError, ValueError) as e:
        raise HstapError(f"store header: not JSON-serialisable: {e}") from None


def write_json(path: Path, obj: dict) -> None:
    """Atomically write a manifest/part file: one key per line, one shard entry per line.

    Not `atomic_write_json`: its indented output goes through json's pure-Python encoder, and a part file is
    rewritten at every commit: O(shards^2) Python time per rank. This uses the C encoder and stays grep-able."""
    lines = []
    for k, v in obj.items():
        if k == "shards" and v:
            body = ",\n".join("  " + json.dumps(e, separators=(", ", ": ")) for e in v)
            lines.append(f' "shards": [\n{body}\n ]')
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    atomic_write_bytes(path, ("{\n" + ",\n".join(lines) + "\n}\n").encode())


def read_json(path: Path, what: str) -> dict:
    """A JSON object from path; HstapError naming file:line when it is not one."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
    except json.JSONDecodeError as e:
        raise HstapError(f"{path}:{e.lineno}: {what} is not valid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise HstapError(f"{path}:1: {what}: expected a JSON object")
    return obj


def load_manifest(path: Path) -> dict:
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise HstapError(f"{path}: not an hstap store (no manifest.json)")
    m = read_json(mpath, "manifest")
    if m.get("format") != FORMAT:
        raise HstapError(f"{mpath}:1: format: expected {FORMAT!r}, got {m.get('format')!r}")
    if not isinstance(m.get("version"), int) or m["version"] > VERSION:
        raise HstapError(f"{mpath}:1: version: {m.get('version')!r} is not readable by this hstap (reads <= {VERSION})")
    if not isinstance(m.get("shards"), list):
        raise HstapError(f"{mpath}:1: shards: expected a list")
    return m


def load_parts(path: Path) -> list[tuple[Path, dict]]:
    out = []
    pdir = path / "parts"
    if pdir.is_dir():
        for p in sorted(pdir.glob("rank*.json")):
            part = read_json(p, "part file")
            if part.get("format") != PART_FORMAT or not isinstance(part.get("shards"), list):
                raise HstapError(f"{p}:1: not an hstap store part file (format {part.get('format')!r})")
            out.append((p, part))
    return out


def union_entries(manifest: dict, parts: list[tuple[Path, dict]]) -> tuple[list[dict], list[str], set[str]]:
    """Committed entries = manifest ∪ part files, keyed by file, ordered by (rank, seq), duplicate sample ids dropped.

    Returns (entries, problems, files named by any entry, dropped ones included)."""
    by_file: dict[str, dict] = {}
    problems: list[str] = []
    sources = [("manifest.json", manifest["shards"])] + [(f"parts/{p.name}", q["shards"]) for p, q in parts]
    for source, entries in sources:
        for e in entries:
            if not isinstance(e, dict) or not all(k in e for k in ("file", "rank", "seq", "sha256", "ids", "lengths")):
                problems.append(f"{source}: malformed shard entry {str(e)[:120]}")
                continue
            old = by_file.get(e["file"])
            if old is None:
                by_file[e["file"]] = e
            elif old != e:
                problems.append(f"{source}: entry for {e['file']} differs from an earlier one (kept the first)")
    files = set(by_file)
    out, owner = [], {}
    for e in sorted(by_file.values(), key=lambda e: (e["rank"], e["seq"])):
        clash = [i for i in e["ids"] if i in owner]
        if clash:
            problems.append(f"{e['file']}: {len(clash)} sample id(s) already committed by {owner[clash[0]]} "
                            f"(e.g. {clash[0]!r}); entry ignored")
            continue
        for i in e["ids"]:
            owner[i] = e["file"]
        out.append(e)
    return out, problems, files


def merge_manifest(path: str | os.PathLike) -> dict:
    """Fold every part file into manifest.json (atomic, idempotent). Returns {shards, samples, tokens, problems}."""
    path = Path(path)
    m = load_manifest(path)
    entries, problems, _ = union_entries(m, load_parts(path))
    merged = {k: v for k, v in m.items() if k != "shards"} | {"shards": entries}
    if merged != m:
        write_json(path / "manifest.json", merged)
    for p in problems:
        log.warning("%s: %s", path, p)
    return {"shards": len(entries), "samples": sum(len(e["ids"]) for e in entries),
            "tokens": sum(int(e["tokens"]) for e in entries), "problems": problems}


def writing_state(manifest: dict, parts: list[tuple[Path, dict]]) -> tuple[int, set[int]]:
    """(number of ranks, the finished ones) by the rules of "Writers and the end of writing" in the spec above; writing
    has ended when every rank is finished."""
    closed = {int(q.get("rank", -1)): bool(q.get("closed")) for _, q in parts}
    W = manifest.get("writers")
    if not isinstance(W, int) or W < 1:  # a store made before `writers` existed: the ranks that wrote a part file
        return max(closed, default=-1) + 1, {r for r, c in closed.items() if c}
    return max(W, max(closed, default=-1) + 1), {r for r, c in closed.items() if c or r >= W}


def committed_ids_of(path: str | os.PathLike) -> set[str]:
    """Every committed sample id of a store: manifest.json ∪ part files, consumed shards included (what a resumed
    capture must skip)."""
    entries, _, _ = union_entries(load_manifest(Path(path)), load_parts(Path(path)))
    return {i for e in entries for i in e["ids"]}


CHECKSUM = "sha256-chunked-16MiB"
CHUNK_BYTES = 16 << 20
_POOL: ThreadPoolExecutor | None = None


def io_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:  # hashlib and os.pwrite/os.pread release the GIL: chunks really run in parallel
        _POOL = ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 1) + 1), thread_name_prefix="hstap-shard-io")
    return _POOL


def _drop_pool_after_fork() -> None:
    global _POOL
    _POOL = None  # a forked child has the executor object but none of its threads: make a fresh one on first use


os.register_at_fork(after_in_child=_drop_pool_after_fork)


def combine_digests(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def file_checksum(path: str | os.PathLike) -> str:
    """The store's checksum of a file: sha256 over the concatenated sha256 digests of its consecutive 16 MiB chunks.

    A chunked (one-level tree) hash instead of one sha256 stream so that writing and verifying hash chunks on several
    cores: a single sha256 stream runs at ~1.2 GB/s, slower than the GPU produces hidden states."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def work(c: int) -> bytes:
            lo, n = c * CHUNK_BYTES, min(CHUNK_BYTES, size - c * CHUNK_BYTES)
            h, done = hashlib.sha256(), 0
            while done < n:
                b = os.pread(fd, min(n - done, 4 << 20), lo + done)
                if not b:
                    raise OSError(f"{path}: file shrank while reading")
                h.update(b)
                done += len(b)
            return h.digest()

        return combine_digests(list(io_pool().map(work, range(max(1, -(-size // CHUNK_BYTES))))))
    finally:
        os.close(fd)
