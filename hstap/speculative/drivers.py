"""Speculative decoding with an EAGLE-3 drafter (chain or EAGLE-2 dynamic tree), the target-only baseline and n-gram
prompt lookup: plain functions and one driver each (gpt-fast style). Batch size 1; every driver returns
`(output_ids, stats)` with the generated ids only.

Bookkeeping between rounds (L = committed tokens, prompt + generated; the newest one, x[L-1], came out of the last
verify and has not been through the target yet):

    target cache   L-1 entries (positions 0..L-2), an HF `DynamicCache`
    drafter cache  L-1 entries: drafter position t holds (embed(x[t+1]), fc(aux[t])), SGLang's draft-extend alignment
                   (the pairs of the tokens accepted last round are added at the start of the next one)

One round (`spec_step`):
 1. extend the drafter with the pairs of the tokens accepted last round (their aux states come from the verify
    forward); its output at position L-2, h_last, has the logits that propose x[L];
 2. draft a tree rooted at x[L-1] (`hstap.speculative.draft_tree.draft_tree`: level-1 children come from h_last, a level-d node
    is fed to the drafter at position L-2+d). A chain of k tokens is the tree with topk=1, depth=k, tokens=k+1;
 3. verify: ONE target forward over [root, nodes...] at positions L-1+depth with a 4-D additive float mask over
    [cache + tree] (`hstap.speculative.draft_tree.tree_mask`; transformers passes a 4-D mask to the attention kernel as is; a float
    mask is right for both the sdpa and eager kernels, a bool one would be added as 0/1 by eager); a chain needs none;
 4. accept: a path of verified nodes plus one more token y (the target's bonus, or a residual sample), by the lossless
    rule of `hstap.speculative.acceptance` (greedy at T = 0, rejection sampling over the tree at T > 0);
 5. roll back: the accepted path's KV entries are gathered into place (slots L-1.. <- L-1+path) and the cache cut to
    L+a. The path's slots increase, so this is one index_select per layer, no recomputation and exact. The drafter cache
    was cut back to L-1 right after drafting (its draft-step entries were made from its own h_out, not the target's).

The n-gram baseline verifies a chain of prompt-lookup tokens with the same forward, acceptance rule and rollback.
tests/speculative/test_drivers.py checks the output law at T > 0 with a chi-square test (chain, tree, n-gram).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hstap.common import HstapError
from hstap.layers import fc_slots
from hstap.models.drafter import DrafterCache, new_drafter_cache
from hstap.speculative.acceptance import accept
from hstap.speculative.draft_tree import Tree, draft_tree, tree_mask


# --- small pieces ---------------------------------------------------------------------------------------------------
def _now(device: torch.device) -> float:
    if device.type == "cuda":  # kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(device)
    return time.perf_counter()


def choose(logits: torch.Tensor, temperature: float, gen) -> int:
    """One token from a (V,) logit row: argmax at T=0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen))


def finish(out: list[int], new: list[int], max_new: int, eos: set[int]) -> bool:
    """Append new tokens up to max_new and the first eos; True when generation is over."""
    for t in new:
        out.append(t)
        if t in eos or len(out) >= max_new:
            return True
    return False


def prompt_list(prompt_ids, where: str) -> list[int]:
    """A prompt (ids: a list or a tensor) as a list of ints; an empty one is bad input (`where`: the module named in
    the error)."""
    prompt = [int(t) for t in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
    if not prompt:
        raise HstapError(f"{where}: prompt_ids: empty prompt")
    return prompt


def acceptance_rates(counts: list[int], rounds: int) -> list[float]:
    """Per-position acceptance: counts[i] = rounds whose accepted draft reached depth i+1, over all rounds."""
    return [c / rounds if rounds else 0.0 for c in counts]


def new_cache():
    """An HF DynamicCache of plain full-attention layers (so `keep_slots` can gather and cut every layer)."""
    from transformers import DynamicCache

    return DynamicCache()


def keep_slots(cache, start: int, slots: list[int]) -> bool:
    """Keep cache[:start] followed by cache[start + slots] in every layer and drop the rest; slots must increase.

    Returns True when entries had to move (a non-contiguous tree path)."""
    moved = slots != list(range(len(slots)))
    n = start + len(slots)
    idx: dict = {}  # device -> index tensor, built once (layers may sit on several devices)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not isinstance(getattr(layer, "keys", None), torch.Tensor):
            raise HstapError(f"speculative/drivers.py: cache layer {type(layer).__name__} cannot be rolled back "
                             "(need full-attention DynamicLayer layers)")
        if moved:  # index_select copies first, so the overlapping write is safe
            dev = layer.keys.device
            if dev not in idx:
                idx[dev] = torch.tensor(slots, device=dev) + start
            i = idx[dev]
            layer.keys[:, :, start:n] = layer.keys.index_select(2, i)  # (B, h, a+1, d)
            layer.values[:, :, start:n] = layer.values.index_select(2, i)
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
    return moved


def target_forward(target, ids: torch.Tensor, layers: list[int], cache, positions=None, mask=None):
    """ids (1, T) appended to `cache` -> logits (T, V) float32 and the drafter's fc input (T, K, H).

    With no aux layers (an EAGLE-1-style drafter) the fc input is the target's final-norm state (K=1)."""
    aux, final, _ = target.capture(ids, layers, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                   use_cache=True)  # (1, T, K, H), (1, T, H)
    if not layers:
        aux = final.unsqueeze(2)  # (1, T, 1, H)
    return target.logits(final[0]).float(), aux[0]  # (T, V), (T, K, H)


# --- drafting -------------------------------------------------------------------------------------------------------
def drafter_extend(drafter, dcache: DrafterCache, ids: list[int], aux: torch.Tensor, start: int) -> torch.Tensor:
    """Append pairs (embed(ids[j]), fc(aux[j])) at drafter positions start..start+T-1; returns the last h_out (1, 1, H).

    aux (T, K, H) are the target states of the positions before ids: SGLang's draft-extend."""
    dev = drafter.d2t.device
    hidden = drafter.project(aux.unsqueeze(0).to(dev))  # (1, T, H)
    pos = torch.arange(start, start + len(ids), device=dev)[None]  # (1, T)
    h = drafter(torch.tensor([ids], device=dev), hidden, pos, dcache)  # (1, T, H)
    return h[:, -1:]


# --- speculative decoding -------------------------------------------------------------------------------------------
@dataclass
class SpecState:
    """Decoding state between rounds (see the module docstring for the cache invariants)."""

    ids: list[int]
    """Committed tokens (prompt + generated); ids[-1] has not been through the target yet."""
    cache: object
    """Target KV cache with len(ids) - 1 entries."""
    dcache: DrafterCache
    """Drafter KV cache; len(ids) - 1 entries once `pending` is applied."""
    pending: tuple
    """(token ids, fc inputs (T, K, H), start position) still to extend the drafter with."""


def check_request(where: str, target, drafter, mode: str, k: int, topk: int, depth: int, tokens: int,
                  temperature: float, max_new: int) -> None:
    """The arguments of a speculative_generate call, and whether the drafter fits the target (`where`: the module
    named in the errors; the eager and the fast decoder both ask)."""
    if mode not in ("chain", "tree"):
        raise HstapError(f"{where}: mode: expected 'chain' or 'tree', got {mode!r}")
    for name, v, lo in (("k", k, 1), ("topk", topk, 1), ("depth", depth, 1), ("tokens", tokens, 2),
                        ("max_new_tokens", max_new, 1)):
        if v < lo:
            raise HstapError(f"{where}: {name}: must be >= {lo}, got {v}")
    if temperature < 0:
        raise HstapError(f"{where}: temperature: must be >= 0, got {temperature}")
    c = drafter.config
    if c.vocab_size != target.vocab_size:
        raise HstapError(f"{where}: drafter vocab_size {c.vocab_size} != target vocab_size {target.vocab_size}")
    fc = getattr(drafter, "fc", None)
    if fc is not None and fc.in_features != fc_slots(c.aux_layers) * target.hidden_size:
        raise HstapError(f"{where}: drafter fc takes {fc.in_features} inputs, but aux_layers {list(c.aux_layers)} of a "
                         f"{target.hidden_size}-wide target give {fc_slots(c.aux_layers) * target.hidden_size}")
    if c.aux_layers and max(c.aux_layers) >= target.num_layers:
        raise HstapError(f"{where}: drafter aux_layers {list(c.aux_layers)} out of range for a "
                         f"{target.num_layers}-layer target")


def _check_tree(target, length: int) -> None:
    """Tree verification here passes a 4-D mask to the model's own attention, which must take one and need no window."""
    where = "speculative/drivers.py"
    impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        raise HstapError(f"{where}: tree verification needs a 4-D mask: load the target with attn_implementation "
                         f"'sdpa' or 'eager' (got {impl!r})")
    window = getattr(target.config, "sliding_window", None)
    if window and length > window:  # the custom mask would not apply the window
        raise HstapError(f"{where}: tree mode: prompt + new tokens ({length}) exceed the sliding window ({window})")


def prefill(target, drafter, prompt: list[int], temperature: float = 0.0, gen=None) -> SpecState:
    """Run the prompt through the target and pick the first new token; the drafter extend is left pending."""
    layers = list(drafter.config.aux_layers)
    cache = new_cache()
    logits, aux = target_forward(target, torch.tensor([prompt], device=target.device), layers, cache)
    x = choose(logits[-1], temperature, gen)
    # a deeper drafter gets a LayerCaches: the same len()/crop() protocol, so rounds and draft trees are unchanged
    return SpecState(ids=list(prompt) + [x], cache=cache, dcache=new_drafter_cache(drafter),
                     pending=(prompt[1:] + [x], aux, 0))


@torch.no_grad()
def spec_step(target, drafter, st: SpecState, topk: int, depth: int, tokens: int, temperature: float = 0.0,
              gen=None, clock: dict | None = None) -> dict:
    """One draft + verify round; appends the new tokens to st.ids and returns {"new", "accepted", "nodes", "moved"}."""
    dev = target.device
    t0 = _now(dev)
    h_last = drafter_extend(drafter, st.dcache, *st.pending)  # (1, 1, H) at position L-2
    L = len(st.ids)
    tree = draft_tree(drafter, st.dcache, h_last, st.ids[-1], L - 1, topk, depth, tokens, temperature, gen)
    t1 = _now(dev)
    chain = all(p == i - 1 for i, p in enumerate(tree.parents))
    pos = torch.tensor([[L - 1 + d for d in tree.depths]], device=dev)  # (1, N)
    mask = None if chain else tree_mask(tree.parents, L - 1, target.dtype, dev)  # (1, 1, N, L-1+N)
    logits, aux = target_forward(target, torch.tensor([tree.tokens], device=dev), list(drafter.config.aux_layers),
                                 st.cache, pos, mask)  # (N, V), (N, K, H)
    path, y, acc = accept(tree, logits, temperature, gen)
    moved = keep_slots(st.cache, L - 1, path)
    new = [tree.tokens[i] for i in path[1:]] + [y]
    st.pending = (new, aux[path], L - 1)  # pairs (x[t+1], aux[t]) for t = L-1 .. L-1+a
    st.ids += new
    t2 = _now(dev)
    if clock is not None:
        clock["draft_s"] = clock.get("draft_s", 0.0) + t1 - t0
        clock["verify_s"] = clock.get("verify_s", 0.0) + t2 - t1
    return {"new": new, "accepted": acc, "nodes": len(tree.tokens), "moved": moved}


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, max_new_tokens: int = 256, mode: str = "chain", k: int = 5,
                         topk: int = 8, depth: int = 6, tokens: int = 60, temperature: float = 0.0, eos_ids=(),
                         generator=None) -> tuple[list[int], dict]:
    """Generate with draft + verify rounds. Chain: k draft tokens per round; tree: EAGLE-2 dynamic tree of `depth`
    levels, `topk` children per expanded node, `tokens` verified nodes including the root (SGLang's num-draft-tokens).

    stats: tau = tokens produced by verify forwards / verify forwards (the prefill's token is in neither; SGLang's
    accept length counts it in the numerator); per_position_acceptance[i] = fraction of rounds whose accepted draft
    reached depth i+1; draft_s (drafter extend + drafting) vs verify_s (target forward + acceptance + KV rollback)."""
    prompt = prompt_list(prompt_ids, "speculative/drivers.py")
    check_request("speculative/drivers.py", target, drafter, mode, k, topk, depth, tokens, temperature, max_new_tokens)
    if mode == "tree":
        _check_tree(target, len(prompt) + max_new_tokens + tokens)
    if mode == "chain":
        topk, depth, tokens = 1, k, k + 1
    dev, eos = target.device, {int(e) for e in eos_ids}
    clock: dict = {"draft_s": 0.0, "verify_s": 0.0}
    t0 = _now(dev)
    st = prefill(target, drafter, prompt, temperature, generator)
    clock["prefill_s"] = _now(dev) - t0
    out: list[int] = []
    done = finish(out, st.ids[-1:], max_new_tokens, eos)
    steps, nodes, moved, counts = 0, 0, 0, [0] * depth
    while not done:
        r = spec_step(target, drafter, st, topk, depth, tokens, temperature, generator, clock)
        steps, nodes, moved = steps + 1, nodes + r["nodes"], moved + r["moved"]
        for d in range(r["accepted"]):
            counts[d] += 1
        done = finish(out, r["new"], max_new_tokens, eos)
    total = _now(dev) - t0
    stats = {"method": f"eagle-{mode}", "mode": mode, "k": k if mode == "chain" else None, "topk": topk, "depth": depth,
             "tokens": tokens, "temperature": temperature, "prompt_tokens": len(prompt), "new_tokens": len(out),
             "verify_forwards": steps, "verify_tokens": len(out) - 1, "tau": (len(out) - 1) / steps if steps else 0.0,
             "accept_counts": counts, "per_position_acceptance": acceptance_rates(counts, steps),
             "mean_tree_nodes": nodes / steps if steps else 0.0, "kv_moves": moved, **clock, "total_s": total,
             "tokens_per_s": len(out) / total if total > 0 else 0.0}
    return out, stats


# --- baselines ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def target_generate(target, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, eos_ids=(),
                    generator=None) -> tuple[list[int], dict]:
    """Plain autoregressive decoding with a KV cache (the baseline every speedup is measured against)."""
    prompt = prompt_list(prompt_ids, "speculative/drivers.py")
    dev, eos, cache = target.device, {int(e) for e in eos_ids}, new_cache()
    t0 = _now(dev)
    logits, _ = target_forward(target, torch.tensor([prompt], device=dev), [], cache)
    out: list[int] = []
    done = finish(out, [choose(logits[-1], temperature, generator)], max_new_tokens, eos)
    t1 = _now(dev)
    steps = 0
    while not done:
        logits, _ = target_forward(target, torch.tensor([[out[-1]]], device=dev), [], cache)
        steps += 1
        done = finish(out, [choose(logits[-1], temperature, generator)], max_new_tokens, eos)
    t2 = _now(dev)
    return out, {"method": "target", "temperature": temperature, "prompt_tokens": len(prompt), "new_tokens": len(out),
                 "verify_forwards": steps, "verify_tokens": len(out) - 1, "tau": 1.0 if steps else 0.0,
                 "prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0,
                 "tokens_per_s": len(out) / (t2 - t0) if t2 > t0 else 0.0}


class NgramIndex:
    """Prompt lookup over a growing token list, max_ngram dict updates per token: for n = 1..max_ngram, the latest
    start of every n-gram that has a next token. A round's lookup is then a few dict probes instead of a scan of the
    whole context (benchmarks/bench_ngram.py: 7 against 110 us a round at 200-328 tokens on the CPU box)."""

    def __init__(self, max_ngram: int = 3, ids=()):
        if max_ngram < 1:
            raise HstapError(f"speculative/drivers.py: max_ngram must be >= 1 (got {max_ngram})")
        self.max_ngram, self.ids = max_ngram, []
        self.last: list[dict] = [{} for _ in range(max_ngram + 1)]  # last[n][n-gram] = its latest start j, j + n < len
        self.extend(ids)

    def extend(self, tokens) -> None:
        ids = self.ids
        for t in tokens:
            p = len(ids)  # the new token's position: the n-grams ending at p - 1 now have a next token
            for n in range(1, min(self.max_ngram, p) + 1):
                self.last[n][tuple(ids[p - n:p])] = p - n
            ids.append(int(t))

    def propose(self, k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the last n tokens (n = max_ngram..1); [] if none."""
        ids = self.ids
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            j = self.last[n].get(tuple(ids[-n:]))
            if j is not None:
                return ids[j + n:j + n + k]  # may run into the suffix itself
        return []


@torch.no_grad()
def ngram_generate(target, prompt_ids, max_new_tokens: int = 256, k: int = 5, max_ngram: int = 3,
                   temperature: float = 0.0, eos_ids=(), generator=None) -> tuple[list[int], dict]:
    """Prompt-lookup decoding: propose the continuation of the last matching n-gram, verify in one forward.

    Drafts are deterministic (q = a point mass), so acceptance at T > 0 is min(1, p(d)/1) and the residual is p
    without d: lossless."""
    prompt = prompt_list(prompt_ids, "speculative/drivers.py")
    if k < 1 or max_ngram < 1:
        raise HstapError(f"speculative/drivers.py: k and max_ngram must be >= 1 (got {k}, {max_ngram})")
    dev, eos, cache = target.device, {int(e) for e in eos_ids}, new_cache()
    clock = {"draft_s": 0.0, "verify_s": 0.0}
    t0 = _now(dev)
    logits, _ = target_forward(target, torch.tensor([prompt], device=dev), [], cache)
    ids = prompt + [choose(logits[-1], temperature, generator)]
    clock["prefill_s"] = _now(dev) - t0
    out: list[int] = []
    done = finish(out, ids[-1:], max_new_tokens, eos)
    steps, counts, index = 0, [0] * k, NgramIndex(max_ngram, ids)
    while not done:
        ta = time.perf_counter()  # host-only drafting; the device was synchronised at the end of the last round
        tree = Tree.chain(ids[-1], index.propose(k))
        tb = time.perf_counter()
        L = len(ids)
        logits, _ = target_forward(target, torch.tensor([tree.tokens], device=dev), [], cache)
        path, y, acc = accept(tree, logits, temperature, generator)
        keep_slots(cache, L - 1, path)
        new = [tree.tokens[i] for i in path[1:]] + [y]
        ids += new
        index.extend(new)
        clock["draft_s"] += tb - ta
        clock["verify_s"] += _now(dev) - tb
        steps += 1
        for d in range(acc):
            counts[d] += 1
        done = finish(out, new, max_new_tokens, eos)
    total = _now(dev) - t0
    return out, {"method": "ngram", "k": k, "temperature": temperature, "prompt_tokens": len(prompt),
                 "new_tokens": len(out), "verify_forwards": steps, "verify_tokens": len(out) - 1,
                 "tau": (len(out) - 1) / steps if steps else 0.0, "accept_counts": counts,
                 "per_position_acceptance": acceptance_rates(counts, steps), **clock, "total_s": total,
                 "tokens_per_s": len(out) / total if total > 0 else 0.0}
