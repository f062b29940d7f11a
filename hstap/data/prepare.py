"""`hstap prepare`: chat conversations -> token ids + assistant loss mask + draft vocabulary map.

    hstap prepare --tokenizer ../shared/reference/target-tiny --data examples/tiny_chat.jsonl --out runs/prepared
    hstap prepare --tokenizer MODEL_DIR --data train.jsonl.gz more/ --out PREPARED --num-proc 8 --draft-vocab 32000

Inputs (read by `hstap.data.conversations`): `.jsonl`, `.json` (a list, or JSON Lines), `.parquet`, `.jsonl.gz`/`.json.gz`,
or directories of them (recursive, sorted, hidden entries skipped). Errors name `file:line` (Parquet: the 1-based
row). Format, per record: ShareGPT {"conversations": [{"from": "system|human|gpt", "value"}]}, OpenAI {"messages":
[{"role", "content"}]}, or {"conversations": [{"role", "content"}]} (the reference corpus). A record's `id` is kept,
else it is `conversation_id(messages)`: sha256 of the normalised conversation as compact key-sorted JSON, 16 hex
digits. Ids are unique in the output: an exact duplicate is skipped (counted), a reused id with other content is a bad
record.

Loss mask. It is 1 on the tokens the assistant emits, found in the rendered text with no template special-cased (so it
works for templates without `{% generation %}` markers):
  1. F = template(conversation).
  2. For each assistant message k, render again with its content replaced by a sentinel: A + S + B. The template must
     reproduce F around it, F = A + C + B; C, the content as the template prints it (e.g. after Llama-3's `| trim`),
     is the content span.
  3. End of turn: render the conversation cut after message k (with the sentinel). What follows the sentinel there,
     without trailing whitespace, is how the template closes a turn when the conversation would end there; the
     end-of-turn text is its longest common prefix with B, again without trailing whitespace. For the reference
     template that is `<|end|>`, for Llama-3 `<|eot_id|>`, for ChatML `<|im_end|>`; the newline after it and the next
     header are not part of it. A template that emits nothing after the content gets no end-of-turn tokens.
  4. F is tokenized once with offsets. Token i is 1 iff it carries a character of an assistant content span, or it
     lies entirely inside that message's end-of-turn text and is not part of a trailing run of whitespace-only tokens.
     So a BPE token straddling header and content (`Ġanswer` in `Assistant: answer`, the space being the header's)
     is 1: the assistant emits it. A token only partly inside the end-of-turn text is 0: its text is not common to
     both renderings (e.g. `<|user|>` when the common text ends in `<|`).
  5. Reasoning (`reasoning_content` on an assistant message, which the template may print or drop): a turn whose
     reasoning is printed counts from the end of its generation prompt on, thinking tokens included (hstap/data/chat.py,
     where the rendering and this rule live).
The ids equal `tokenizer.apply_chat_template(messages, tokenize=True, **chat_template_kwargs)`; `render_prompt` renders
the same way with the generation prompt, so eval prompts are a prefix of the training sequences. Rejected: per-template regexes over the
rendered text (SpecForge: one registry entry per model family) and `{% generation %}` markers (few templates have them).

Output directory PREPARED (built in a hidden temp sibling, fsynced, renamed at the end; an existing one is refused):
  Arrow dataset (`datasets.save_to_disk`; `load_prepared`): id (str), input_ids (list[int32]), loss_mask (list[int8])
  token_freq.safetensors  token_freq int64 [V]: counts of loss-masked tokens (V = len(tokenizer))
  vocab_map.safetensors   d2t int64 [N] (hot id - draft index), t2d bool [V] (the draft vocabulary map: hstap/artifacts/vocab_map.py)
  meta.json               tokenizer/chat-template sha256, chat_template_kwargs, vocab_size, max_len, counts, draft
                          vocab size and coverage
  config.json             the resolved PrepareConfig (replay: `hstap prepare --config PREPARED/config.json --out NEW`)

Tokenization runs in `--num-proc` forked workers over chunks of records, collected in input order, so the output does
not depend on the number of processes. (Spawned workers would each re-import transformers, seconds per worker.)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from hstap.common import (
    HstapError, atomic_write_bytes, atomic_write_json, publishing_dir, read_json, write_run_config)
from hstap.data.chat import assistant_spans, tokenize_conversation
from hstap.data.conversations import BadRecord, count_skip, expand_paths, iter_records
from hstap.data.prepare_config import PrepareConfig
from hstap.data.reasoning import template_kwargs
from hstap.artifacts.outputs import check_new_out
from hstap.artifacts.vocab_map import VOCAB_MAP_FILE, build_vocab_map, check_vocab_map, write_vocab_map
from hstap.artifacts.model_dir import chat_template_of, chat_template_sha256, load_tokenizer, tokenizer_sha256

CHUNK = 64  # records per worker task: large enough to amortise IPC, small enough to keep workers busy


# ------------------------------------------------------------------------------------------------ prepared output


def read_meta(path: str | os.PathLike) -> dict:
    """meta.json of a prepared set (path: PREPARED/ or the meta.json file)."""
    p = Path(path)
    if p.is_dir():
        p = p / "meta.json"
    elif p.is_file() and p.name != "meta.json":  # e.g. the conversations file itself
        raise HstapError(f"{p}: a file, not a prepared dataset directory; run hstap prepare --data {p} first")
    if not p.exists():
        raise HstapError(f"{p}: not found (not a prepared dataset? run hstap prepare)")
    meta = read_json(p)
    if meta.get("format") != "hstap-prepared":
        raise HstapError(f"{p}: not an hstap prepared-data meta.json")
    return meta


def load_prepared(path: str | os.PathLike):
    """The prepared `datasets.Dataset`: id (str), input_ids (list[int]), loss_mask (list[int] 0/1)."""
    import datasets

    p = Path(path)
    read_meta(p)
    if not (p / "state.json").is_file():
        raise HstapError(f"{p}: no Arrow dataset here (state.json missing)")
    return datasets.load_from_disk(str(p))


def prepared_columns(ds, n: int) -> tuple[list[str], list[int]]:
    """(ids, lengths) of the first n rows of a prepared set, read column-wise from Arrow (no Python lists of tokens)."""
    import pyarrow.compute as pc

    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    ids = [str(x) for x in ds.data.column("id").slice(0, n).to_pylist()]
    lens = pc.list_value_length(ds.data.column("input_ids").slice(0, n)).to_pylist()
    return ids, [int(x or 0) for x in lens]


def max_token_id(ds, n: int):
    """The largest token id in the first n rows of a prepared set (None when they hold no token)."""
    import pyarrow.compute as pc

    col = ds.data.column("input_ids").slice(0, n)
    return pc.max(pc.list_flatten(col)).as_py()


_WORKER: dict = {}


def _init_worker(tokenizer, max_len: int, kwargs: dict | None = None):
    _WORKER.update(tokenizer=tokenizer, max_len=max_len, kwargs=kwargs)


def _work(items: list[tuple]) -> list[tuple]:
    """Tokenize a chunk: ("rec", loc, id, messages) -> ("ok", id, ids, mask, truncated, cut answers) | ("skip"/"error", reason,
    message); other items pass through so that every outcome keeps its input position."""
    tok, max_len, kwargs = _WORKER["tokenizer"], _WORKER["max_len"], _WORKER.get("kwargs")
    out = []
    for item in items:
        if item[0] != "rec":
            out.append(item)
            continue
        _, loc, rid, messages = item
        try:
            ids, mask = tokenize_conversation(tok, messages, kwargs)
        except BadRecord as e:
            out.append(("error", e.reason, f"{loc}: {e}"))
            continue
        truncated, had_assistant = len(ids) > max_len, bool(mask.any())
        ids, mask = ids[:max_len], mask[:max_len]  # (T,) with T <= max_len
        if not mask.any():
            reason = "truncated_away" if had_assistant else "no_assistant"
            out.append(("skip", reason, f"{loc}: no assistant token" + (" within --max-len" if had_assistant else "")))
            continue
        out.append(("ok", rid, ids, mask, truncated, sum(m.get("finish_reason") == "length" for m in messages)))
    return out


def _items(files: list[Path]) -> Iterator[tuple]:
    """Work items in input order, with ids made unique: exact duplicates skipped, conflicting ones bad."""
    seen: dict[str, int] = {}  # id -> 64 bits of the conversation's digest: ~100 bytes per record in memory
    for loc, item in iter_records(files):
        if isinstance(item, BadRecord):
            yield ("error", item.reason, str(item))
            continue
        rid, messages, digest = item
        h = int(digest[:16], 16)
        if rid not in seen:
            seen[rid] = h
            yield ("rec", loc, rid, messages)
        elif seen[rid] == h:
            yield ("skip", "duplicate", f"{loc}: duplicate of an earlier record with id {rid!r}")
        else:
            yield ("error", "conflicting_id", f"{loc}: id: {rid!r} is already used by an earlier, different "
                                              "conversation")


def _ordered_map(fn, chunks: Iterator[list], pool, depth: int) -> Iterator[list]:
    """map(fn, chunks) in order with at most `depth` chunks in flight (Pool.imap would read the whole input)."""
    if pool is None:
        yield from map(fn, chunks)
        return
    pending: deque = deque()
    for c in chunks:
        pending.append(pool.apply_async(fn, (c,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def record_batch(rids: list[str], ids: list[np.ndarray], masks: list[np.ndarray]):
    """One Arrow RecordBatch of prepared rows: id (string), input_ids (list of int32), loss_mask (list of int8)."""
    import pyarrow as pa

    offsets = np.zeros(len(ids) + 1, dtype=np.int32)  # (B+1,) one chunk: far below 2**31 tokens
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    return pa.RecordBatch.from_arrays(
        [pa.array(rids, pa.string()),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(ids))),
         pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(masks)))],
        names=["id", "input_ids", "loss_mask"])


def check_answers_kwargs(files: list[Path], kwargs: dict) -> None:
    """Refuse answers `hstap generate` made under other chat-template kwargs than this run renders with (their
    `<file>.config.json`: a thinking target's answers rendered with thinking off, or the reverse, are not what the
    server will run)."""
    from hstap.data.fits import check_template_kwargs

    for f in files:
        run = f.with_name(f.name + ".config.json")
        try:
            meta = json.loads(run.read_text()) if run.is_file() else None
        except (OSError, ValueError):
            continue  # not readable: not a generate run's config
        if isinstance(meta, dict) and meta.get("stage") == "generate" and isinstance(meta.get("config"), dict):
            got = template_kwargs(meta["config"].get("chat_template_kwargs"), f"{run}: chat_template_kwargs")
            check_template_kwargs(f"{f} (hstap generate, {run.name})", got, kwargs, "--chat-template-kwargs")



def prepare(cfg: PrepareConfig) -> dict:
    """Tokenize cfg.data into cfg.out (see the module docstring); prints and returns a summary."""
    t0 = time.perf_counter()
    out = check_new_out(cfg.out, "prepare")
    files = expand_paths(cfg.data)
    kwargs = template_kwargs(cfg.chat_template_kwargs)
    check_answers_kwargs(files, kwargs)
    tok = load_tokenizer(cfg.tokenizer, cfg.chat_template)
    template = chat_template_of(tok, cfg.chat_template or cfg.tokenizer)
    try:  # a template the mask rule cannot follow fails here once, not once per record
        assistant_spans(tok, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}], kwargs)
    except BadRecord as e:
        raise HstapError(f"{cfg.chat_template or cfg.tokenizer}: {e}") from None
    with publishing_dir(out, refusal="appeared while preparing; the result is not moved there") as tmp:
        summary = _prepare_into(cfg, files, tok, template, tmp)
    elapsed = time.perf_counter() - t0
    summary.update(out=str(out), elapsed_s=round(elapsed, 3), num_proc=cfg.num_proc,
                   samples_per_s=round(summary["written"] / elapsed, 1),
                   tokens_per_s=round(summary["total_tokens"] / elapsed, 1))
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(summary["skipped"].items())) or "none"
    dv = summary["draft_vocab"]
    print(f"prepare: {summary['read']} read, {summary['written']} written ({summary['truncated']} truncated to "
          f"{cfg.max_len} tokens), {summary['skipped_total']} skipped ({skipped})")
    print(f"prepare: {summary['total_tokens']} tokens, {summary['masked_tokens']} loss-masked; {elapsed:.2f} s with "
          f"{cfg.num_proc} process(es): {summary['samples_per_s']:.0f} samples/s, "
          f"{summary['tokens_per_s']:.0f} tokens/s")
    note = f" (asked {cfg.draft_vocab}: clamped to the vocabulary, identity map)" if dv < cfg.draft_vocab else ""
    print(f"prepare: draft vocab {dv}{note} covers {summary['coverage_pct']:.2f}% of loss-masked tokens")
    seen = summary["distinct_masked_tokens"]
    if seen < dv < summary["vocab_size"]:  # a map mostly of padding (an identity map, the whole vocabulary, is none)
        print(f"hstap prepare: warning: the draft vocabulary ({dv}) is larger than the {seen:,} distinct tokens the "
              f"answers hold: {dv - seen:,} of its slots are tokens never seen in training (a draft head that size "
              f"only costs; --draft-vocab {seen} or less, or more data)", file=sys.stderr)
    if summary["cut_answers"]:
        print(f"prepare: {summary['cut_answers']} answers were cut at generate's token limit: trained up to the cut, "
              "no closing token after it")
    print(f"prepare: wrote {out}")
    return summary


def _prepare_into(cfg: PrepareConfig, files: list[Path], tok, template: str, tmp: Path) -> dict:
    import datasets
    import pyarrow as pa
    from safetensors.numpy import save as st_save
    from tqdm import tqdm

    V = len(tok)
    freq = np.zeros(V, dtype=np.int64)  # (V,)
    batches, skipped = [], Counter()
    counts = Counter(read=0, written=0, truncated=0, total_tokens=0, cut_answers=0)
    items = _items(files)
    chunks = iter(lambda: list(islice(items, CHUNK)), [])
    kwargs = template_kwargs(cfg.chat_template_kwargs)
    _init_worker(tok, cfg.max_len, kwargs)
    pool = None
    if cfg.num_proc > 1:
        # fork: workers inherit the loaded tokenizer and imported modules (no per-worker import of transformers).
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(cfg.num_proc, initializer=_init_worker, initargs=(tok, cfg.max_len, kwargs))
    try:
        bar = tqdm(unit=" samples", disable=None, desc="prepare", file=sys.stderr)
        for results in _ordered_map(_work, chunks, pool, 4 * cfg.num_proc):
            rids, ids, masks = [], [], []
            for r in results:
                counts["read"] += 1
                if r[0] == "ok":
                    rids.append(r[1])
                    ids.append(r[2])
                    masks.append(r[3])
                    counts["truncated"] += r[4]
                    counts["cut_answers"] += r[5]
                elif r[0] == "error" and cfg.on_error == "fail":
                    raise HstapError(r[2])
                else:
                    count_skip(skipped, r[1], r[2], warn=r[0] == "error")
            if rids:
                batches.append(record_batch(rids, ids, masks))
                flat_ids, flat_mask = np.concatenate(ids), np.concatenate(masks)  # (sum T,)
                freq += np.bincount(flat_ids[flat_mask.astype(bool)], minlength=V)
                counts["written"] += len(rids)
                counts["total_tokens"] += len(flat_ids)
            bar.update(len(results))
        bar.close()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER.clear()
    skipped.pop(None, None)
    if counts["written"] == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "no records"
        raise HstapError(f"{', '.join(map(str, cfg.data))}: no sample with an assistant token to write ({reasons})")

    schema = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    ds = datasets.Dataset(datasets.table.InMemoryTable(pa.Table.from_batches(batches, schema=schema)))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(tmp))
    finally:
        if bars:
            datasets.enable_progress_bars()

    d2t, t2d = build_vocab_map(freq, cfg.draft_vocab)
    check_vocab_map(d2t, t2d, V)
    masked = int(freq.sum())
    coverage = 100.0 * float(freq[t2d].sum()) / masked
    atomic_write_bytes(tmp / "token_freq.safetensors", st_save({"token_freq": freq}))
    write_vocab_map(tmp / VOCAB_MAP_FILE, d2t, t2d)
    summary = {
        "read": counts["read"], "written": counts["written"], "truncated": counts["truncated"],
        "cut_answers": counts["cut_answers"], "distinct_masked_tokens": int((freq > 0).sum()), "vocab_size": V,
        "skipped": dict(sorted(skipped.items())), "skipped_total": sum(skipped.values()),
        "masked_tokens": masked, "total_tokens": counts["total_tokens"],
        "draft_vocab": len(d2t), "coverage_pct": round(coverage, 4),
    }
    meta = {
        "format": "hstap-prepared", "format_version": 1,
        "tokenizer": cfg.tokenizer, "tokenizer_sha256": tokenizer_sha256(tok),
        "chat_template": cfg.chat_template or "tokenizer", "chat_template_sha256": chat_template_sha256(template),
        "chat_template_kwargs": kwargs,
        "vocab_size": V, "max_len": cfg.max_len, "data": [str(f) for f in files],
        "counts": {k: summary[k] for k in ("read", "written", "truncated", "skipped", "skipped_total",
                                           "masked_tokens", "total_tokens", "cut_answers")},
        "draft_vocab": {"requested": cfg.draft_vocab, "size": len(d2t), "clamped": len(d2t) < cfg.draft_vocab,
                        "distinct_masked_tokens": int((freq > 0).sum()), "coverage_pct": summary["coverage_pct"]},
    }
    atomic_write_json(tmp / "meta.json", meta)
    write_run_config(tmp, "prepare", cfg)
    return summary
