"""A stream of prefill batches through the SGLang capture hook (the real `sglang` types, as tests/capture/test_sglang_hook.py
drives it), in the test process or in a child process that a test kills while the hook's writer thread commits shards.

Each request is one prepared row, whole, in an EXTEND batch of its own; its hidden states are known in advance
(`expected`), so a store can be checked sample by sample whichever process wrote it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from helpers.procs import redirect_output
from helpers.sglang import H, LAYERS, forward_batch, import_sglang, logits_root, publish_server_args


def expected(ds, row: int) -> dict:
    """The sample the hook must store for prepared row `row` (its states seeded by the row)."""
    g = torch.Generator().manual_seed(1000 + row)
    T = len(ds[row]["input_ids"])
    return {"input_ids": torch.tensor(ds[row]["input_ids"]), "loss_mask": torch.tensor(ds[row]["loss_mask"]),
            "aux": torch.randn(T, len(LAYERS), H, generator=g), "final": torch.randn(T, H, generator=g)}


def attach(store: Path, data: Path, target: Path, **cfg):
    """A LogitsProcessor with the hook attached by SGLang's `register_forward_hooks` -> (root module, hook)."""
    import_sglang()
    publish_server_args(target)
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from transformers import AutoConfig

    from hstap.capture.sglang.protocol import hook_spec

    root = logits_root(AutoConfig.from_pretrained(target))
    register_forward_hooks(root, json.loads(json.dumps([hook_spec(store, data, LAYERS, **cfg)])))
    hooks = list(root.logits_processor._forward_hooks.values())
    assert len(hooks) == 1
    return root, hooks[0]


def feed(root, ds, rows, session: str, delay: float = 0.0) -> None:
    """One EXTEND batch per row (the request whole), `delay` seconds apart."""
    from hstap.capture.session import encode_rid

    for row in rows:
        e = expected(ds, row)
        T = len(e["input_ids"])
        fb = forward_batch("EXTEND", [encode_rid(session, row, ds[row]["id"])], [T], [0], e["input_ids"])
        root.logits_processor(e["input_ids"], e["final"], root.lm_head, fb, e["aux"].reshape(T, -1))
        time.sleep(delay)


def stream_child(argv: list[str], env: dict, log_path: str, store: str, data: str, target: str, rows: list[int],
                 delay: float) -> None:
    """Body of a child process: feed `rows` through a fresh hook on `store` (small shards, so commits come often)."""
    os.environ.update(env)
    redirect_output(log_path)
    torch.set_num_threads(1)
    from hstap.data.prepare import load_prepared

    root, hook = attach(Path(store), Path(data), Path(target), flush_s=0.05, shard_tokens=64)
    print("streaming", flush=True)
    feed(root, load_prepared(data), rows, "killed", delay)
    hook.close()
    os._exit(0)
