"""Decoding with the target in this process: `generate_batch` continues a batch of prompts (left-padded, one KV cache,
finished rows dropped from the batch; greedy or temperature + top-p sampling, settings per row), `EmbeddedEngine` turns
chat messages into text with it, and `stop_token_ids` says which tokens end an assistant turn.

Used by `hstap generate`'s embedded engine (hstap/data/generate.py), the OpenAI-compatible test server (hstap/data/serve.py) and
`hstap eval` (stop tokens). Sampling draws from a per-row generator, so a row's output never depends on its batch.
"""

from __future__ import annotations

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


def pick_tokens(logits, temps: list[float], top_ps: list[float], gens: list):
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


def generate_batch(target, prompts: list[list[int]], max_new_tokens: int | list[int], stop_ids, temperature: float |
                   list[float] = 0.0, top_p: float | list[float] = 1.0, seeds: list[int] | None = None,
                   pad_id: int = 0, layers: list[int] | None = None) -> list[tuple]:
    """Continue each prompt (token ids) with the target; returns per prompt (new token ids, "stop" | "length"), and
    with `layers` also (aux (T, K, H), final (T, H)) on the CPU: the states the target computed for every token it was
    fed, the prompt's at prefill and each generated token's at its decode step (T = prompt + new tokens, minus the last
    new token when it was never fed: a turn cut at max_new_tokens), the state of token t being the one that predicted
    token t+1, as capture stores it.

    Prompts are left-padded into one batch with explicit positions, so each row computes what it would alone; one KV
    cache serves the batch and rows that finish are dropped from it. The stop token itself is not returned.
    Sampling parameters may be given per row (the server batches requests with different settings).
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
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_id, dtype=torch.long)  # (b, T)
    mask = torch.zeros((b, width), dtype=torch.long)  # (b, T)
    for i, pr in enumerate(prompts):
        ids[i, width - len(pr):] = torch.tensor(pr, dtype=torch.long)
        mask[i, width - len(pr):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, T): real tokens at 0..len-1 whatever the padding
    dev = target.device
    x, m, p = ids.to(dev), mask.to(dev), pos.to(dev)
    out: list[list[int]] = [[] for _ in range(b)]
    finish = ["length"] * b
    alive = [i for i in range(b) if maxn[i] > 0]  # prompt index of each row still in the batch
    states: list[list] = [[] for _ in range(b)]  # per row: (aux (t, K, H), final (t, H)) chunks on the device
    cache = None
    with torch.no_grad():
        while alive:
            aux, final, cache = target.capture(x, layers or [], attention_mask=m, position_ids=p,
                                               past_key_values=cache, use_cache=True)  # (rows, t, K, H), (rows, t, H)
            if layers:
                for j, i in enumerate(alive):  # the prefill is left-padded: a row's tokens are its last len(prompt)
                    lo = width - len(prompts[i]) if not states[i] else 0
                    states[i].append((aux[j, lo:], final[j, lo:]))
            logits = target.logits(final[:, -1]).float()  # (rows, V): only the last position needs the vocabulary
            nxt = pick_tokens(logits, [temps[i] for i in alive], [tops[i] for i in alive],
                              [gens[i] for i in alive]).tolist()
            keep = []
            for j, i in enumerate(alive):
                if nxt[j] in stops:
                    finish[i] = "stop"
                    continue
                out[i].append(nxt[j])
                if len(out[i]) < maxn[i]:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(alive):  # shrink the batch: finished rows cost nothing from here on
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                m, p = m[sel], p[sel]
            alive = [alive[j] for j in keep]
            x = torch.tensor([[nxt[j]] for j in keep], dtype=torch.long, device=dev)  # (rows, 1)
            m = torch.cat([m, m.new_ones(len(keep), 1)], dim=1)  # (rows, T+1)
            p = p[:, -1:] + 1  # (rows, 1)
    if not layers:
        return [(out[i], finish[i]) for i in range(b)]
    return [(out[i], finish[i], (torch.cat([a for a, _ in states[i]]).cpu(), torch.cat([f for _, f in states[i]]).cpu())
             if states[i] else None) for i in range(b)]


class EmbeddedEngine:
    """The target loaded in this process; `complete(batch)` answers a list of chat requests together."""

    def __init__(self, path: str, device: str = "cpu", dtype: str = "auto", template_kwargs: dict | None = None):
        from hstap.data.chat import render_prompt
        from hstap.data.reasoning import reads_reasoning
        from hstap.artifacts.model_dir import load_target

        self.target, self.tokenizer = load_target(path, device=device, dtype=dtype)
        if self.tokenizer is None:
            raise HstapError(f"{path}: no tokenizer next to the model (the chat template is needed)")
        self._render = render_prompt
        self.template_kwargs = template_kwargs or {}
        # a template that renders `reasoning_content` gets an answer's thinking there (hstap/data/reasoning.py)
        self.reasoning_field = reads_reasoning(self.tokenizer.chat_template)
        self.stop_ids = stop_token_ids(self.target.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_len = getattr(self.target.config, "max_position_embeddings", None)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.render(messages, self.template_kwargs)

    def render(self, messages: list[dict], kwargs: dict) -> list[int]:
        """Prompt ids of `messages` with the generation prompt, under these chat-template kwargs."""
        return list(self._render(self.tokenizer, messages, kwargs))

    def message(self, prompt: list[int], new_ids: list[int], finish: str) -> dict:
        """The assistant message of an answer: its thinking in `reasoning_content` where the template reads that
        field, else the decoded text as it came (hstap/data/reasoning.py)."""
        from hstap.data.reasoning import answer_message, split_answer

        if self.reasoning_field:
            return answer_message(*split_answer(self.tokenizer, prompt, new_ids), finish)
        return answer_message(None, self.tokenizer.decode(new_ids, skip_special_tokens=True), finish)

    def complete(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: list[float],
                 top_p: list[float], seeds: list[int], layers: list[int] | None = None) -> list[tuple]:
        """Prompt token ids -> (text, new token ids, finish_reason) per request, + the states (generate_batch) with
        `layers`; max_new_tokens is capped at the model's context length (finish_reason "length")."""
        if self.max_len:
            max_new_tokens = [max(0, min(n, self.max_len - len(p))) for n, p in zip(max_new_tokens, prompts)]
        res = generate_batch(self.target, prompts, max_new_tokens, self.stop_ids, temperature, top_p, seeds,
                             self.pad_id, layers)
        return [(self.tokenizer.decode(r[0], skip_special_tokens=True), *r) for r in res]
