"""Decoding with the target in this process: `generate_batch` continues a batch of prompts (left-padded, one KV cache,
finished rows dropped from the batch; greedy or temperature + top-p sampling, settings per row; a conversation's KV
cache kept across its turns in a `Prefix`, so that each turn prefills only what it adds), `EmbeddedEngine` turns chat
messages into text with it, and `stop_token_ids` says which tokens end an assistant turn.

Used by `hstap generate`'s embedded engine (hstap/data/generate.py), the OpenAI-compatible test server (hstap/data/serve.py) and
`hstap eval` (stop tokens). Sampling draws from a per-row generator, so a row's output never depends on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hstap.common import HstapError

# End-of-turn markers of common chat templates, used as stops when the tokenizer has them as a single token; the
# tokenizer's eos and generation_config.eos_token_id are always stops.
_END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                "<\uff5cend\u2581of\u2581sentence\uff5c>")


def stop_token_ids(model, tokenizer) -> list[int]:
    """Ids that end an assistant turn: generation_config/config eos ids, the tokenizer's eos, end-of-turn markers."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in _END_OF_TURN if t in vocab)
    return sorted(ids)


def _pick(logits, temps: list[float], top_ps: list[float], gens: list):
    """Next token per row of logits (b, V) float32: argmax where temp == 0, else temperature + top-p sampling with the
    row's own generator (inverse CDF on one uniform draw, so a row's choice never depends on the other rows)."""
    import torch

    greedy = logits.argmax(-1)  # (b,)
    if not any(t > 0 for t in temps):
        return greedy
    dev = logits.device
    t = torch.tensor([max(x, 1e-6) for x in temps], device=dev, dtype=torch.float32)[:, None]  # (b, 1)
    probs = torch.softmax(logits / t, dim=-1)  # (b, V)
    sp, si = probs.sort(dim=-1, descending=True)  # (b, V)
    top = torch.tensor(top_ps, device=dev, dtype=torch.float32)[:, None]  # (b, 1)
    sp = sp.masked_fill(sp.cumsum(-1) - sp >= top, 0.0)  # drop tokens past the nucleus; the top-1 always stays
    cum = sp.cumsum(-1)  # (b, V)
    u = torch.tensor([float(torch.rand((), generator=g)) if g is not None else 0.0 for g in gens],
                     dtype=torch.float32).to(dev)[:, None] * cum[:, -1:]  # (b, 1)
    k = torch.searchsorted(cum, u, right=True).clamp(max=logits.shape[-1] - 1)  # (b, 1)
    sampled = si.gather(-1, k)[:, 0]  # (b,)
    return torch.where(torch.tensor([x > 0 for x in temps], device=dev), sampled, greedy)


@dataclass
class Prefix:
    """One conversation's KV cache kept across its turns (`generate_batch(prefixes=...)`): the tokens whose keys and
    values it holds, per decoder layer (keys, values) (1, heads, L, head_dim) on the device, and, when states are
    tapped, their (aux (L, K, H), final (L, H)) on the CPU. Empty until the conversation's first turn."""

    tokens: list[int] = field(default_factory=list)
    kv: list[tuple] | None = None
    states: tuple | None = None
    prefilled: int = 0  # tokens the last call prefilled for this conversation (the rest of its prompt was reused)


def reused_length(prefix: Prefix | None, prompt: list[int]) -> int:
    """How many leading tokens of `prompt` a prefix's cache already holds: the common prefix of its tokens and the
    prompt (the next turn's prompt is rendered afresh from the text, so it normally extends the cached tokens; where the
    re-rendered history tokenizes differently, reuse stops there), less one: the last prompt token is always fed, its
    logits start the answer."""
    if prefix is None or prefix.kv is None:
        return 0
    n = 0
    for a, b in zip(prefix.tokens, prompt[:-1]):
        if a != b:
            break
        n += 1
    return n


def _past(prefixes: list[Prefix | None], keep: list[int], dev):
    """The batch's past: a DynamicCache whose row j holds its prefix's first keep[j] positions, right-aligned (zeros
    to the left of shorter rows), and its mask (rows, P); (None, None) when no row reuses anything."""
    import torch
    from transformers import DynamicCache

    P = max(keep, default=0)
    if P == 0:
        return None, None
    mask = torch.zeros(len(keep), P, dtype=torch.long, device=dev)  # (rows, P)
    data = []
    ref = next(p.kv for p, n in zip(prefixes, keep) if n)
    for layer, (k0, v0) in enumerate(ref):
        k = k0.new_zeros(len(keep), k0.shape[1], P, k0.shape[3])  # (rows, heads, P, head_dim)
        v = v0.new_zeros(len(keep), v0.shape[1], P, v0.shape[3])
        for j, (pre, n) in enumerate(zip(prefixes, keep)):
            if n:
                k[j, :, P - n:] = pre.kv[layer][0][0, :, :n]
                v[j, :, P - n:] = pre.kv[layer][1][0, :, :n]
        data.append((k, v))
    for j, n in enumerate(keep):
        mask[j, P - n:] = 1
    return DynamicCache(ddp_cache_data=data), mask


def _save_prefix(prefix: Prefix, cache, row: int, valid, tokens: list[int], states: list | None) -> None:
    """Row `row` of the batch cache (its positions where `valid`, (L,) bool) becomes the conversation's prefix, holding
    `tokens` and their `states`; a cache of other layer kinds (sliding windows, linear attention) cannot be carried
    over: the prefix then keeps no cache (the next turn prefills the whole history), only this turn's states."""
    from transformers.cache_utils import DynamicLayer

    if cache is None or not all(type(layer) is DynamicLayer for layer in cache.layers):
        prefix.tokens, prefix.kv = [], None
        prefix.states = None if states is None else (states[0], states[1])
        return
    idx = valid.nonzero()[:, 0]  # (L,) the row's real positions, in order
    if len(idx) != len(tokens):
        raise RuntimeError(f"generate_batch: {len(idx)} cached positions for {len(tokens)} tokens")
    prefix.tokens = tokens
    prefix.kv = [(layer.keys[row:row + 1].index_select(-2, idx), layer.values[row:row + 1].index_select(-2, idx))
                 for layer in cache.layers]  # (1, heads, L, head_dim) each
    prefix.states = None if states is None else (states[0], states[1])


def generate_batch(target, prompts: list[list[int]], max_new_tokens: int | list[int], stop_ids, temperature: float |
                   list[float] = 0.0, top_p: float | list[float] = 1.0, seeds: list[int] | None = None,
                   pad_id: int = 0, layers: list[int] | None = None,
                   prefixes: list[Prefix] | None = None) -> list[tuple]:
    """Continue each prompt (token ids) with the target; returns per prompt (new token ids, "stop" | "length"), and
    with `layers` also (aux (T, K, H), final (T, H)) on the CPU: the states the target computed for every token it was
    fed, the prompt's at prefill and each generated token's at its decode step (T = prompt + new tokens, minus the last
    new token when it was never fed: a turn cut at max_new_tokens), the state of token t being the one that predicted
    token t+1, as capture stores it.

    Prompts are left-padded into one batch with explicit positions, so each row computes what it would alone; one KV
    cache serves the batch and rows that finish are dropped from it. The stop token itself is not returned.
    Sampling parameters may be given per row (the server batches requests with different settings).

    `prefixes` (one `Prefix` per prompt, multi-turn generation): each row reuses the KV cache its conversation left at
    its previous turn for the leading tokens the new prompt shares with it (`reused_length`) and prefills only the
    rest: the earlier turns are never prefilled again, so a conversation's cost grows linearly with its turns, not with
    their square. The rows' past is laid out right-aligned before the new tokens (padding masked out in between), so
    each row still computes what it would alone. On return each prefix holds its row's cache (prompt + the answer
    tokens fed) and, with `layers`, the states of all of them, which the returned states then are (T counts the
    reused tokens too), and `prefilled`, the tokens this call prefilled for it.
    """
    import torch

    b = len(prompts)
    if b == 0:
        return []
    per_row = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * b  # noqa: E731
    maxn, temps, tops = per_row(max_new_tokens), per_row(temperature), per_row(top_p)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch: empty prompt")
    gens = [None] * b
    if any(t > 0 for t in temps):
        seeds = seeds if seeds is not None else [0] * b
        gens = [torch.Generator().manual_seed(int(s)) if t > 0 else None for s, t in zip(seeds, temps)]
    stops = set(int(s) for s in stop_ids)
    out: list[list[int]] = [[] for _ in range(b)]
    finish = ["length"] * b
    states: list[list] = [[] for _ in range(b)]  # per row: (aux (t, K, H), final (t, H)) chunks of this call
    alive = [i for i in range(b) if maxn[i] > 0]  # prompt index of each row still in the batch
    pre = [prefixes[i] if prefixes is not None else None for i in alive]
    keep = [reused_length(p, prompts[i]) for p, i in zip(pre, alive)]
    fed = [len(prompts[i]) - n for i, n in zip(alive, keep)]  # tokens prefilled per row
    for p, n in zip(pre, keep):
        if p is not None and p.states is not None:
            p.states = (p.states[0][:n], p.states[1][:n])
    dev = target.device
    for i, n in zip(alive, fed):
        if prefixes is not None:
            prefixes[i].prefilled = n
    if not alive:
        return _results(out, finish, states, prefixes, layers)
    cache, past = _past(pre, keep, dev)
    width = max(fed)
    x, m, p = _prefill_inputs([prompts[i][n:] for i, n in zip(alive, keep)], keep, width, pad_id, dev)
    if past is not None:
        m = torch.cat([past, m], dim=1)  # (rows, P + T)
    first = True
    rows = list(alive)
    with torch.no_grad():
        while rows:
            aux, final, cache = target.capture(x, layers or [], attention_mask=m, position_ids=p,
                                               past_key_values=cache, use_cache=True)  # (rows, t, K, H), (rows, t, H)
            if layers:
                for j, i in enumerate(rows):  # the first forward is left-padded: a row's new tokens are its last fed
                    lo = width - fed[alive.index(i)] if first else 0
                    states[i].append((aux[j, lo:], final[j, lo:]))  # on the device until the row finishes
            first = False
            logits = target.logits(final[:, -1]).float()  # (rows, V): only the last position needs the vocabulary
            nxt = _pick(logits, [temps[i] for i in rows], [tops[i] for i in rows], [gens[i] for i in rows]).tolist()
            done = []
            for j, i in enumerate(rows):
                if nxt[j] in stops:
                    finish[i] = "stop"
                    done.append(j)
                    continue
                out[i].append(nxt[j])
                if len(out[i]) >= maxn[i]:
                    done.append(j)
            if prefixes is not None:  # the finished rows' caches: now, before they leave the batch
                for j in done:
                    i = rows[j]
                    toks = prompts[i] + (out[i] if finish[i] == "stop" else out[i][:-1])
                    _save_prefix(prefixes[i], cache, j, m[j].bool(), toks, _joined(prefixes[i], states[i], layers))
            keep_rows = [j for j in range(len(rows)) if j not in set(done)]
            if not keep_rows:
                break
            if len(keep_rows) < len(rows):  # shrink the batch: finished rows cost nothing from here on
                sel = torch.tensor(keep_rows, device=dev)
                cache.batch_select_indices(sel)
                m, p = m[sel], p[sel]
            rows = [rows[j] for j in keep_rows]
            x = torch.tensor([[out[i][-1]] for i in rows], dtype=torch.long, device=dev)  # (rows, 1)
            m = torch.cat([m, m.new_ones(len(rows), 1)], dim=1)  # (rows, T+1)
            p = p[:, -1:] + 1  # (rows, 1)
    return _results(out, finish, states, prefixes, layers)


def _prefill_inputs(new: list[list[int]], start: list[int], width: int, pad_id: int, dev):
    """(ids, mask, positions), each (rows, width): the tokens to prefill, left-padded; row j's positions continue
    from start[j] (the tokens it reuses come first)."""
    import torch

    x = torch.full((len(new), width), pad_id, dtype=torch.long)  # (rows, T)
    m = torch.zeros((len(new), width), dtype=torch.long)  # (rows, T)
    p = torch.zeros((len(new), width), dtype=torch.long)  # (rows, T)
    for j, (toks, n) in enumerate(zip(new, start)):
        x[j, width - len(toks):] = torch.tensor(toks, dtype=torch.long)
        m[j, width - len(toks):] = 1
        p[j, width - len(toks):] = torch.arange(n, n + len(toks))
    return x.to(dev), m.to(dev), p.to(dev)


def _joined(prefix: Prefix, chunks: list, layers) -> tuple | None:
    """The states of every token a prefix will hold: its reused ones and this call's chunks, on the CPU."""
    import torch

    if not layers:
        return None
    parts = [prefix.states] if prefix.states is not None and len(prefix.states[0]) else []
    if chunks:
        parts.append((torch.cat([a for a, _ in chunks]).cpu(), torch.cat([f for _, f in chunks]).cpu()))
    if not parts:
        return None
    return torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts])  # (T, K, H), (T, H)


def _results(out, finish, states, prefixes, layers) -> list[tuple]:
    import torch

    res = []
    for i in range(len(out)):
        if not layers:
            res.append((out[i], finish[i]))
            continue
        if prefixes is not None:
            st = prefixes[i].states
        else:
            st = (torch.cat([a for a, _ in states[i]]).cpu(), torch.cat([f for _, f in states[i]]).cpu()) \
                if states[i] else None
        res.append((out[i], finish[i], st))
    return res


class EmbeddedEngine:
    """The target loaded in this process; `complete(batch)` answers a list of chat requests together."""

    def __init__(self, path: str, device: str = "cpu", dtype: str = "auto"):
        from hstap.data.prepare import render_prompt
        from hstap.model_dir import load_target

        self.target, self.tokenizer = load_target(path, device=device, dtype=dtype)
        if self.tokenizer is None:
            raise HstapError(f"{path}: no tokenizer next to the model (the chat template is needed)")
        self._render = render_prompt
        self.stop_ids = stop_token_ids(self.target.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_len = getattr(self.target.config, "max_position_embeddings", None)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return list(self._render(self.tokenizer, messages))

    def complete(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: list[float],
                 top_p: list[float], seeds: list[int], layers: list[int] | None = None,
                 prefixes: list[Prefix] | None = None) -> list[tuple]:
        """Prompt token ids -> (text, new token ids, finish_reason) per request, + the states (generate_batch) with
        `layers`; max_new_tokens is capped at the model's context length (finish_reason "length"). `prefixes`: the
        conversations' caches kept across turns (generate_batch)."""
        if self.max_len:
            max_new_tokens = [max(0, min(n, self.max_len - len(p))) for n, p in zip(max_new_tokens, prompts)]
        res = generate_batch(self.target, prompts, max_new_tokens, self.stop_ids, temperature, top_p, seeds,
                             self.pad_id, layers, prefixes)
        return [(self.tokenizer.decode(r[0], skip_special_tokens=True), *r) for r in res]
