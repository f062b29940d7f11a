"""hstap's KV connector for vLLM (>= 0.18; written against 0.32): vLLM's own `extract_hidden_states` method computes the
states, this connector writes them straight into an hstap store with the store's commit protocol.

Loaded by vLLM in its own processes (`--kv-transfer-config`, `kv_connector_module_path`, built by
`hstap.capture.vllm.protocol.kv_transfer_config`; docs/engines.md has the launch command):

- vLLM's `extract_hidden_states` speculative method runs the target with the aux taps on and writes each token's
  captured states (vLLM ids `eagle_aux_hidden_state_layer_ids`, the last one N) into a cache-only KV group, by slot,
  as each prefill chunk runs. Chunked prefill is therefore stitched by vLLM's own block table: when a request
  finishes, its blocks hold every prompt position once.
- Scheduler side (the engine core): `request_finished` keeps the blocks of a request whose `kv_transfer_params` carry
  an hstap request id (`PARAMS_KEY`) and whose prompt was computed to the end, and hands (rid, prompt ids, block ids)
  to the workers in the next step's metadata; it answers `{PARAMS_KEY: rid, "store": STORE}` in the request's output.
  A request whose prompt was not computed to the end (aborted) is dropped with an event, never half-written. Other
  clients' requests are not touched.
- Worker side: `get_finished` gathers those blocks' rows (T, L, H) out of the cache (a copy, so that the blocks can be
  freed at once) and queues them for the writer thread (capture/vllm/writer.py), which applies the final norm to the
  last slot
  (`hstap.capture.vllm.norm`, as `--engine hf` stores `final`), checks the tokens against the prepared row the request
  id names and adds the sample to store rank 0 (`hstap.capture.served.ServedWriter`): committed per shard, exactly once
  (a re-sent sample that is already in the store is skipped), resumable after a kill -9 (the open shard is lost and
  re-sent by the driver), its events in STORE/vllm-events/. Only tensor-parallel rank 0 writes: the captured states are
  the full residual stream on every rank.

Tap mode (`"tap": true` in kv_connector_extra_config; off unless asked): the requests of every client are captured
too, as samples of their prompt and the generated tokens they fed, once they finish (capture/vllm/writer.py says
what is stored and how it is bounded: `tap_fraction`, `max_store_gb`, never making serving wait); an aborted or
failed request (client gone, engine error) is dropped, never half-written.

Refused at start-up, with one line naming the fix: another speculative method than extract_hidden_states, ids whose
last is not N, prefix caching on (a cached prefix would reuse another request's blocks), pipeline parallelism; a
subclass that reads V1's model runner (`V1_READS`) under Model Runner V2 (`hstap.engines.vllm_runner`), before
anything is written. The settings it started with (the model runner among them) go to
STORE/vllm-events/server-<pid>.json, which `hstap capture --engine vllm --server` checks against the run.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, SupportsHMA)

from hstap.capture.tap import tapped
from hstap.capture.vllm.protocol import EVENTS_DIR, HELLO_PREFIX, PARAMS_KEY, ConnectorConfig
from hstap.common import HstapError, atomic_write_json

log = logging.getLogger("hstap.vllm")


@dataclasses.dataclass
class _Save:
    req_id: str
    rid: str | None
    """The hstap request id of a driver's request; None for a tapped request of another client."""
    token_ids: list[int]
    block_ids: list[int]
    prompt_len: int = 0
    """Tapped requests: the prompt's tokens among token_ids (the loss mask starts after them)."""
    side: dict | None = None
    """Worker side, the tap beside EAGLE-3: the request's side branches (rows of rejected drafts), or None."""


@dataclasses.dataclass
class HstapConnectorMetadata(KVConnectorMetadata):
    saves: list[_Save] = dataclasses.field(default_factory=list)


def capture_layers(vllm_config) -> tuple[list[int], list[int], int]:
    """(vLLM ids, canonical aux layers, N) of the target's extract_hidden_states config, or HstapError."""
    from hstap.layers import parse_vllm_layers

    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
        raise HstapError("hstap connector: needs --speculative-config with \"method\": \"extract_hidden_states\" "
                         f"(got {getattr(spec, 'method', None)!r})")
    N = int(vllm_config.model_config.get_total_num_hidden_layers())
    ids = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None) or [])
    vids, layers = parse_vllm_layers(ids, N)
    return vids, layers, N


def settings_problems(vllm_config) -> list[str]:
    """vLLM settings under which the captured states would be wrong or incomplete, each with its fix."""
    p = []
    if vllm_config.cache_config.enable_prefix_caching:
        p.append("prefix caching is on: a request whose prefix is cached reuses blocks another request computed; "
                 "launch with --no-enable-prefix-caching (LLM(enable_prefix_caching=False))")
    if int(vllm_config.parallel_config.pipeline_parallel_size) > 1:
        p.append("pipeline parallelism is not supported: use --pipeline-parallel-size 1")
    if int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1) > 1:
        p.append("data parallelism is not supported (every engine would write store rank 0): use "
                 "--data-parallel-size 1 and one server per store")
    return p


class HstapConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. One instance per vLLM process and role (scheduler, worker)."""

    V1_READS: str | None = None
    """What of V1's model runner a subclass reads (it is refused under Model Runner V2); None: the KV-connector
    interface and the `extract_hidden_states` cache only, which both runners serve."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        from hstap.engines.vllm_runner import configured_runner, require_v1

        self.runner = configured_runner(vllm_config)
        if self.V1_READS:  # before anything is written (the scheduler's hello, the worker's writer)
            require_v1(self.runner, f"hstap {type(self).__name__}", self.V1_READS)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = ConnectorConfig.from_dict(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.vids, self.layers, self.N = self.layers_of(vllm_config)
        self._group = self.state_group(kv_cache_config)
        self._block_size = (kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
                            if kv_cache_config is not None else vllm_config.cache_config.block_size)
        # scheduler side: finished requests whose blocks are kept until a worker copied them
        self._saves: dict[str, _Save] = {}
        self.tap_stats: collections.Counter = collections.Counter()
        # worker side
        self._cache: torch.Tensor | None = None  # (blocks, L, block_size, H)
        self._rank0 = True
        self._copies: dict[str, Any] = {}  # req_id -> CUDA event of its device-to-host copy (None on the CPU)
        self._writer = None  # the writer thread (capture/vllm/writer.py), started with the engine on rank 0
        if role == KVConnectorRole.SCHEDULER:
            problems = settings_problems(vllm_config)
            if problems:
                raise HstapError("hstap connector: " + "; ".join(problems))
            self._hello(vllm_config)

    @staticmethod
    def layers_of(vllm_config) -> tuple[list[int], list[int], int]:
        """(vLLM ids, canonical aux layers, N) this connector stores (a subclass that taps another method overrides)."""
        return capture_layers(vllm_config)

    @staticmethod
    def state_group(kv_cache_config) -> int:
        """The KV cache group whose blocks a finished request keeps until its states are copied."""
        return _hidden_state_group(kv_cache_config)

    def _hello(self, vllm_config) -> None:
        """STORE/vllm-events/server-<pid>.json: the settings this engine captures with (the driver checks them)."""
        import vllm

        mc = vllm_config.model_config
        d = Path(self.cfg.store) / EVENTS_DIR
        d.mkdir(parents=True, exist_ok=True)  # a server may start before the driver created the store
        atomic_write_json(d / f"{HELLO_PREFIX}{os.getpid()}.json", {
            "t": time.time(), "pid": os.getpid(), "vllm": vllm.__version__, "model": str(mc.model),
            "dtype": str(mc.dtype).replace("torch.", ""), "store": os.path.abspath(self.cfg.store),
            "data": os.path.abspath(self.cfg.data) if self.cfg.data else None, "tap": self.cfg.tap,
            "model_runner": self.runner, "layers": self.layers, "vllm_layers": self.vids,
            "tensor_parallel_size": int(vllm_config.parallel_config.tensor_parallel_size),
            "max_num_batched_tokens": int(vllm_config.scheduler_config.max_num_batched_tokens),
            "chunked_prefill": bool(vllm_config.scheduler_config.enable_chunked_prefill),
            "max_model_len": int(mc.max_model_len)})

    # -- scheduler side ------------------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = HstapConnectorMetadata(saves=list(self._saves.values()))
        self._saves.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if not isinstance(rid, str):
            return self._tap(request, block_ids) if self.cfg.tap else (False, None)  # another client's request
        prompt = list(request.prompt_token_ids or [])
        if not prompt or request.num_computed_tokens < len(prompt):
            # aborted before its prompt was computed to the end: nothing to store (the writer reports it)
            self._saves[request.request_id] = _Save(request.request_id, rid, prompt, [])
            return False, {PARAMS_KEY: rid, "store": os.path.abspath(self.cfg.store), "dropped": "incomplete"}
        self._saves[request.request_id] = _Save(request.request_id, rid, prompt, list(block_ids))
        return True, {PARAMS_KEY: rid, "store": os.path.abspath(self.cfg.store)}

    def _tap(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Tap mode: a finished request of any client becomes a sample of its prompt and the generated tokens it fed
        (all but the last); an aborted or failed one is dropped; `tap_fraction` of the others are kept."""
        from vllm.v1.request import RequestStatus

        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self.tap_stats["dropped_aborted"] += 1
            return False, None
        if not tapped(request.request_id, self.cfg.tap_fraction):
            return False, None
        tokens = list(request.all_token_ids)[:-1]  # the last token was sampled, never fed: it has no state
        P = len(request.prompt_token_ids or [])
        if not tokens or request.num_computed_tokens < len(tokens) or P == 0:
            self.tap_stats["dropped_incomplete"] += 1
            return False, None
        self._saves[request.request_id] = _Save(request.request_id, None, tokens, list(block_ids), P)
        return True, {PARAMS_KEY: "tapped", "store": os.path.abspath(self.cfg.store)}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None  # never scheduled: no blocks
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 reports a request as sent

    # -- worker side ---------------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise HstapError(f"hstap connector: expected one extract_hidden_states cache layer, found {len(names)}")
        self._cache = kv_caches[names[0]]  # (blocks, L, block_size, H)
        if self._cache.shape[2] != self._block_size:
            raise HstapError(f"hstap connector: hidden-state cache block size {self._cache.shape[2]} != "
                             f"{self._block_size}: rows would be read from the wrong slots")
        if self._rank0:  # now, at start-up: a writer that cannot start (a hub id, the rank held) fails the launch
            from hstap.capture.vllm.writer import VllmWriter

            mc = self._vllm_config.model_config
            self._writer = VllmWriter(self.cfg, self.layers, str(mc.model), str(mc.dtype).replace("torch.", ""))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # the states are in the cache already; they are read once a request finished

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._rank0:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        for s in getattr(meta, "saves", ()):
            try:
                self._take(s)
            except Exception as e:  # noqa: BLE001 - never take the engine down: the request is reported, its blocks freed
                log.exception("hstap connector: copying request %s failed", s.req_id)
                self._copies[s.req_id] = None
                if self._writer is not None:
                    self._writer.served.event({"event": "error", "kind": "copy", "req_id": str(s.req_id)[:200],
                                               "message": f"{type(e).__name__}: {e}"})
        done = {r for r, ev in self._copies.items() if ev is None or ev.query()}
        for r in done:
            del self._copies[r]
        return done or None, None

    def _take(self, s: _Save) -> None:
        """Copy a finished request's rows out of the cache and queue them for the writer thread."""
        if not s.block_ids:
            self._writer.put((s, None, None))
            return
        T, bs = len(s.token_ids), self._block_size
        blocks = torch.as_tensor(s.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).flatten()[:T]  # (T,)
        slots = slots.to(self._cache.device)
        rows = self._cache[slots // bs, :, slots % bs]  # (T, L, H), a gather: a copy, the blocks can be freed
        event = None
        if rows.is_cuda:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)  # (T, L, H)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            rows = host
        self._copies[s.req_id] = event
        self._writer.put((s, rows, event))

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _hidden_state_group(kv_cache_config) -> int:
    """Index of the KV cache group that holds the extracted hidden states (by spec type)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise HstapError(f"hstap connector: no single extract_hidden_states KV cache group among {len(groups)} groups "
                     "(MLA or hybrid targets are not supported)")
