"""`hstap demo`: the whole pipeline end to end on one machine, in about ten minutes on 2 CPU cores.

    hstap demo                                   # builds a toy target first (no model download, no ../shared)
    hstap demo --target DIR --data chats.jsonl   # your own target and conversations

Stages, each printing its own figures: (0) without --target, a toy target: a byte-level BPE tokenizer trained with
`tokenizers` and a small Llama trained for --target-steps steps on chat data made from text that ships with Python
(stdlib docstrings of functions, classes and methods, and pydoc topics), then checked: its greedy next-token
accuracy on the held-out conversations (a drafter can only learn what the target predicts; a target below
MIN_TOY_ACCURACY is reported as too weak to draft for); (1) generate (--generate, on by default: the target rewrites
the assistant turns, greedy, so the drafter learns the target's own outputs, as SpecForge and EAGLE recommend); (2)
prepare; (3) capture; (4) train an EAGLE-3 drafter; (5) eval: lossless speculative decoding against target-only
decoding and n-gram lookup on the held-out prompts, ending with the measured tau (tokens per target forward, the
bonus token included) and a table of every stage.

Deterministic: the toy target is bounded by steps, never by wall clock; every stage is seeded (--seed) and the demo's
compute runs on --threads torch threads (capped by the CPU count), so that the same seed prints the same figures on a
loaded machine as on an idle one (timings aside).

The demo calls the same stage functions as the CLI, with configs built here; each stage's outputs and config.json go
under --out, so any stage can be re-run by hand from there.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

from hstap.common import HstapError, atomic_write_bytes, write_run_config
from hstap.demo.config import DemoConfig
from hstap.artifacts.outputs import check_not_input, check_out_dir

MIN_TOY_ACCURACY = 0.25  # the toy target's greedy next-token accuracy on held-out text below which drafting is moot


def _stage(n: int, title: str) -> float:
    print(f"\n=== [{n}] {title} ===", flush=True)
    return time.perf_counter()


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rel(p: Path | str) -> str:
    """A path as the user would type it: relative to the working directory when under it."""
    p = Path(p)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def build_toy_target(out: Path, records: list[dict], steps: int, seed: int) -> dict:
    """Tokenizer + small Llama trained on the chat-rendered records for `steps` steps; saved to `out`."""
    from hstap.demo.toy import build_tokenizer, train_toy_target

    texts = [m["content"] for r in records for m in r["conversations"]]
    tok = build_tokenizer(texts, vocab_size=1024)
    chats = [tok.apply_chat_template(r["conversations"], tokenize=False) for r in records]
    # 8 layers: the default EAGLE-3 taps [1, N//2-1, N-4] = [1, 3, 4] are distinct
    return train_toy_target(out, tok, chats, steps=steps, num_layers=8, hidden_size=96, num_heads=4,
                            num_kv_heads=2, intermediate_size=256, seq_len=256, batch_size=8, lr=3e-3, seed=seed,
                            log=lambda s: print(s, flush=True))


def check_toy_target(target: str, records: list[dict]) -> dict:
    """The toy target's greedy next-token accuracy on the held-out conversations (chat-rendered), printed with what
    it means; `weak` when it is below MIN_TOY_ACCURACY."""
    from hstap.artifacts.model_dir import load_target
    from hstap.demo.toy import next_token_accuracy

    tgt, tok = load_target(target, device="cpu", dtype="fp32")
    chats = [tok.apply_chat_template(r["conversations"], tokenize=False) for r in records]
    acc = next_token_accuracy(tgt.model, tok, chats)
    r = {"accuracy": acc["accuracy"], "heldout_tokens": acc["tokens"], "weak": acc["accuracy"] < MIN_TOY_ACCURACY}
    print(f"toy target check: greedy next-token accuracy {100 * r['accuracy']:.1f}% on {r['heldout_tokens']:,} "
          f"tokens of {len(records)} held-out conversations (how often its top guess is the real next token; a "
          f"drafter can only learn what the target predicts)", flush=True)
    if r["weak"]:
        print(f"toy target check: WARNING: below {100 * MIN_TOY_ACCURACY:.0f}%, this target is too weak to draft for: "
              "expect tau near 1.0 (train it longer: --target-steps)", flush=True)
    return r


def split_records(cfg: DemoConfig) -> tuple[list[dict], list[dict]]:
    """The demo's conversations (--data, else Python's documentation), shuffled by --seed, cut to --max-samples and
    split into (train, held-out eval)."""
    from hstap.data.conversations import read_conversations

    if cfg.data:
        records = [{"id": i, "conversations": m} for i, m in read_conversations(cfg.data)]
    else:
        from hstap.demo.toy import stdlib_conversations
        records = stdlib_conversations(max_chars=700, extended=True)
    random.Random(cfg.seed).shuffle(records)
    records = records[: cfg.max_samples]
    n_eval = max(cfg.eval_prompts, len(records) // 20)
    if len(records) < n_eval + 10:
        raise HstapError(f"demo: need at least {n_eval + 10} conversations, got {len(records)}")
    return records[n_eval:], records[:n_eval]


def stage_configs(cfg: DemoConfig, out: Path) -> dict:
    """The config of every stage the demo runs, built before any work: a value a stage refuses (`--train.lr 0`) is one
    line at the start, not after the toy target has trained for minutes."""
    from hstap.capture.config import CaptureConfig
    from hstap.data.generate_config import GenerateConfig
    from hstap.data.prepare_config import PrepareConfig
    from hstap.speculative.config import Decoding, EvalConfig
    from hstap.train.config import Devices, TrainConfig, TrainInputs

    target, device = cfg.target or str(out / "target"), cfg.device
    data = out / ("train.generated.jsonl" if cfg.generate else "train.jsonl")
    return {
        "generate": GenerateConfig(data=[str(out / "train.jsonl")], out=str(out / "train.generated.jsonl"),
                                   target=target, max_new_tokens=cfg.generate_tokens, batch_size=64,
                                   device=device if device != "auto" else "cpu"),
        "prepare": PrepareConfig(tokenizer=target, data=[str(data)], out=str(out / "prepared"), max_len=1024,
                                 draft_vocab=512),
        "capture": CaptureConfig(target=target, data=str(out / "prepared"), out=str(out / "store"), dtype="bf16",
                                 device=device, batch_tokens=8192),
        # no --vocab-map: train takes the prepared set's map from the store (capture copied it there)
        "train": TrainConfig(out=str(out / "run"), target=target, hyper=cfg.train,
                             inputs=TrainInputs(store=str(out / "store")), devices=Devices(device=device),
                             seed=cfg.seed, tensorboard=False),
        "eval": EvalConfig(target=target, data=str(out / "eval.jsonl"), out=str(out / "eval"),
                           drafter=str(out / "run"), decode=Decoding(mode="chain", k=cfg.k,
                                                                     max_new_tokens=cfg.max_new_tokens),
                           num_prompts=cfg.eval_prompts, baseline="ngram", device=device, dtype="fp32"),
    }


def demo(cfg: DemoConfig) -> dict:
    import torch

    from hstap.capture.stage import capture
    from hstap.data.prepare import prepare
    from hstap.speculative.evaluate import evaluate
    from hstap.train.stage import train

    t_start = time.perf_counter()
    out = Path(cfg.out).resolve()
    check_not_input(out, [("--target", cfg.target)] + [("--data", d) for d in cfg.data or []])
    replace = check_out_dir(out, "demo", None)  # an earlier demo's directory (its run record says so) is replaced
    try:
        configs = stage_configs(cfg, out)
    except HstapError as e:
        raise HstapError(f"demo: {e}") from None
    train_recs, eval_recs = split_records(cfg)  # --data read (and refused) before anything is written
    if replace:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_run_config(out, "demo", cfg)
    threads = min(cfg.threads, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bars: noise between the stages

    _write_jsonl(out / "train.jsonl", train_recs)
    _write_jsonl(out / "eval.jsonl", eval_recs)
    summary: dict = {"conversations": {"train": len(train_recs), "eval": len(eval_recs)}, "threads": threads,
                     "seconds_by_stage": {}}
    secs = summary["seconds_by_stage"]
    rows: list[list[str]] = []

    target = cfg.target
    if target is None:
        t0 = _stage(0, f"toy target: tokenizer + 8-layer Llama, {cfg.target_steps} steps on {len(train_recs)} "
                       f"conversations ({threads} threads)")
        target = str(out / "target")
        r = build_toy_target(Path(target), train_recs, cfg.target_steps, cfg.seed)
        r.update(check_toy_target(target, eval_recs))
        summary["toy_target"] = r
        secs["target"] = time.perf_counter() - t0
        rows.append(["target", f"toy Llama, {r['steps']} steps",
                     f"loss {r['loss']:.2f}, next-token accuracy {100 * r['accuracy']:.1f}% held out"
                     + (" (TOO WEAK)" if r["weak"] else ""), _rel(target)])

    if cfg.generate:
        _generate(configs["generate"], summary, rows)

    t0 = _stage(2, "prepare: chat template -> input_ids + assistant loss_mask + draft vocabulary")
    p = prepare(configs["prepare"])
    summary["prepare"] = {k: p.get(k) for k in ("written", "total_tokens", "masked_tokens", "draft_vocab",
                                                "coverage_pct")}
    secs["prepare"] = time.perf_counter() - t0
    rows.append(["prepare", f"{p['written']} samples tokenized",
                 f"{p['total_tokens']:,} tokens; draft vocab {p['draft_vocab']} ({p['coverage_pct']:.1f}% of answers)",
                 _rel(out / "prepared")])

    t0 = _stage(3, "capture: prefill the target, tap aux layers + final state into the shard store")
    c = capture(configs["capture"])
    summary["capture"] = c
    secs["capture"] = time.perf_counter() - t0
    rows.append(["capture", f"layers {c['layers']} + final, {c['dtype']}",
                 f"{c['store_tokens']:,} tokens, {c['store_bytes'] / 1e6:.1f} MB, {c['tokens_per_s']:,.0f} tokens/s",
                 _rel(out / "store")])

    t0 = _stage(4, f"train: EAGLE-3 drafter, TTT {cfg.train.ttt}, {cfg.train.steps} steps")
    tr = train(configs["train"])
    summary["train"] = tr
    secs["train"] = time.perf_counter() - t0
    rows.append(["train", f"EAGLE-3, TTT {cfg.train.ttt}, {tr['steps']} steps",
                 f"loss {tr['loss']:.2f}, sim tau {tr['best_sim_tau'] or 0:.3f} (chain of {cfg.train.ttt})",
                 _rel(out / "run") + " (best/, curves.png)"])

    t0 = _stage(5, f"eval: lossless speculative decoding, chain k={cfg.k}, vs target-only and n-gram lookup")
    ev = evaluate(configs["eval"])
    summary["eval"] = ev
    secs["eval"] = time.perf_counter() - t0
    ngram = ev["methods"]["ngram"]["tau"]
    rows.append(["eval", f"{ev['num_prompts']} held-out prompts, k={cfg.k}",
                 f"tau {ev['tau']:.3f} (n-gram {ngram:.3f}), lossless: {'yes' if ev['lossless'] else 'NO'}",
                 _rel(out / "eval") + " (report.md, acceptance.png)"])

    total = time.perf_counter() - t_start
    summary["seconds"] = round(total, 1)
    atomic_write_bytes(out / "demo.json", (json.dumps(summary, indent=1, default=str) + "\n").encode())
    _print_table(rows, secs, ev, cfg, out, total)
    return summary


def _generate(gcfg, summary: dict, rows: list) -> None:
    """Stage 1: the target's greedy answers to the training prompts (`gcfg`: its GenerateConfig)."""
    from hstap.data.generate import generate

    t0 = _stage(1, "generate: the target rewrites the training answers (greedy)")
    g = generate(gcfg)
    dst = gcfg.out
    summary["generate"] = {k: g.get(k) for k in ("conversations", "generated_tokens", "tokens_per_s")}
    summary["seconds_by_stage"]["generate"] = time.perf_counter() - t0
    rows.append(["generate", f"{g['conversations']} greedy answers",
                 f"{g['generated_tokens']:,} tokens, {g['tokens_per_s'] or 0:,.0f} tokens/s", _rel(dst)])


def _print_table(rows: list[list[str]], secs: dict, ev: dict, cfg: DemoConfig, out: Path, total: float) -> None:
    from hstap.console import table

    timed = [r[:1] + [f"{secs[r[0]]:.0f} s"] + r[1:] for r in rows]
    print("\n=== hstap demo: done ===\n" + table(["stage", "time", "what was done", "figures", "outputs"], timed))
    ngram = ev["methods"]["ngram"]["tau"]
    verdict = "above" if ev["tau"] > ngram else "NOT above"
    print(f"\nhstap demo: tau = {ev['tau']:.3f} tokens per target forward (EAGLE-3 chain k={cfg.k}, greedy, lossless: "
          f"{'yes' if ev['lossless'] else 'NO'}), {verdict} n-gram lookup's {ngram:.3f}; {total / 60:.1f} min in all")
    print("  tau = the drafts the target accepted + its own next token, per target forward (1.0 = no draft accepted).")
    if ev.get("speedup_notes"):
        why = "; ".join(n.split(":")[0] for n in ev["speedup_notes"])  # each note's first clause
        print(f"  speedup {ev['speedup']:.2f}x is not representative here ({why}): "
              f"{_rel(out / 'eval' / 'report.md')} says why")
    print(f"  plots: {_rel(out / 'eval' / 'acceptance.png')}, {_rel(out / 'run' / 'curves.png')}", flush=True)
