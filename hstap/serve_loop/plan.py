"""What a serve loop resolved from its config and inputs: `ServeLoopPlan`, made once by `resolve` before anything is
written, and recorded as OUT/plan.json beside OUT/config.json (the config as parsed, never changed).

`resolve` reads each input once, in this order: the device and the server's dtype; the target (its HF config, its
fingerprint: layers, hidden size, vocabulary, tokenizer and chat template hashes; its tokenizer and generation
config); the requests' prompts (rendered with the target's chat template, checked against --requests and
--max-model-len) and the ids that end an answer; --reference (a --mode target run's outputs); --server-cpus and
--trainer-cpus; the start drafter: a --drafter checked against the target (`hstap.export.fit.check_drafter_target`,
its drafter.json read once: the layers it taps, its decoder layers) and its draft vocabulary, or the one started from
nothing (--layers, else the default three; --vocab-map, else the whole vocabulary); last, --anchor-store against the
store the tap will write. The first bad input is one error line, and nothing is written.

The stage (`hstap.serve_loop.stage`), the trainer's config (`trainer_config`) and the server's arguments are built
from the plan; OUT/plan.json records it (`ServeLoopPlan.record`: the resolved facts, not the prompts' tokens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hstap.artifacts.vocab_map import VocabMap
from hstap.common import HstapError, one_line, read_record
from hstap.serve_loop.config import ServeLoopConfig, cpu_list

WHOLE_VOCABULARY = "the whole target vocabulary"
"""The draft vocabulary's source when a drafter started from nothing has no --vocab-map: draft id i is target id i."""


@dataclass(frozen=True, eq=False)
class ServeLoopPlan:
    """What this serve loop resolved (module docstring)."""

    device: str
    """Where vLLM and the trainer run: cpu or cuda (--device auto resolved)."""
    dtype: str
    """The server's dtype: fp32 or bf16 (--dtype auto resolved by the device)."""
    target: dict
    """The target's fingerprint (`hstap.artifacts.model_dir.target_fingerprint`: path, layers, hidden size,
    vocabulary, config / weights / tokenizer / chat template hashes)."""
    hf_config: object
    """The target's HF config (shapes a drafter started from nothing)."""
    prompts: list[list[int]]
    """The requests' prompt token ids, in order (--prompts, the first --requests)."""
    stop_ids: list[int]
    """The ids that end an answer (eos and end of turn), sent with each request."""
    reference: dict[int, list[int]] | None
    """{prompt index: output tokens} of --reference (None: no reference)."""
    drafter: Path | None
    """The start drafter's hstap directory (--drafter resolved: a RUN's best, else its newest checkpoint); None: the
    trainer's initialisation, or no drafter at all (--mode target)."""
    layers: tuple[int, ...]
    """The canonical aux layers the served drafter taps and the tap stores (() with --mode target)."""
    draft_layers: int
    """The start drafter's decoder layers (the trainer continues a drafter of this depth)."""
    vocab: VocabMap | None
    """The start drafter's draft vocabulary, the trainer's fixed one (None with --mode target)."""

    def record(self) -> dict:
        """OUT/plan.json."""
        vocab = None if self.vocab is None else {"source": self.vocab.source, "size": self.vocab.size,
                                                  "sha256": self.vocab.sha256()}
        return {"device": self.device, "dtype": self.dtype, "target": self.target, "requests": len(self.prompts),
                "longest_prompt": max(map(len, self.prompts)), "stop_ids": list(self.stop_ids),
                "reference": self.reference is not None,
                "drafter": str(self.drafter) if self.drafter is not None else None, "aux_layers": list(self.layers),
                "draft_layers": self.draft_layers, "vocab_map": vocab}


def resolve(cfg: ServeLoopConfig, out: Path) -> ServeLoopPlan:
    """The plan of a serve loop writing into `out` (module docstring); HstapError on the first bad input."""
    from hstap.artifacts.model_dir import load_config, load_tokenizer, target_fingerprint
    from hstap.device import auto_device, auto_dtype

    device = auto_device(cfg.device)
    dtype = auto_dtype(cfg.dtype, device)
    hf, tok, tb = load_config(cfg.target), load_tokenizer(cfg.target), target_fingerprint(cfg.target)
    prompts = request_prompts(cfg, tok)
    stops = stop_ids(cfg.target, hf, tok)
    reference = read_reference(cfg.reference, len(prompts)) if cfg.reference else None
    check_cpus(cfg)
    drafter, layers, draft_layers, vocab = None, (), 1, None
    if cfg.mode != "target":
        drafter, layers, draft_layers, vocab = start_drafter(cfg, hf, tb)
    plan = ServeLoopPlan(device=device, dtype=dtype, target=tb, hf_config=hf, prompts=prompts, stop_ids=stops,
                         reference=reference, drafter=drafter, layers=tuple(layers), draft_layers=draft_layers,
                         vocab=vocab)
    if cfg.stream.anchor_store and cfg.mode == "loop":
        check_anchor(cfg, plan, out)
    return plan


def stop_ids(target: str, hf_config, tokenizer) -> list[int]:
    """The ids that end an answer (eos and end of turn: `hstap.data.decode.stop_token_ids`), sent with each request:
    of the target's generation config (where it has one), HF config and tokenizer."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hstap.data.decode import stop_token_ids

    try:
        gen = GenerationConfig.from_pretrained(target)
    except OSError:
        gen = None
    return stop_token_ids(SimpleNamespace(generation_config=gen, config=hf_config), tokenizer)


def request_prompts(cfg: ServeLoopConfig, tokenizer) -> list[list[int]]:
    """The requests' prompt token ids, in order, checked against --requests and --max-model-len."""
    from hstap.data.prompts import load_prompts

    prompts = [p for _, p in load_prompts(cfg.prompts, tokenizer, cfg.requests or None)]
    if cfg.requests and len(prompts) < cfg.requests:
        raise HstapError(f"{cfg.prompts}: {len(prompts)} usable prompts, fewer than --requests {cfg.requests} (each "
                         "prompt is served once)")
    longest = max(map(len, prompts))
    if longest + cfg.max_tokens > cfg.max_model_len:
        raise HstapError(f"{cfg.prompts}: a prompt of {longest} tokens + --max-tokens {cfg.max_tokens} exceeds "
                         f"--max-model-len {cfg.max_model_len}")
    return prompts


def check_cpus(cfg: ServeLoopConfig) -> None:
    """--server-cpus / --trainer-cpus name CPUs of this machine (else taskset would fail only after start). Not this
    process's own affinity: it may be pinned to the trainer's CPUs itself."""
    have = set(range(os.cpu_count() or 1))
    for name in ("server_cpus", "trainer_cpus"):
        want = cpu_list(name, getattr(cfg, name))
        if want - have:
            raise HstapError(f"serve-loop: --{name.replace('_', '-')} {getattr(cfg, name)}: CPU(s) "
                             f"{sorted(want - have)} not on this machine (CPUs 0-{max(have)})")


def start_drafter(cfg: ServeLoopConfig, hf, tb: dict) -> tuple[Path | None, list[int], int, VocabMap]:
    """(its hstap directory or None, the layers it taps, its decoder layers, its draft vocabulary) of the drafter the
    server starts with. A --drafter is an hstap drafter (or RUN: the trainer continues it) made for this target
    (`hstap.export.fit.check_drafter_target`: vocabulary, hidden size, tapped layers, tokenizer); the one started from
    nothing taps --layers the target has, and its --vocab-map covers the target's vocabulary."""
    import torch

    if cfg.drafter:
        from safetensors import safe_open

        from hstap.artifacts.drafter_dir import resolve_drafter_dir
        from hstap.export.fit import check_drafter_target

        d = resolve_drafter_dir(cfg.drafter)
        facts = check_drafter_target(d, tb)
        with safe_open(str(d / "drafter.safetensors"), framework="pt") as f:
            vocab = VocabMap(f.get_tensor("d2t"), f.get_tensor("t2d"), str(d / "drafter.safetensors"))
        return d, list(facts["aux_layers"]), int(facts["num_layers"]), vocab
    from hstap.artifacts.vocab_map import load_vocab_map
    from hstap.layers import default_aux_layers, parse_layers

    N, V = int(hf.num_hidden_layers), int(hf.vocab_size)
    layers = parse_layers(cfg.layers, N, "serve-loop: --layers") if cfg.layers else default_aux_layers(N)
    if cfg.vocab_map:
        d2t, t2d = load_vocab_map(cfg.vocab_map)
        if t2d.numel() != V:
            raise HstapError(f"{cfg.vocab_map}: --vocab-map: covers {t2d.numel()} token ids, the target {cfg.target} "
                             f"has {V}: the map of another target")
    else:  # the whole vocabulary: draft id i is target id i
        d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    return None, layers, 1, VocabMap(d2t, t2d, cfg.vocab_map or WHOLE_VOCABULARY)


def check_anchor(cfg: ServeLoopConfig, plan: ServeLoopPlan, out: Path) -> None:
    """--anchor-store against the store the tap will write (the served drafter's layers, the target's hidden size and
    fingerprint, --tap-dtype), before anything is written: the trainer would refuse it only once serving has begun."""
    from hstap.train.follow import open_anchor

    header = {"layers": list(plan.layers), "hidden_size": int(plan.target["hidden_size"]), "dtype": cfg.tap_dtype,
              "target": plan.target}
    open_anchor(cfg.stream.anchor_store, str(out / "store"), header)


def read_reference(path: str, n: int) -> dict[int, list[int]]:
    """{prompt index: output tokens} of a --mode target run's served.jsonl (--reference), checked to be one: every line
    a record of a served request ("i", and its "tokens" or its "error"), every one of the `n` prompts served here
    recorded there (else the comparison would be of nothing), and, where its run record lies beside it, of a --mode
    target run. One line naming the file (and line) otherwise."""
    p = Path(path)
    if not p.is_file():
        raise HstapError(f"{p}: --reference: not a file (the served.jsonl of a --mode target run)")
    what = "--reference: not a served.jsonl of hstap serve-loop"
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise HstapError(f"{p}: {what} (not UTF-8 text)") from None
    out: dict[int, list[int]] = {}
    seen: set[int] = set()
    for k, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
            i = r["i"]
            if not isinstance(i, int) or isinstance(i, bool) or not ("tokens" in r or "error" in r):
                raise ValueError("a record has an integer \"i\" and its \"tokens\" or its \"error\"")
            if "tokens" in r:
                if not isinstance(r["tokens"], list) or not all(isinstance(t, int) for t in r["tokens"]):
                    raise ValueError("\"tokens\" is a list of token ids")
                out[i] = r["tokens"]
            seen.add(i)
        except (ValueError, KeyError, TypeError) as e:
            raise HstapError(f"{p}:{k}: {what} ({one_line(e)})") from None
    missing = [i for i in range(n) if i not in seen]
    if missing:
        raise HstapError(f"{p}: --reference: holds no answer to prompt {missing[0]} ({len(missing)} of the {n} served "
                         f"here are not in it): the reference of other prompts, or of fewer")
    rec = read_record(p.parent / "config.json")
    if rec is not None and rec["stage"] == "serve-loop" and (rec.get("config") or {}).get("mode") != "target":
        raise HstapError(f"{p}: --reference: served by a --mode {rec['config'].get('mode')} run "
                         f"({p.parent / 'config.json'}); the reference is a --mode target run's")
    return out
