"""`hstap demo`: the whole pipeline end to end on one machine, offline, in minutes on 2 CPU cores.

    hstap demo                                   # builds a toy target first (no model download, no ../shared)
    hstap demo --target DIR --data chats.jsonl   # your own target and conversations

Stages, each printing its own figures: (0) without --target, a toy target: a byte-level BPE tokenizer trained with
`tokenizers` and a small Llama trained for --target-minutes on chat data made from text that ships with Python (stdlib
docstrings and pydoc topics); (1) generate (optional, --generate: the target rewrites the assistant turns
so the drafter learns the target's own distribution); (2) prepare; (3) capture; (4) train an EAGLE-3 drafter; (5) eval: lossless
speculative decoding against target-only decoding and n-gram lookup, ending with the measured tau.

The demo calls the same stage functions as the CLI, with configs built here; each stage's outputs and config.json go
under --out, so any stage can be re-run by hand from there.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from hstap.common import HstapError, write_run_config


@dataclass
class DemoConfig:
    out: str = "hstap-demo"
    """Work directory for every stage's outputs (removed first when it holds an earlier demo)."""
    target: str | None = None
    """Target model directory; default: build and train a toy target under OUT/target."""
    data: list[str] | None = None
    """Conversation files (JSONL/JSON/Parquet); default: chat data made from Python's own documentation."""
    target_minutes: float = 2.5
    """Wall-clock minutes to train the toy target (only without --target)."""
    max_samples: int = 1200
    """Conversations used (the demo's data budget); 5% of them are held out as eval prompts."""
    generate: bool = False
    """Regenerate the assistant turns with the target before capture (slower; better acceptance)."""
    train_steps: int = 250
    """Drafter training steps."""
    ttt: int = 7
    """Training-time-test steps of the drafter."""
    lr: float = 3e-3
    """Drafter peak learning rate (a small drafter on little data trains well with a high rate)."""
    batch_tokens: int = 2048
    """Tokens per drafter micro-batch."""
    eval_prompts: int = 8
    """Prompts decoded in the eval stage."""
    max_new_tokens: int = 64
    """New tokens per eval prompt."""
    k: int = 5
    """Chain length of the speculative decoding eval."""
    device: str = field(default="auto", metadata={"choices": ["auto", "cpu", "cuda"]})
    """Device for every stage."""
    seed: int = 0
    """Seed of the toy target, the data split and the drafter."""

    def __post_init__(self):
        for name in ("max_samples", "train_steps", "ttt", "batch_tokens", "eval_prompts", "max_new_tokens", "k"):
            if getattr(self, name) < 1:
                raise HstapError(f"demo: --{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.target_minutes <= 0:
            raise HstapError("demo: --target-minutes: must be > 0")


def _stage(n: int, title: str) -> float:
    print(f"\n=== [{n}] {title} ===", flush=True)
    return time.time()


def _done(t0: float, figures: str) -> None:
    print(f"--> {figures} ({time.time() - t0:.1f} s)", flush=True)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def build_toy_target(out: Path, records: list[dict], minutes: float, seed: int) -> dict:
    """Tokenizer + small Llama trained on the chat-rendered records; saved to `out`."""
    from hstap.toy import build_tokenizer, train_toy_target

    texts = [m["content"] for r in records for m in r["conversations"]]
    tok = build_tokenizer(texts, vocab_size=1024)
    chats = [tok.apply_chat_template(r["conversations"], tokenize=False) for r in records]
    # 8 layers: the default EAGLE-3 taps [1, N//2-1, N-4] = [1, 3, 4] are distinct
    return train_toy_target(out, tok, chats, minutes=minutes, num_layers=8, hidden_size=96, num_heads=4,
                            num_kv_heads=2, intermediate_size=256, seq_len=256, batch_size=8, lr=3e-3, seed=seed,
                            log=lambda s: print(s, flush=True))


def demo(cfg: DemoConfig) -> dict:
    from hstap.capture import CaptureConfig, capture
    from hstap.conversations import read_conversations
    from hstap.data import PrepareConfig, prepare
    from hstap.evaluate import EvalConfig, evaluate
    from hstap.train import TrainConfig, train

    t_start = time.time()
    out = Path(cfg.out).resolve()
    if out.exists():
        if not (out / "demo.json").exists() and any(out.iterdir()):
            raise HstapError(f"{out}: exists and is not an earlier hstap demo; choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_run_config(out, "demo", cfg)
    device = cfg.device

    # data: conversations -> train / eval split (by a seeded shuffle)
    if cfg.data:
        records = [{"id": i, "conversations": m} for i, m in read_conversations(cfg.data)]
    else:
        from hstap.toy import stdlib_conversations
        records = stdlib_conversations(max_chars=700)
    random.Random(cfg.seed).shuffle(records)
    records = records[: cfg.max_samples]
    n_eval = max(cfg.eval_prompts, len(records) // 20)
    if len(records) < n_eval + 10:
        raise HstapError(f"demo: need at least {n_eval + 10} conversations, got {len(records)}")
    train_recs, eval_recs = records[n_eval:], records[:n_eval]
    _write_jsonl(out / "train.jsonl", train_recs)
    _write_jsonl(out / "eval.jsonl", eval_recs)
    summary: dict = {"conversations": {"train": len(train_recs), "eval": len(eval_recs)}}

    target = cfg.target
    if target is None:
        t0 = _stage(0, f"toy target: tokenizer + 8-layer Llama trained for {cfg.target_minutes:g} min on "
                       f"{len(train_recs)} conversations")
        target = str(out / "target")
        r = build_toy_target(Path(target), train_recs, cfg.target_minutes, cfg.seed)
        summary["toy_target"] = r
        _done(t0, f"{r['steps']} steps, {r['tokens']:,} tokens, loss {r['loss']:.2f}")

    data_file = out / "train.jsonl"
    if cfg.generate:
        from hstap.generate import GenerateConfig, generate
        t0 = _stage(1, "generate: the target rewrites the assistant turns (greedy)")
        g = generate(GenerateConfig(data=[str(data_file)], out=str(out / "train.generated.jsonl"), target=target,
                                    max_new_tokens=200, device=device if device != "auto" else "cpu"))
        summary["generate"] = {k: g.get(k) for k in ("conversations", "generated_tokens", "tokens_per_s")}
        _done(t0, f"{g.get('generated_tokens')} tokens generated")
        data_file = out / "train.generated.jsonl"

    t0 = _stage(2, "prepare: chat template -> input_ids + assistant loss_mask + draft vocabulary")
    p = prepare(PrepareConfig(tokenizer=target, data=[str(data_file)], out=str(out / "prepared"), max_len=1024,
                              draft_vocab=512))
    summary["prepare"] = {k: p.get(k) for k in ("written", "total_tokens", "masked_tokens", "coverage_pct")}
    _done(t0, f"{p.get('written')} samples, {p.get('total_tokens'):,} tokens, draft vocab covers "
              f"{p.get('coverage_pct', 0):.1f}% of assistant tokens")

    t0 = _stage(3, "capture: prefill the target, tap aux layers + final state into the shard store")
    c = capture(CaptureConfig(target=target, data=str(out / "prepared"), out=str(out / "store"), dtype="bf16",
                              device=device, batch_tokens=8192))
    summary["capture"] = c
    _done(t0, "store written")

    t0 = _stage(4, f"train: EAGLE-3 drafter, TTT {cfg.ttt}, {cfg.train_steps} steps")
    tr = train(TrainConfig(out=str(out / "run"), target=target, store=str(out / "store"),
                           vocab_map=str(out / "prepared"), steps=cfg.train_steps, ttt=cfg.ttt, lr=cfg.lr,
                           batch_tokens=cfg.batch_tokens, eval_every=max(1, cfg.train_steps // 2),
                           save_every=max(1, cfg.train_steps // 2), log_every=20, device=device, seed=cfg.seed,
                           tensorboard=False))
    summary["train"] = tr
    _done(t0, f"simulated acceptance (teacher-forced, eval split): {tr.get('best_sim_tau')}")

    t0 = _stage(5, f"eval: lossless speculative decoding, chain k={cfg.k}, vs target-only and n-gram lookup")
    ev = evaluate(EvalConfig(target=target, data=str(out / "eval.jsonl"), out=str(out / "eval"),
                             drafter=str(out / "run"), mode="chain", k=cfg.k, max_new_tokens=cfg.max_new_tokens,
                             num_prompts=cfg.eval_prompts, baseline="ngram", device=device, dtype="fp32"))
    summary["eval"] = ev
    _done(t0, "report in " + str(out / "eval"))

    total = time.time() - t_start
    summary["seconds"] = round(total, 1)
    (out / "demo.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"\nhstap demo: tau = {ev.get('tau'):.3f} tokens per target forward (EAGLE-3 chain k={cfg.k}, greedy, "
          f"lossless: {ev.get('lossless')}); everything is under {out} ({total / 60:.1f} min)")
    return summary
