"""A random-weight Llama target (HF directory, no tokenizer) and a prepared set of random-token samples for it.

    python benchmarks/make_random_target.py --target /dev/shm/mg/t8b --data /dev/shm/mg/p8b --samples 384 --seq 2048
    python benchmarks/make_random_target.py --tiny --target /tmp/t --data /tmp/p          # CPU, seconds

Target: Llama-3.1-8B-shaped by default (32 layers, H 4096, 32/8 heads of 128, intermediate 14336, vocab 128256, untied
head, rope 500000), `--tiny` = 8 layers, H 128, vocab 1000. Weights are HF's own init (normal, std 0.02) in --dtype
(bf16), built directly on the GPU when one is available (`_from_config` under `torch.device`: no CPU init), saved with
`save_pretrained` (safetensors + config.json). No tokenizer is written: `hstap capture` then checks the prepared data by
vocab_size and the largest token id only (hstap.data.fits.check_tokenizer).

Prepared set: the layout `hstap prepare` writes (hstap.data.prepare): an Arrow dataset (`save_to_disk`) with id (str),
input_ids (list[int32], uniform in [0, vocab)), loss_mask (list[int8], all 1), plus token_freq.safetensors,
vocab_map.safetensors (the --draft-vocab most frequent ids, hstap.artifacts.vocab_map.build_vocab_map) and meta.json (format
"hstap-prepared", tokenizer and chat template None). Both outputs are built in a hidden temp sibling and renamed into
place; an existing one is refused unless --force. Prints one JSON line (sizes and timings).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                rms_norm_eps=1e-5)
TINY = dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=1000, max_position_embeddings=4096, rope_theta=10000.0,
            rms_norm_eps=1e-5)


def _temp_sibling(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the result should be a normal directory
    return tmp


def _place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished temp dir into place (replacing `out` only with --force)."""
    from hstap.common import fsync_dir

    if out.exists():
        if not force:
            raise SystemExit(f"{out}: already exists (use --force to replace it)")
        shutil.rmtree(out)
    os.rename(tmp, out)
    fsync_dir(out.parent)


def make_target(out: Path, shape: dict, dtype: str, device: str, seed: int, force: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hstap.device import auto_device

    dev = torch.device(auto_device(device))
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(cfg, dtype=dt)  # HF's init runs on `dev`, in `dt`
    model.eval()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    init_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    tmp = _temp_sibling(out)
    try:
        t1 = time.perf_counter()
        model.save_pretrained(str(tmp))
        save_s = time.perf_counter() - t1
        nbytes = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        _place(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"path": str(out), "device": str(dev), "dtype": dtype, "params": n_params, "gb": round(nbytes / 1e9, 3),
            "init_s": round(init_s, 2), "save_s": round(save_s, 2), "shape": shape}


def make_prepared(out: Path, vocab: int, samples: int, seq: int, draft_vocab: int, seed: int, force: bool) -> dict:
    """A prepared set of `samples` random sequences of `seq` tokens (the layout of hstap.data.prepare._prepare_into)."""
    import datasets
    import pyarrow as pa
    from safetensors.numpy import save as st_save

    from hstap.common import atomic_write_bytes, atomic_write_json
    from hstap.data.prepare import record_batch
    from hstap.artifacts.vocab_map import build_vocab_map, check_vocab_map

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(samples, seq), dtype=np.int32)  # (N, L)
    mask = np.ones((samples, seq), dtype=np.int8)  # (N, L)
    rids = [f"r{i:06d}" for i in range(samples)]
    freq = np.bincount(ids.reshape(-1), minlength=vocab).astype(np.int64)  # (V,) every token is loss-masked
    d2t, t2d = build_vocab_map(freq, draft_vocab)
    check_vocab_map(d2t, t2d, vocab)
    schema = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    batches = [record_batch(rids[a:a + 256], list(ids[a:a + 256]), list(mask[a:a + 256]))
               for a in range(0, samples, 256)]
    table = pa.Table.from_batches(batches, schema=schema)
    tmp = _temp_sibling(out)
    try:
        ds = datasets.Dataset(datasets.table.InMemoryTable(table))
        datasets.disable_progress_bars()
        ds.save_to_disk(str(tmp))
        atomic_write_bytes(tmp / "token_freq.safetensors", st_save({"token_freq": freq}))
        atomic_write_bytes(tmp / "vocab_map.safetensors", st_save({"d2t": d2t, "t2d": t2d}))
        total = samples * seq
        coverage = 100.0 * float(freq[t2d].sum()) / max(1, total)
        meta = {"format": "hstap-prepared", "format_version": 1, "tokenizer": None, "tokenizer_sha256": None,
                "chat_template": None, "chat_template_sha256": None, "vocab_size": vocab, "max_len": seq,
                "data": [f"random: {samples} x {seq} tokens, seed {seed}"],
                "counts": {"read": samples, "written": samples, "truncated": 0, "skipped": {}, "skipped_total": 0,
                           "masked_tokens": total, "total_tokens": total},
                "draft_vocab": {"requested": draft_vocab, "size": len(d2t), "clamped": len(d2t) < draft_vocab,
                                "distinct_masked_tokens": int((freq > 0).sum()),
                                "coverage_pct": round(coverage, 4)}}
        atomic_write_json(tmp / "meta.json", meta)
        _place(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(out), "samples": samples, "seq": seq, "tokens": samples * seq, "vocab": vocab,
            "draft_vocab": len(d2t), "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target directory to write (skipped when not given)")
    p.add_argument("--data", help="prepared-set directory to write (skipped when not given)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (8 layers, H 128, vocab 1000) instead of 8B")
    p.add_argument("--samples", type=int, default=None, help="samples in the prepared set (default 384; 24 tiny)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; 64 tiny)")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary of the map (default 32000; 256)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weight dtype")
    p.add_argument("--device", default="auto", help="where the weights are initialised (auto: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace existing outputs")
    a = p.parse_args(argv)
    if not a.target and not a.data:
        p.error("give --target and/or --data")
    shape = TINY if a.tiny else LLAMA_8B
    for k, full, tiny in (("samples", 384, 24), ("seq", 2048, 64), ("draft_vocab", 32000, 256)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    out: dict = {"tool": "make_random_target", "tiny": a.tiny}
    if a.data:
        out["data"] = make_prepared(Path(a.data).absolute(), shape["vocab_size"], a.samples, a.seq, a.draft_vocab,
                                    a.seed, a.force)
        print(f"prepared: {a.samples} x {a.seq} random tokens -> {a.data} ({out['data']['seconds']} s)",
              file=sys.stderr)
    if a.target:
        out["target"] = make_target(Path(a.target).absolute(), shape, a.dtype, a.device, a.seed, a.force)
        t = out["target"]
        print(f"target: {t['params'] / 1e9:.2f} B params, {t['gb']} GB {a.dtype} -> {a.target} "
              f"(init {t['init_s']} s on {t['device']}, save {t['save_s']} s)", file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
