"""The vLLM tap beside EAGLE-3: a server that drafts with an EAGLE-3 drafter also stores the requests it serves, so that
a drafter can be trained on the traffic it drafts for while it serves (`hstap serve-loop`, hstap/serve_loop/stage.py).

Why not the connector's own tap mode (capture/vllm/connector.py): it reads the states vLLM's `extract_hidden_states`
method writes into a cache-only KV group, and that method occupies vLLM's one speculative slot: such a server cannot
draft. Under EAGLE-3, vLLM's target model already computes the same states for the drafter on every step: with
`eagle_aux_hidden_state_layer_ids` set it returns (final-norm output (T, H), [the inputs of the aux layers (T, H)]).
This module keeps them, per request and position, and stores each finished request:

- Worker side (`install`, called once in vLLM's worker through `hstap.serve_loop.worker.HstapWorker.hstap_tap_start`):
  `model_runner._model_forward` (vLLM's designated override point for the model call; also the output of a CUDA
  graph replay) is wrapped during `execute_model` calls only (not warm-up or dummy runs). After each target forward
  the rows of the step (input batch order, `query_start_loc`) are written into `BOOK` by request and by the
  position the row was computed at, with the token id it was fed: a verify step computes states for draft tokens
  that may be rejected, and the next step recomputes those positions with the tokens accepted, so the latest write
  at each position is the state of the token the sequence holds (as vLLM's KV cache itself is overwritten by slot).
- Scheduler side (the connector below, in vLLM's engine core): when a request finishes, the connector's tap rules
  (`HstapConnector._tap`: aborted or failed requests dropped, `tap_fraction`) pick it and pass its id, its tokens
  (prompt + the generated tokens it fed) and its prompt length to the worker in the next step's metadata.
- Worker side again (`get_finished`): the request's rows 0..T-1 are taken out of `BOOK`; every position must have
  been computed and fed the token the scheduler says (else the request is dropped with an event: `tap_incomplete`,
  `tap_token_mismatch`); the writer thread (capture/vllm/writer.py, bounded and never making serving wait) stores
  them: aux = the captured layer inputs, `final` = the model's own final-norm output (no norm to apply). Books of
  requests that finished without being stored are discarded.
- Rejected drafts (`side_rows` "first" | "all", `side_max_accepted`; off by default): a verify step of request r
  fed rows a..b-1 (its last token, then its drafts); when r's next step starts at s0 inside that span, rows a..s0-1
  were accepted (s0-a-1 drafts) and rows s0..b-1, fed the drafts the target rejected, are about to be overwritten:
  they are copied first (the first of them, or all), with the draft token, the position, the parent (s0-1, then the
  row before), the step and the accepted count, and stored as the sample's side branches (a store of format version
  2, hstap/store/side.py); the target's distribution at a row is its stored final state through the target's
  lm_head, as for the accepted rows. Left out: the rows of a request's last step (it ended there: which drafts were
  rejected is not known) and a branch whose parent token is not the stored sequence's (a recomputed request).

What is stored equals the connector's tap mode sample for sample (sample id, input_ids, loss_mask, header contents;
`engine.device` says "server (tap beside EAGLE-3)"); only the capture layers differ: they are the drafter's own
(vLLM's `eagle_aux_hidden_state_layer_ids` of the served drafter, canonical ids in the store), so a drafter trained
on the store has the served drafter's shape. Settings refused at start-up: another speculative method than eagle3,
prefix caching (a cached prefix is never computed), pipeline or data parallelism, Model Runner V2 (the tap reads V1's
runner: `V1_READS`; `hstap.engines.vllm_runner`); `"tap": true` is required.
Launch: hstap.serve_loop.stage.server_args (docs/engines.md).
"""

from __future__ import annotations

import collections
import logging

import torch

from hstap.capture.vllm.connector import HstapConnector
from hstap.capture.vllm.writer import VllmWriter
from hstap.common import HstapError

log = logging.getLogger("hstap.vllm")

V1_READS = "model_runner._model_forward, input_batch, query_start_loc"
"""What of vLLM's V1 model runner the tap reads (Model Runner V2 has none of them: docs/engines.md)."""


class _Rows:
    """One request's states by position: (capacity, L, H), the token fed at each position (-1: not computed), the
    span of its last step and the side rows kept so far (the rejected drafts; module docstring)."""

    def __init__(self, L: int, H: int, dtype: torch.dtype, cap: int):
        self.states = torch.empty(cap, L, H, dtype=dtype)  # (cap, L, H)
        self.ids = torch.full((cap,), -1, dtype=torch.long)  # (cap,)
        self.last: tuple[int, int] | None = None  # [start, end) positions of the request's last step
        self.steps = 0  # target forwards that computed rows of this request so far
        self.side: list[dict] = []  # one entry per kept step: its rejected rows (`put`)

    def put(self, pos: torch.Tensor, ids: torch.Tensor, states: torch.Tensor, side_rows: str = "none",
            side_max_accepted: int = -1) -> None:
        s0, n = int(pos[0]), int(pos.numel())
        if side_rows != "none" and self.last is not None and self.last[0] < s0 < self.last[1]:
            self._keep_rejected(s0, side_rows, side_max_accepted)
        need = int(pos.max()) + 1
        if need > self.ids.numel():
            cap = max(need, 2 * self.ids.numel())
            grown = _Rows(states.shape[1], states.shape[2], states.dtype, cap)
            m = self.ids.numel()
            grown.states[:m], grown.ids[:m] = self.states, self.ids
            self.states, self.ids = grown.states, grown.ids
        self.states[pos] = states  # the latest write at a position wins (a rejected draft's row is overwritten)
        self.ids[pos] = ids
        self.last, self.steps = (s0, s0 + n), self.steps + 1

    def _keep_rejected(self, s0: int, side_rows: str, side_max_accepted: int) -> None:
        """This step starts at s0 inside the last step's span [a, b): the last step verified its drafts, the rows
        a..s0-1 were accepted (the token it was fed and `accepted` = s0-a-1 drafts) and rows s0..b-1, fed the drafts
        the target rejected, are about to be overwritten: copy them (a recompute, s0 <= a, keeps nothing)."""
        a, b = self.last
        accepted = s0 - a - 1
        if 0 <= side_max_accepted < accepted:
            return
        hi = b if side_rows == "all" else s0 + 1
        self.side.append({"start": s0, "ids": self.ids[s0:hi].clone(), "states": self.states[s0:hi].clone(),
                          "step": self.steps - 1, "accepted": accepted, "parent_id": int(self.ids[s0 - 1])})

    def side_branches(self, tokens: torch.Tensor) -> dict | None:
        """The kept rows of a request whose accepted sequence is `tokens` (T,), flat (`hstap.store.side` layout):
        rows at positions >= T are left out (the request ended in that step: whether the target rejected them is
        unknown), and a branch whose parent token is not the sequence's (a recomputed request) is dropped. None: no
        rows."""
        T = int(tokens.numel())
        cols: dict[str, list] = {k: [] for k in ("input_ids", "pos", "parent", "step", "accepted", "states")}
        S = 0
        for br in self.side:
            s0, m = br["start"], min(int(br["ids"].numel()), T - br["start"])
            if m <= 0 or int(tokens[s0 - 1]) != br["parent_id"]:
                continue
            parent = torch.arange(-S - 1, -S - m, -1, dtype=torch.long)  # (m-1,): row j's previous row is S+j-1
            cols["parent"].append(torch.cat([torch.tensor([s0 - 1]), parent]))  # then -1-r: the previous side row r
            cols["input_ids"].append(br["ids"][:m])
            cols["pos"].append(torch.arange(s0, s0 + m))
            cols["step"].append(torch.full((m,), br["step"], dtype=torch.long))
            cols["accepted"].append(torch.full((m,), br["accepted"], dtype=torch.long))
            cols["states"].append(br["states"][:m])
            S += m
        if not S:
            return None
        return {k: torch.cat(v) for k, v in cols.items()}  # (S,) each, states (S, L, H)


class RowBook:
    """The worker side's states of running requests (module docstring); one per vLLM worker process (`BOOK`)."""

    def __init__(self):
        self.reqs: dict[str, _Rows] = {}
        self.installed = False
        self.in_step = False
        self.side_rows, self.side_max_accepted = "none", -1  # the connector's settings (ConnectorConfig)
        self.stats: collections.Counter = collections.Counter()

    def record(self, req_ids: list[str], starts: list[int], positions: torch.Tensor, ids: torch.Tensor,
               states: torch.Tensor) -> None:
        """One step's rows: request i owns rows starts[i]:starts[i+1]; positions (T,), ids (T,), states (T, L, H)."""
        for i, rid in enumerate(req_ids):
            a, b = starts[i], starts[i + 1]
            if b <= a:
                continue
            rows = self.reqs.get(rid)
            if rows is None:
                rows = self.reqs[rid] = _Rows(states.shape[1], states.shape[2], states.dtype, max(64, 2 * (b - a)))
            rows.put(positions[a:b], ids[a:b], states[a:b], self.side_rows, self.side_max_accepted)
        self.stats["steps"] += 1

    def take(self, req_id: str, tokens: list[int]) -> tuple[torch.Tensor | None, dict | None, str]:
        """(rows (T, L, H), side branches or None, '') of a finished request whose positions 0..T-1 hold `tokens`;
        (None, None, why) otherwise."""
        rows = self.reqs.pop(req_id, None)
        T = len(tokens)
        if rows is None or rows.ids.numel() < T or bool((rows.ids[:T] < 0).any()):
            return None, None, "tap_incomplete"
        toks = torch.as_tensor(tokens, dtype=torch.long)
        if not torch.equal(rows.ids[:T], toks):
            return None, None, "tap_token_mismatch"
        return rows.states[:T], (rows.side_branches(toks) if rows.side else None), ""

    def discard(self, req_ids) -> None:
        for r in req_ids:
            self.reqs.pop(r, None)


BOOK = RowBook()


def install(model_runner) -> dict:
    """Wrap `model_runner`'s `execute_model` and `_model_forward` (module docstring); returns what the tap records.
    Idempotent. Refuses a runner whose target does not return EAGLE-3's aux states."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    from hstap.engines.vllm_runner import require_v1, runner_of

    require_v1(runner_of(model_runner), "hstap tap beside EAGLE-3", V1_READS)  # before anything is wrapped
    if BOOK.installed:
        return {"installed": True, "already": True}
    if get_tensor_model_parallel_rank() != 0:
        return {"installed": False, "why": "only tensor-parallel rank 0 writes the store"}
    if not getattr(model_runner, "use_aux_hidden_state_outputs", False):
        raise HstapError("hstap tap beside EAGLE-3: the target returns no aux hidden states (is the server's "
                         "speculative method eagle3?)")
    inner = getattr(model_runner.get_model(), "model", None)
    ids = list(getattr(inner, "aux_hidden_state_layers", ()) or ())
    execute, forward = model_runner.execute_model, model_runner._model_forward

    def execute_model(*args, **kwargs):
        BOOK.in_step = True
        try:
            return execute(*args, **kwargs)
        finally:
            BOOK.in_step = False

    def model_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if BOOK.in_step and isinstance(out, tuple) and len(out) == 2:
            try:
                _record(model_runner, kwargs, out)
            except Exception as e:  # noqa: BLE001 - never take the engine down: the requests are dropped at their end
                BOOK.stats["record_errors"] += 1
                log.exception("hstap tap beside EAGLE-3: recording a step failed: %s", e)
        return out

    model_runner.execute_model, model_runner._model_forward = execute_model, model_forward
    BOOK.installed = True
    return {"installed": True, "vllm_ids": ids}


def _record(mr, kwargs: dict, out) -> None:
    hidden, aux = out  # (T', H), [(T', H)] * K: T' >= T (padding)
    n = mr.input_batch.num_reqs
    starts = [int(x) for x in mr.query_start_loc.cpu[: n + 1].tolist()]
    T = starts[-1]
    positions, input_ids = kwargs.get("positions"), kwargs.get("input_ids")
    if input_ids is None or positions is None or positions.dim() != 1:
        BOOK.stats["steps_unrecorded"] += 1  # embeddings or M-RoPE inputs: no token ids / 1-D positions to file by
        return
    states = torch.stack([*(a[:T] for a in aux), hidden[:T]], dim=1).to("cpu")  # (T, K+1, H)
    BOOK.record(list(mr.input_batch.req_ids[:n]), starts, positions[:T].to("cpu", torch.long),
                input_ids[:T].to("cpu", torch.long), states)


def eagle_layers(vllm_config) -> tuple[list[int], list[int], int]:
    """(vLLM ids, canonical aux layers, N) of the served EAGLE-3 drafter: its `eagle_aux_hidden_state_layer_ids`, or
    vLLM's default (2, N//2, N-3) when its config names none."""
    from hstap.layers import check_layers, from_vllm, vllm_default_ids

    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "eagle3":
        raise HstapError("hstap tap beside EAGLE-3: needs --speculative-config with \"method\": \"eagle3\" (got "
                         f"{getattr(spec, 'method', None)!r}); for a server without a drafter use hstap's "
                         "HstapConnector (hstap.capture.vllm.connector) in tap mode")
    N = int(vllm_config.model_config.get_total_num_hidden_layers())
    ids = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None) or []) \
        or vllm_default_ids(N)
    canonical = from_vllm(ids, N)
    check_layers(canonical, N)
    return [int(i) for i in ids], canonical, N


class EagleTapWriter(VllmWriter):
    """The connector's writer; `final` is the model's final-norm output as captured (no norm to apply)."""

    def _final(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, -1]  # (T, H)

    def _header(self) -> dict:
        h = super()._header()
        h["engine"]["device"] = "server (tap beside EAGLE-3)"
        if self.cfg.side_rows != "none":  # a store that carries side branches (hstap.store.format, version 2)
            h["side_branches"] = {"producer": "vllm tap beside EAGLE-3", "rows": self.cfg.side_rows,
                                  "max_accepted": int(self.cfg.side_max_accepted)}
        return h

    def _side(self, save):
        """The side branches of a tapped request: the flat rows (`hstap.store.side`), aux and final split."""
        side = getattr(save, "side", None)
        if side is None or self.cfg.side_rows == "none":
            return None
        st = side.pop("states")  # (S, L, H)
        return {**side, "aux": st[:, :-1], "final": st[:, -1]}


class HstapEagleTapConnector(HstapConnector):
    """See the module docstring: the connector's tap rules and writer, the states from `BOOK`."""

    layers_of = staticmethod(eagle_layers)
    V1_READS = V1_READS

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if not self.cfg.tap:
            raise HstapError("--kv-transfer-config: hstap tap beside EAGLE-3: set \"tap\": true in "
                             "kv_connector_extra_config (this connector only taps served traffic)")
        self._told = False

    @staticmethod
    def state_group(kv_cache_config) -> int:
        return 0  # no cache group is read: the states come from BOOK

    def request_finished(self, request, block_ids: list[int]):
        return self._tap(request, block_ids)  # every client's request, by the tap's rules; no driver here

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._rank0 = get_tensor_model_parallel_rank() == 0
        BOOK.side_rows, BOOK.side_max_accepted = self.cfg.side_rows, int(self.cfg.side_max_accepted)
        if self._rank0:
            mc = self._vllm_config.model_config
            self._writer = EagleTapWriter(self.cfg, self.layers, str(mc.model), str(mc.dtype).replace("torch.", ""))

    def get_finished(self, finished_req_ids: set[str]):
        done = super().get_finished(finished_req_ids)
        BOOK.discard(finished_req_ids)  # requests that finished without being stored (dropped, not tapped)
        return done

    def _take(self, s) -> None:
        self._copies[s.req_id] = None  # reported finished: the scheduler frees its blocks (no copy is pending)
        if not BOOK.installed:
            self.tap_stats["tap_not_started"] += 1
            if not self._told:
                self._told = True
                self._writer.served.event({"event": "error", "kind": "tap_not_started", "message": (
                    "the tap beside EAGLE-3 records nothing until the worker's hstap_tap_start runs "
                    "(POST /collective_rpc {\"method\": \"hstap_tap_start\"}; hstap serve-loop does it)")})
            return
        rows, side, why = BOOK.take(s.req_id, s.token_ids)
        if rows is None:
            self._writer.stats[why] += 1
            self._writer.served.event({"event": "dropped", "reason": why, "req_id": str(s.req_id)[:200],
                                       "tokens": len(s.token_ids)})
            return
        s.side = side
        self._writer.put((s, rows, None))
