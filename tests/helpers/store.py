"""Shared helpers of the store tests (test_store, test_writer, test_batching): a header, deterministic samples of
(T, K, H) states, a store written from them, raw bytes of a tensor."""

from __future__ import annotations

import contextlib
import gc
import subprocess
from pathlib import Path

import pytest
import torch

from hstap.store.writer import StoreWriter

K, H = 3, 16


def header(dtype: str = "bf16", **over) -> dict:
    h = {"target": {"path": "/models/t", "model_type": "llama", "num_layers": 8, "hidden_size": H,
                    "config_sha256": "c" * 64, "weights_fingerprint": "w" * 64, "tokenizer_sha256": "t" * 64,
                    "chat_template_sha256": "h" * 64},
         "engine": {"name": "hf", "version": "5.17", "device": "cpu", "compute_dtype": "fp32"},
         "dtype": dtype, "layers": [1, 3, 4], "hidden_size": H, "capture_config": {"batch_tokens": 64},
         "git_commit": None}
    for k, v in over.items():
        if k in h["target"]:
            h["target"][k] = v
        if k not in h["target"] or k == "hidden_size":
            h[k] = v
    return h


def sample(i: int, seed: int = 0, max_len: int = 40) -> tuple:
    """Deterministic sample i: (input_ids, loss_mask, aux (T,K,H) fp32, final (T,H) fp32); rows of varied scale."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    T = int(torch.randint(1, max_len, (1,), generator=g))
    ids = torch.randint(0, 50_000, (T,), generator=g)
    mask = torch.randint(0, 2, (T,), generator=g)
    mag = torch.exp(torch.randn(T, K, 1, generator=g) * 3)  # per-row scales from ~1e-4 to ~1e4
    aux = torch.randn(T, K, H, generator=g) * mag
    final = torch.randn(T, H, generator=g)
    return ids, mask, aux, final


def sid(i: int) -> str:
    return f"conv-{i:05d}"


def write(path, n: int, dtype: str = "bf16", shard_tokens: int = 100, ids=None, **kw) -> StoreWriter:
    w = StoreWriter(path, header(dtype), shard_tokens=shard_tokens, **kw)
    for i in (range(n) if ids is None else ids):
        w.add(sid(i), *sample(i))
    w.close()
    return w


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of `size` (e.g. "2m") mounted at `path` to provoke ENOSPC; the test is skipped where mounting needs a
    privilege it lacks. Unmounted on the way out (lazily if a handle is still open)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs to provoke ENOSPC (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        gc.collect()  # drop mmap handles so the mount is not busy
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def grow_tmpfs(path: Path, size: str) -> None:
    """Remount the tmpfs at `path` with `size`: space freed, as a user would after ENOSPC."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def rewrite(src: Path, dst: Path, layers=None, edit=None, keep=None, extra=()) -> Path:
    """Copy a real store sample by sample with StoreWriter, optionally claiming other layers or editing samples."""
    from hstap.store.reader import open_store
    from hstap.store.writer import StoreWriter

    s = open_store(src)
    header = {k: v for k, v in s.header.items() if k not in ("format", "version", "created", "created_unix")}
    if layers is not None:
        header["layers"] = layers
    with StoreWriter(dst, header) as w:
        for i in range(len(s)):
            x = s[i]
            if keep is not None and x["id"] not in keep:
                continue
            if edit is not None:
                x = edit(dict(x))
            w.add(x["id"], x["input_ids"], x["loss_mask"], x["aux"], x["final"])
        for x in extra:
            w.add(**x)
    return dst
