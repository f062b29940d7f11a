"""The hidden-state store's on-disk format: this docstring is the spec (versioned), the constants that name its parts
and the bytes a token takes. What reader and writer share lives beside it, a module per concept: `hstap.store.header`
(the header's checks, the comparison a resume makes), `hstap.store.manifest` (manifest and part files, their union,
`merge_manifest`, the end of writing, the directory a store may be created in), `hstap.store.fp8` (fp8 quantization),
`hstap.store.checksum` (the file checksum, the I/O pool) and `hstap.store.side` (side branches: their checks and
layout). The reader (`Store`, `open_store`) is
`hstap.store.reader`, the writer (`StoreWriter`) is `hstap.store.writer`.

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
                  prepared set's draft vocabulary map (d2t, t2d: hstap/artifacts/vocab_map.py), copied by capture atomically after
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

import re

import torch

from hstap.common import HstapError

FORMAT = "hstap-store"
PART_FORMAT = "hstap-store-part"
VERSION = 2
"""The highest store version this hstap reads and writes (a store without side branches is written as 1)."""
PART_VERSION = 1
DTYPES = ("bf16", "fp8", "fp32")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
ST_NAMES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16",
            torch.float8_e4m3fn: "F8_E4M3"}  # torch dtype -> safetensors dtype name
SHARD_RE = re.compile(r"^r(\d{3,})-(\d{6,})\.safetensors$")
TEMP_RE = re.compile(r"^\.r(\d{3,})-(\d{6,})\.safetensors\.tmp$")


def store_bytes_per_token(num_aux: int, hidden_size: int, dtype: str = "bf16") -> int:
    """Bytes per token in a shard (aux + final + fp8 scales + int32 id + uint8 mask), without per-shard overhead."""
    if dtype not in DTYPES:
        raise HstapError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    elem, scale = {"bf16": (2, 0), "fp32": (4, 0), "fp8": (1, 4)}[dtype]  # bytes per value, per row (fp8 scale)
    return (num_aux + 1) * (hidden_size * elem + scale) + 5
