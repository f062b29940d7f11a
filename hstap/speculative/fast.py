"""The fast evaluation decoder: static KV caches, fixed-shape steps, device-side trees and acceptance, CUDA graphs.

Same drivers and outputs as hstap.speculative.drivers (target_generate, speculative_generate chain/tree, ngram_generate; batch 1;
`(generated ids, stats)`), the same bookkeeping between rounds (target cache L-1 entries, drafter cache L-1 once the
pending pairs are in: drivers.py's module docstring), and the same tokens: greedy outputs equal drivers.py's and
target-only decoding's, sampled outputs follow the same law. What differs is how a round runs:

    prefill   one fixed-shape step per power-of-two bucket (the prompt padded at its end, which causal attention keeps
              out of the real rows): the prompt through the target, all but the newest pair through the drafter
    draft     one fixed-shape step: drafter extend of the pending pairs + D levels of the EAGLE-2 tree + node selection
    verify    one fixed-shape step: target forward over the N tree nodes with the tree mask over all S cache slots,
              acceptance on the device, the accepted path's KV gathered into place, the next round's pending pairs
    host      ONE read of a few integers (accepted count, new tokens), to stop at eos / max_new_tokens

On CUDA each step is torch.compile'd (decoding steps; `compile`) and captured into a CUDA graph on first use
(hstap.speculative.cudagraph.Step), then replayed; a step that cannot be captured runs eagerly after one printed line. The one-time
costs (warm-up, compilation, capture) are taken out of the call's timings and reported as capture_s. On the CPU the
same steps run as plain calls, which is what the tests compare with drivers.py. Target-only decoding is a one-token
step; n-gram lookup drafts on the host and verifies in a (k+1)-token step whose padding is never accepted.

The target forward is our own loop over the HF decoder layers (fast_steps.run_target), not `Target.capture`'s per-call
hooks: it hands the aux states over directly and holds nothing torch.compile would have to guard (hooks registered
per call, HF's output-capturing ContextVar). It is checked against `Target.capture` when the engine is built; if they
disagree, or the cache cannot be static (a sliding window shorter than the sequence), or the attention kernel takes no
4-D mask, every method runs drivers.py's eager decoder instead, after one printed line. Temperature > 0 in tree mode
also runs drivers.py (one line): EAGLE-2's sampling rules (a)/(b) are not implemented on the device.

Timings (seconds, summed over the rounds of a call; the steps are compiled and captured before the loop's clock
starts, so no one-time cost is inside them):
    draft_s   GPU time of the draft steps: CUDA events recorded on the stream right before and after each draft
              replay (perf_counter around the call on the CPU, where kernels are synchronous). n-gram: the host
              clock around the NgramIndex lookup (its drafting runs on the host).
    verify_s  GPU time of the verify steps (target-only decoding: decode_s, its one-token step), the same way.
    host_s    the loop's wall time (host clock, start to the final synchronize) minus those device spans: time the
              device sat idle waiting for the host (Python, launches, the one read per round). Device spans of
              different rounds never overlap and all lie inside the loop, so host_s >= 0 up to the events'
              resolution (~1 us per round).
hstap.speculative.latency turns them into the naive predicted speedup tau / (1 + k c_draft / c_verify) and into the refined one
that also counts the verify forward's growth with its token count and the host time per round.
"""

from __future__ import annotations

import sys
import time

import torch

from hstap.common import HstapError
from hstap.layers import last_layer
from hstap.models.lean_drafter import LeanDrafter
from hstap.models.lean_target import FUSE_MAX_BYTES, lean_target
from hstap.speculative import drivers
from hstap.speculative.drivers import acceptance_rates, check_request, choose, finish, prompt_list
from hstap.speculative.cudagraph import Clock, GraphPolicy, Step
from hstap.speculative.device_tree import TreeShape
from hstap.speculative.fast_steps import (decode_body, decode_buffers, ngram_body, ngram_buffers, prefill_body,
                                   prefill_buffers, run_target, spec_bodies, spec_buffers)
from hstap.speculative.latency import latency_model
from hstap.speculative.static_kv import DrafterStaticCache, StaticUnsupported, additive, causal_rows, seek, target_cache

SLOT_QUANTUM = 256  # cache lengths are rounded up to this (aligned masks, fewer re-allocations)

INDUCTOR_CDT = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True, "fx_graph_cache": True}
"""gpt-fast's inductor settings (its generate.py), as per-compilation options (FastDecoder(inductor=...)): with
coordinate-descent tuning inductor also turns every matrix-vector product (a GEMM with one row) into a Triton reduction
that it tunes and fuses with its neighbours, instead of a cuBLAS call ("our matrix vector multiplies only achieve peak
bandwidth with coordinate descent tuning": torch/_inductor/decomposition.py). Tuning costs compile time."""


FUSED = {"lean": True, "target_layers": "lean", "attention": "math", "fuse_rows": 8, "inductor": INDUCTOR_CDT}
"""FastDecoder options of the fused kernels (`hstap eval --kernels fused`): the lean drafter and target layers, math
attention, few-row products as fused reductions, gpt-fast's inductor settings. Measured on the H200 (fp32, reference
target, trained drafter, benchmarks/RESULTS.md): target-only 3,097 tok/s and chain-5 3,417 tok/s, against 1,380 and
1,682 with the lean layers attending through SDPA (whose fp32 one-query kernel costs ~60 us a layer) and 1,374 and
1,577 with the model's own layers; compiling a method's steps takes minutes (coordinate-descent tuning), outside the
timings. fuse_rows is meant for compiled steps: run eagerly, its products materialise rows x weight."""


class FastDecoder:
    """Static caches, steps and their graphs for one target (and drafter), reused across prompts and methods.

    graphs: capture CUDA graphs (default: on CUDA); compile: torch.compile each decoding step (target layers, drafter
    levels, masks, acceptance; not the prefill buckets) before capturing it (default: on CUDA; it fuses the hundreds
    of small kernels a step is made of, at a one-time cost of seconds to minutes per step, excluded from timings);
    max_len: cache slots (grown, and every graph recaptured, when a request needs more); inductor: inductor options
    for every step's compilation (torch.compile's `options`: per compilation, nothing global; e.g. INDUCTOR_CDT);
    lean: the drafter's forward runs with hstap.models.lean_drafter's fused kernels (LeanDrafter: fused weights, one
    attention kernel, rotary tables)
    and a greedy chain drafts with argmax alone (same drafts up to rounding; the default off keeps the reference
    path); target_layers: "hf" (the model's own decoder layers, fast_steps.run_target) or "lean"
    (hstap.models.lean_target: fused weights, one attention call per layer; a target outside the Llama family, or one whose
    lean forward differs from the model's, keeps its HF layers after one printed line); attention: how the lean
    paths attend, "sdpa" (one fused kernel) or "math" (two matrix products and a softmax, for the compiler to
    fuse); fuse_rows: in the lean paths, products of at most this many rows (and of weights of at most fuse_bytes)
    as broadcast sums the compiler fuses (hstap.models.lean_target.linear; for compiled steps: eager, it materialises
    rows x weight)."""

    def __init__(self, target, drafter=None, max_len: int = 1024, graphs: bool | None = None,
                 compile: bool | None = None, log=None, inductor: dict | None = None, lean: bool = False,
                 target_layers: str = "hf", attention: str = "sdpa", fuse_rows: int = 0,
                 fuse_bytes: int = FUSE_MAX_BYTES):
        self.target, self.drafter, self.dev = target, drafter, target.device
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        if graphs and self.dev.type != "cuda":
            raise HstapError("speculative/fast.py: graphs=True needs a CUDA target")
        self.policy = GraphPolicy(self.dev.type == "cuda" if graphs is None else graphs,
                                  f"a {target.config.model_type} decoding step", self.log)
        self.compile = self.dev.type == "cuda" if compile is None else compile
        self.inductor, self.lean = dict(inductor or {}), lean
        if target_layers not in ("hf", "lean") or attention not in ("sdpa", "math"):
            raise HstapError(f"speculative/fast.py: target_layers / attention: expected hf|lean / sdpa|math, got "
                             f"{target_layers!r} / {attention!r}")
        self.target_layers, self.attention, self.lt = target_layers, attention, None
        self.fuse_rows, self.fuse_bytes = fuse_rows, fuse_bytes
        self.unsupported: str | None = None
        self._said: set[str] = set()
        self.host_reads = 0  # device -> host reads inside decoding loops: the host syncs
        self.S = 0
        impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager"):
            self.unsupported = f"attention {impl!r} takes no 4-D mask (load the target with sdpa or eager)"
        if drafter is not None:
            self.hot = torch.arange(drafter.d2t.shape[0], device=drafter.d2t.device) + drafter.d2t  # (Vd,)
        self._ensure(max_len)
        if not self.unsupported:
            self._check_forward()

    # --- allocation -------------------------------------------------------------------------------------------------
    def _ensure(self, need: int) -> None:
        """Cache slots for `need` positions; a (re)allocation drops every step (their graphs hold the old buffers)."""
        if self.unsupported or need <= self.S:
            return
        S = -(-need // SLOT_QUANTUM) * SLOT_QUANTUM
        try:
            self.cache = target_cache(self.target, S)
        except StaticUnsupported as e:
            self.unsupported = f"no static cache for this target: {e}"
            return
        self.S, self.col = S, torch.arange(S, device=self.dev)  # (S,)
        if self.lt is not None:
            self.lt.resize(S)
        elif self.target_layers != "hf":
            self.lt, why = lean_target(self.target, S, self.attention, self.fuse_rows, self.fuse_bytes)
            if why:
                self._say("lean-target", f"lean target layers unavailable ({why}): the model's own layers run")
                self.target_layers = "hf"
        if self.drafter is not None:
            c = self.drafter.config
            self.dcache = DrafterStaticCache(c.num_key_value_heads, c.head_dim, S, self.drafter.fc.weight.dtype,
                                             self.hot.device)
            self.dstep = LeanDrafter(self.drafter, S, self.attention, self.fuse_rows, self.fuse_bytes) \
                if self.lean else self.drafter
        self.steps: dict = {}

    def _forward(self, layers: tuple):
        """fwd(ids, pos, mask) -> (logits, aux): the target over the static cache, tapping `layers`."""
        target, cache, lt = self.target, self.cache, self.lt

        def fwd(ids, pos, mask, rows=None):
            if lt is not None:
                return lt.forward(cache, list(layers), ids, pos, mask, rows)
            return run_target(target, cache, list(layers), ids, pos, mask, rows)

        return fwd

    @torch.no_grad()
    def _check_forward(self) -> None:
        """run_target through the static cache must reproduce Target.capture (the model's own forward)."""
        T = 5
        ids = (torch.arange(1, T + 1, device=self.dev)[None] * 7) % self.target.vocab_size  # (1, T)
        layers = tuple(sorted({0, last_layer(self.target.num_layers)}))
        logits, aux = self._prefill(ids[0].tolist(), layers)
        ref_aux, final, _ = self.target.capture(ids, list(layers))
        ref = self.target.logits(final[0]).float()  # (T, V)
        tol = 1e-4 if self.target.dtype == torch.float32 else 3e-2
        err = max(float((logits - ref).norm() / ref.norm().clamp_min(1e-30)),
                  float((aux.float() - ref_aux[0].float()).norm() / ref_aux.float().norm().clamp_min(1e-30)))
        if not err <= tol and self.lt is not None:
            self._say("lean-target", f"the lean target layers differ from the model's (relative error {err:.2e}): "
                                     "the model's own layers run")
            self.lt, self.target_layers = None, "hf"
            self._check_forward()
        elif not err <= tol:
            self.unsupported = f"the static-cache forward differs from the model's (relative error {err:.2e})"

    def _say(self, key: str, msg: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log(f"hstap eval (fast engine): {msg}")

    def _eager(self, what: str) -> bool:
        """True (after one line) when this engine cannot run: the caller uses drivers.py instead."""
        if self.unsupported:
            self._say("unsupported", f"{self.unsupported}: {what} runs on the eager decoder (drivers.py)")
        return self.unsupported is not None

    def _read(self, t: torch.Tensor) -> list[int]:
        self.host_reads += 1
        return t.tolist()

    def _prefill(self, prompt: list[int], layers: tuple):
        """The prompt through the target at slots 0..P-1, eagerly -> logits (P, V), fc inputs (P, K, H)."""
        pos = torch.arange(len(prompt), device=self.dev)  # (P,)
        seek(self.cache, 0)
        return self._forward(layers)(torch.tensor([prompt], device=self.dev), pos[None],
                                     additive(causal_rows(self.col, pos), self.target.dtype))

    def _prefill_step(self, prompt: list[int], layers: tuple, spec: bool) -> dict:
        """Run the prompt as a fixed-shape step, padded to a power of two (>= 16) -> its buffers: "logit" (V,) and
        "aux_last" (K, H) of the newest token; with spec, the drafter holds every pair but the newest."""
        P = len(prompt)
        L = min(self.S - 1, max(16, 1 << (P - 1).bit_length()))
        key = ("prefill", L, layers, spec)
        if key not in self.steps:
            b = prefill_buffers(self.dev, L, self.target.vocab_size, max(1, len(layers)), self.target.hidden_size,
                                self.target.dtype)
            body = prefill_body(b, self._forward(layers), self.cache, self.col, self.target.dtype,
                                self.dstep if spec else None, self.dcache if spec else None)
            self._step(key, "prefill", body, [], compile=False).buf = b  # one compilation per bucket: not worth it
        b = self.steps[key].buf
        b["ids"][:P].copy_(torch.tensor(prompt))
        b["n"].fill_(P)
        self.steps[key]()
        return b

    def _captures(self) -> float:
        return sum(st.capture_s for st in self.steps.values())

    @staticmethod
    def _times(t: list[float], c: list[float], **spans: float) -> dict:
        """Wall clock t = [start, prefill done, loop done] and capture totals c at the same points -> the timings,
        without the one-time costs spent in this call (warm-up, compilation, capture: capture_s), as a warm-up run
        would have them; host_s = the loop's wall time minus the device spans."""
        pre, loop = c[1] - c[0], c[2] - c[1]
        return {"prefill_s": t[1] - t[0] - pre, **spans, "host_s": t[2] - t[1] - loop - sum(spans.values()),
                "total_s": t[2] - t[0] - pre - loop, "capture_s": pre + loop}

    def _step(self, key, name: str, body, state, compile: bool = True) -> Step:
        compiled = None
        if compile and self.compile:  # the whole step: target layers, drafter levels, masks, acceptance fuse
            cfg = torch._dynamo.config  # one code object per kind of step, many closures: room for them all
            limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, limit, max(getattr(cfg, limit), 64))
            compiled = torch.compile(body, dynamic=False, **({"options": self.inductor} if self.inductor else {}))
        self.steps[key] = Step(name, body, self.policy, state=state, compiled=compiled)
        return self.steps[key]

    def _stats(self, method: str, prompt, out, rounds: int, t: dict, keys, **extra) -> dict:
        total = t["total_s"]
        steps = [self.steps[k] for k in keys]
        s = {"method": method, "engine": "fast", **extra, "prompt_tokens": len(prompt), "new_tokens": len(out),
             "verify_forwards": rounds, "verify_tokens": len(out) - 1,
             "tau": (len(out) - 1) / rounds if rounds else 0.0, **t,
             "tokens_per_s": len(out) / total if total > 0 else 0.0,
             "graphs": all(st.graph is not None for st in steps), "compiled": all(st.compiled for st in steps)}
        s.update(latency_model(s))
        return s

    # --- target-only ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def target_generate(self, prompt_ids, max_new_tokens: int = 256, temperature: float = 0.0, eos_ids=(),
                        generator=None) -> tuple[list[int], dict]:
        """Plain autoregressive decoding (the baseline) in one-token steps; stats as drivers.target_generate's, plus
        decode_s (GPU time of the steps) and host_s (the rest of the loop)."""
        prompt = prompt_list(prompt_ids, "speculative/fast.py")
        if self._eager("target-only decoding"):
            return drivers.target_generate(self.target, prompt, max_new_tokens, temperature, eos_ids, generator)
        self._ensure(len(prompt) + max_new_tokens + 1)
        key = ("decode", temperature)
        if key not in self.steps:
            b = decode_buffers(self.dev, self.target.vocab_size)
            self._step(key, "decode", decode_body(b, self._forward(()), self.cache, self.col, self.target.dtype,
                                                  temperature), [b["start"], b["root"]]).buf = b
        step, eos, clock = self.steps[key], {int(e) for e in eos_ids}, Clock(self.dev)
        b = step.buf
        c, t = [self._captures()], [time.perf_counter()]
        x = choose(self._prefill_step(prompt, (), False)["logit"], temperature, generator)
        b["start"].fill_(len(prompt))
        b["root"].fill_(x)
        out: list[int] = []
        done = finish(out, [x], max_new_tokens, eos)
        step.prepare()  # compile + capture now: outside the loop's clock
        c.append(self._captures())
        t.append(time.perf_counter())
        marks = []
        while not done:
            if temperature > 0:
                torch.rand(b["u"].shape, generator=generator, device=self.dev, out=b["u"])
            e0 = clock.mark()
            step()
            marks.append((e0, clock.mark()))
            done = finish(out, self._read(b["out"]), max_new_tokens, eos)
        clock.sync()
        t.append(time.perf_counter())
        c.append(self._captures())
        times = self._times(t, c, decode_s=sum(clock.span(m0, m1) for m0, m1 in marks))
        return out, self._stats("target", prompt, out, len(marks), times, [key], temperature=temperature)

    # --- EAGLE: chain and tree --------------------------------------------------------------------------------------
    def _spec_steps(self, shape: TreeShape, temperature: float):
        key = ("spec", shape, temperature)
        if key not in self.steps:
            layers = tuple(self.drafter.config.aux_layers)
            n_aux, width = max(1, len(layers)), self.target.hidden_size
            b = spec_buffers(self.dev, shape, n_aux, width, self.target.vocab_size, self.hot.shape[0],
                             self.target.dtype, temperature > 0)
            draft_body, verify_body = spec_bodies(b, self.dstep, self.dcache, self.hot, self._forward(layers),
                                                  self.cache, self.col, self.target.dtype, shape, temperature,
                                                  self.lean)
            self._step(key + ("draft",), "draft", draft_body, [])
            self._step(key, "verify", verify_body, [b[n] for n in ("start", "root", "pend_n", "pend_ids",
                                                                   "pend_aux")]).buf = b
        return self.steps[key + ("draft",)], self.steps[key], key

    def _spec_prefill(self, b: dict, prompt: list[int], temperature: float, gen) -> int:
        """Target prefill and the drafter extend of every pair but the newest, which is left pending (row P-1)."""
        pre = self._prefill_step(prompt, tuple(self.drafter.config.aux_layers), True)
        x = choose(pre["logit"], temperature, gen)
        P0 = len(prompt)
        b["pend_ids"].fill_(x)
        b["pend_aux"].copy_(pre["aux_last"].expand_as(b["pend_aux"]))
        b["pend_n"].fill_(1)
        b["start"].fill_(P0)
        b["root"].fill_(x)
        return x

    @torch.no_grad()
    def speculative_generate(self, prompt_ids, max_new_tokens: int = 256, mode: str = "chain", k: int = 5,
                             topk: int = 8, depth: int = 6, tokens: int = 60, temperature: float = 0.0, eos_ids=(),
                             generator=None) -> tuple[list[int], dict]:
        """drivers.speculative_generate on static caches and device-side trees (same arguments and stats, plus
        host_s, the per-round split and the latency model)."""
        prompt = prompt_list(prompt_ids, "speculative/fast.py")
        if self.drafter is None:
            raise HstapError("speculative/fast.py: speculative_generate needs a FastDecoder built with a drafter")
        check_request("speculative/fast.py", self.target, self.drafter, mode, k, topk, depth, tokens, temperature,
                      max_new_tokens)
        c = self.drafter.config
        eager = self._eager(f"EAGLE {mode} decoding")
        if not eager and getattr(c, "num_layers", 1) > 1:
            self._say("deep-drafter", f"a {c.num_layers}-layer drafter runs on the eager decoder (drivers.py): the "
                                      "static drafter cache holds one layer")
            eager = True
        if not eager and mode == "tree" and temperature > 0:
            self._say("tree-sampling", "tree mode at temperature > 0 runs on the eager decoder (drivers.py): "
                                       "EAGLE-2's sampling rules are not implemented on the device")
            eager = True
        if eager:
            return drivers.speculative_generate(self.target, self.drafter, prompt, max_new_tokens, mode, k, topk,
                                                  depth, tokens, temperature, eos_ids, generator)
        if mode == "chain":
            topk, depth, tokens = 1, k, k + 1
        shape = TreeShape(min(topk, self.hot.shape[0]), depth, tokens)
        self._ensure(len(prompt) + max_new_tokens + shape.margin)
        draft_step, verify_step, key = self._spec_steps(shape, temperature)
        b, eos, clock, P = verify_step.buf, {int(e) for e in eos_ids}, Clock(self.dev), shape.P
        c, t = [self._captures()], [time.perf_counter()]
        x = self._spec_prefill(b, prompt, temperature, generator)
        out: list[int] = []
        done = finish(out, [x], max_new_tokens, eos)
        draft_step.prepare()  # compile + capture now: outside the loop's clock
        verify_step.prepare()
        c.append(self._captures())
        t.append(time.perf_counter())
        marks, counts, moved = [], [0] * depth, 0
        while not done:
            if temperature > 0:
                torch.rand(b["u"].shape, generator=generator, device=self.dev, out=b["u"])
            e0 = clock.mark()
            draft_step()
            e1 = clock.mark()
            verify_step()
            marks.append((e0, e1, clock.mark()))
            r = self._read(b["out"])  # the round's one host sync: [accepted, moved, new tokens right-aligned]
            a = r[0]
            moved += r[1]
            for d in range(a):
                counts[d] += 1
            done = finish(out, r[2 + P - 1 - a:], max_new_tokens, eos)
        clock.sync()
        t.append(time.perf_counter())
        c.append(self._captures())
        n = len(marks)
        times = self._times(t, c, draft_s=sum(clock.span(m[0], m[1]) for m in marks),
                            verify_s=sum(clock.span(m[1], m[2]) for m in marks))
        return out, self._stats(f"eagle-{mode}", prompt, out, n, times, [key + ("draft",), key], mode=mode,
                                k=k if mode == "chain" else None, topk=topk, depth=depth, tokens=tokens,
                                temperature=temperature, accept_counts=counts,
                                per_position_acceptance=acceptance_rates(counts, n),
                                mean_tree_nodes=float(shape.N), kv_moves=moved)

    # --- n-gram -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def ngram_generate(self, prompt_ids, max_new_tokens: int = 256, k: int = 5, max_ngram: int = 3,
                       temperature: float = 0.0, eos_ids=(), generator=None) -> tuple[list[int], dict]:
        """drivers.ngram_generate with a fixed (k+1)-token verify step (drafts shorter than k are padded and their
        padding is never accepted)."""
        prompt = prompt_list(prompt_ids, "speculative/fast.py")
        if k < 1 or max_ngram < 1:
            raise HstapError(f"speculative/fast.py: k and max_ngram must be >= 1 (got {k}, {max_ngram})")
        if self._eager("n-gram decoding"):
            return drivers.ngram_generate(self.target, prompt, max_new_tokens, k, max_ngram, temperature, eos_ids,
                                            generator)
        self._ensure(len(prompt) + max_new_tokens + k + 2)
        key = ("ngram", k, temperature)
        if key not in self.steps:
            b = ngram_buffers(self.dev, k, self.target.vocab_size)
            self._step(key, "ngram", ngram_body(b, self._forward(()), self.cache, self.col, self.target.dtype, k,
                                                temperature), [b["start"]]).buf = b
        step, eos, clock = self.steps[key], {int(e) for e in eos_ids}, Clock(self.dev)
        b = step.buf
        pinned = torch.zeros(k + 2, dtype=torch.long, pin_memory=self.dev.type == "cuda")  # [n, root, drafts]
        host = pinned.numpy()  # its numpy view: a round's writes cost ~1 us, not ~15 us of tensor indexing
        c, t = [self._captures()], [time.perf_counter()]
        ids = prompt + [choose(self._prefill_step(prompt, (), False)["logit"], temperature, generator)]
        b["start"].fill_(len(prompt))
        out: list[int] = []
        done = finish(out, ids[-1:], max_new_tokens, eos)
        step.prepare()  # compile + capture now: outside the loop's clock
        c.append(self._captures())
        t.append(time.perf_counter())
        marks, counts, draft_s, index = [], [0] * k, 0.0, drivers.NgramIndex(max_ngram, ids)
        while not done:
            ta = time.perf_counter()
            drafts = index.propose(k)
            host[0], host[1], host[2:2 + len(drafts)] = len(drafts), ids[-1], drafts
            draft_s += time.perf_counter() - ta  # host-only drafting
            b["chain"].copy_(pinned, non_blocking=True)  # pinned: no sync; the last round's read finished the copy
            if temperature > 0:
                torch.rand(b["u"].shape, generator=generator, device=self.dev, out=b["u"])
            e0 = clock.mark()
            step()
            marks.append((e0, clock.mark()))
            a, y = self._read(b["out"])
            new = drafts[:a] + [y]
            ids += new
            index.extend(new)
            for d in range(a):
                counts[d] += 1
            done = finish(out, new, max_new_tokens, eos)
        clock.sync()
        t.append(time.perf_counter())
        c.append(self._captures())
        n = len(marks)
        times = self._times(t, c, draft_s=draft_s, verify_s=sum(clock.span(m0, m1) for m0, m1 in marks))
        return out, self._stats("ngram", prompt, out, n, times, [key], k=k, temperature=temperature,
                                accept_counts=counts, per_position_acceptance=acceptance_rates(counts, n))
