"""What the `vllm` engine's two sides agree on: hstap's KV connector inside vLLM (capture/vllm/connector.py, loaded by
vLLM through `kv_connector_module_path`) and the driver in the hstap process (capture/vllm/driver.py). Each imports this
module and never the other; neither needs the other's process.

- `CONNECTOR`, `CONNECTOR_MODULE` and `kv_transfer_config(...)`: the `--kv-transfer-config` that loads the connector;
  its `kv_connector_extra_config` names the store and the prepared set (`ConnectorConfig`'s fields); `TAP_CONNECTOR`,
  `TAP_CONNECTOR_MODULE` and `tap_transfer_config(...)`: the same for the tap beside EAGLE-3 (capture/vllm/eagle_tap.py,
  the serve loop's); both built by `hstap.engines.vllm.kv_transfer_config`;
- `speculative_config(vllm_ids)`: vLLM's `extract_hidden_states` method with the ids to capture (vLLM's convention,
  the last one N: the last layer's output before the final norm);
- `EVENTS_DIR`: the connector's events (drops, errors) and its `server-<pid>.json` (the settings it started with,
  written when vLLM starts, which the driver checks), and the driver's end of a session; request ids and session ends
  are hstap/capture/session.py's;
- `PARAMS_KEY`: the key of a request's `kv_transfer_params` that carries its hstap request id; the connector answers
  with `{PARAMS_KEY: rid, "store": STORE}` in the request's output (the driver checks both).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex

from hstap.common import HstapError
from hstap.config import FieldError, positive
from hstap.engines.vllm import kv_transfer_config as producer_config

CONNECTOR = "HstapConnector"
CONNECTOR_MODULE = "hstap.capture.vllm.connector"
TAP_CONNECTOR = "HstapEagleTapConnector"
TAP_CONNECTOR_MODULE = "hstap.capture.vllm.eagle_tap"
EVENTS_DIR = "vllm-events"  # inside the store; the store's reader ignores other files
HELLO_PREFIX = "server-"
PARAMS_KEY = "hstap"
SIDE_ROWS = ("none", "first", "all")


def speculative_config(vllm_ids: list[int]) -> dict:
    """vLLM's `extract_hidden_states` method capturing `vllm_ids` (input of layer j; the last is N)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in vllm_ids]}}}


def kv_transfer_config(store: str, data: str, **extra) -> dict:
    """The `kv_transfer_config` that loads hstap's connector writing into `store` (samples checked against `data`)."""
    return producer_config(CONNECTOR, CONNECTOR_MODULE,
                           {"store": os.path.abspath(store), "data": os.path.abspath(data), **extra})


def tap_transfer_config(store: str, **extra) -> dict:
    """The `kv_transfer_config` that loads the tap beside EAGLE-3 writing the served requests into `store` (`extra`:
    the connector's other settings, `ConnectorConfig`'s: shard_tokens, flush_s, tap_dtype, max_store_gb)."""
    return producer_config(TAP_CONNECTOR, TAP_CONNECTOR_MODULE, {"store": str(store), "tap": True, **extra})


def serve_command(target: str, store: str, data: str, vllm_ids: list[int], port: int = 8000,
                  dtype: str = "bfloat16") -> str:
    """The `vllm serve` command line of a capture server for this store (docs/engines.md explains each flag)."""
    return " ".join(["vllm serve", shlex.quote(os.path.abspath(target)), f"--port {port}", f"--dtype {dtype}",
                     "--no-enable-prefix-caching",
                     "--speculative-config", shlex.quote(json.dumps(speculative_config(vllm_ids))),
                     "--kv-transfer-config", shlex.quote(json.dumps(kv_transfer_config(store, data)))])


@dataclasses.dataclass
class ConnectorConfig:
    """The connector's `kv_connector_extra_config`."""
    store: str
    """Store directory (created by the driver before it sends requests)."""
    data: str
    """Prepared dataset directory: input_ids and loss_mask of each sample, checked against what vLLM computed."""
    shard_tokens: int = 1 << 20
    """Tokens per shard file (as `hstap capture --shard-tokens`)."""
    flush_s: float = 1.0
    """Commit the open shard after this many idle seconds (the driver sees every sample without a full shard)."""
    queue_size: int = 64
    """Finished requests waiting for the writer thread before the worker waits (back-pressure; in tap mode a full
    queue drops the request instead: serving never waits for the tap)."""
    tap: bool = False
    """Tap mode: also capture the requests of any client (prompt + generated tokens) into `store`, which the
    connector creates (no driver); off unless asked."""
    tap_fraction: float = 1.0
    """Tap mode: the fraction of finished requests captured (chosen by a hash of the request id)."""
    tap_dtype: str = "bf16"
    """Tap mode: the store's dtype when the connector creates it (bf16, fp8, fp32)."""
    max_store_gb: float | None = None
    """Tap mode: stop capturing (dropping, counted) once the store's shards hold this many GB."""
    side_rows: str = "none"
    """Tap beside EAGLE-3 only: the rows of rejected drafts each verify step keeps, as side branches of the stored
    sample (hstap/capture/vllm/eagle_tap.py): "none" (a plain store), "first" (the first rejected draft of a step),
    "all" (every draft past the accepted prefix)."""
    side_max_accepted: int = -1
    """Tap beside EAGLE-3, with side_rows: keep only the steps that accepted at most this many drafts (the worst
    steps); -1: every step with a rejection."""

    @classmethod
    def from_dict(cls, cfg: dict) -> "ConnectorConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        need = ("store",) if cfg.get("tap") else ("store", "data")
        unknown, missing = sorted(set(cfg) - names), [k for k in need if k not in cfg]
        if unknown or missing:
            raise HstapError(f"--kv-transfer-config: hstap: kv_connector_extra_config: unknown keys {unknown}, "
                             f"missing keys {missing}")
        c = cls(**{"data": "", **cfg})
        if not 0.0 < c.tap_fraction <= 1.0 or c.tap_dtype not in ("bf16", "fp8", "fp32"):
            raise HstapError("--kv-transfer-config: hstap: tap_fraction must be in (0, 1], tap_dtype bf16|fp8|fp32")
        try:
            positive("", c, ("flush_s", "max_store_gb"))
        except FieldError as e:  # a key of the JSON, not a flag
            raise HstapError(f"--kv-transfer-config: hstap: kv_connector_extra_config: {e.name}: {e.reason}") from None
        if c.side_rows not in SIDE_ROWS or int(c.side_max_accepted) < -1:
            raise HstapError(f"--kv-transfer-config: hstap: side_rows must be one of {', '.join(SIDE_ROWS)} (got "
                             f"{c.side_rows!r}), side_max_accepted >= -1 (got {c.side_max_accepted})")
        return c
