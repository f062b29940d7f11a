"""Record a short CPU training trajectory (offline on a store and online on a live target), as a behaviour fingerprint.

    python benchmarks/trajectory.py --out /tmp/traj.json            # record
    python benchmarks/trajectory.py --compare /tmp/traj.json        # record again and compare exactly

Builds a tiny random Llama target, a prepared set of stdlib-documentation chats and an fp32 store in a temp dir (all
seeded), then trains 20 steps offline and 20 steps online (same seed, CPU, fp32, one thread) and records every logged
loss, per-step losses and accuracies. A refactoring that changes no behaviour reproduces the numbers exactly. Ends with
one JSON line: {"offline": [...], "online": [...], "equal": true|false|null}.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
from pathlib import Path

import torch


def build(root: Path) -> dict:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import prepare
    from hstap.demo.toy import build_random_target, build_tokenizer, sample_texts, stdlib_conversations

    tok = build_tokenizer(sample_texts(), vocab_size=400, out_dir=root / "tok")
    target = root / "target"
    model = build_random_target(target, tok, model_type="llama", num_layers=6, hidden_size=64, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.save_pretrained(str(target))
    rng = random.Random(0)
    convs = stdlib_conversations()
    rng.shuffle(convs)
    lines = []
    for c in convs[:28]:
        user, asst = c["conversations"]
        lines.append(json.dumps({"id": c["id"], "conversations": [
            user, {"role": "assistant", "content": asst["content"][:rng.randint(40, 240)]}]}))
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare(PrepareConfig(tokenizer=str(target), data=[str(root / "chats.jsonl")], out=str(root / "prepared"),
                              draft_vocab=96))
        capture(CaptureConfig(target=str(target), data=str(root / "prepared"), out=str(root / "store"),
                              layers="1,3,4", dtype="fp32", device="cpu", batch_tokens=4096))
    return {"target": str(target), "prepared": str(root / "prepared"), "store": str(root / "store")}


def run(a: dict, root: Path, online: bool) -> list[dict]:
    from hstap.config import from_flags
    from hstap.train.config import TrainConfig
    from hstap.train.stage import train

    kw = dict(target=a["target"], out=str(root / ("online" if online else "offline")), steps=20, batch_tokens=600,
              ttt=3, lr=3e-3, warmup_ratio=0.015, min_lr_ratio=0.0, log_every=1, save_every=10, eval_frac=0.2,
              skip_verify=True, device="cpu", seed=0, tensorboard=False,
              loss="ce", ttt_decay=0.8)  # the schedule and objective of the recorded trajectory
    kw |= dict(online=True, data=a["prepared"], aux_layers="1,3,4") if online else dict(store=a["store"], data=a["prepared"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(from_flags(TrainConfig, **kw))
    rows = [json.loads(x) for x in (Path(kw["out"]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    keep = ("step", "loss", "loss_k", "acc", "grad_norm", "lr", "eval_loss", "eval_acc")
    return [{k: r[k] for k in keep if k in r} | ({"eval": True} if r.get("eval") else {}) for r in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the trajectory JSON here")
    p.add_argument("--compare", help="compare against this recorded trajectory (exact equality)")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        a = build(root)
        traj = {"offline": run(a, root, False), "online": run(a, root, True)}
    equal = None
    if args.compare:
        ref = json.loads(Path(args.compare).read_text())
        equal = ref == traj
        for mode in ("offline", "online"):
            for r0, r1 in zip(ref[mode], traj[mode]):
                if r0 != r1:
                    print(f"{mode}: first difference at {r0} != {r1}", file=sys.stderr)
                    break
    if args.out:
        Path(args.out).write_text(json.dumps(traj, indent=1) + "\n")
    print(json.dumps({"offline": [r.get("loss", r.get("eval_loss")) for r in traj["offline"]],
                      "online": [r.get("loss", r.get("eval_loss")) for r in traj["online"]], "equal": equal}))
    return 0 if equal in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
