"""Capture throughput of the embedded engine against its own baselines, measured in one run.

    python benchmarks/bench_capture.py --disk-dir /mnt/local/hstap-bench      # H200: Llama-3.1-8B-shaped, random bf16
    python benchmarks/bench_capture.py --tiny                                  # CPU smoke test (seconds)

What is measured (same random target, same batches of 8 x 2048 tokens, warm-up excluded, CUDA synchronised):
  (a) plain prefill: the base model's forward over the batches, no hooks, nothing copied or stored (the ceiling);
  (b) capture into a store on /dev/shm (RAM: the pipeline without a disk), bf16 and fp8;
  (c) capture into a store in --disk-dir (a real local disk); --disk-variants adds passes without the writer's
      end-of-run shard shrinking (StoreWriter.expect) and/or its early writeback (hstap.store.writer.START_WRITEBACK);
  (d) the sink's sequential write bandwidth (large writes + fsync) in /dev/shm and --disk-dir: what (b)/(c) can reach;
  (e) the per-sample cost of SGLang's return_hidden_states transport, `t.cpu().tolist()` + `json.dumps`, for one
      2048-token sample of 3 x 7168 bf16 (Kimi-K2/DeepSeek-V3 width), against our binary path for the same tensor
      (D2H into pinned memory + StoreWriter.add + shard commit): the speedup factor;
  (f) bytes per token of each store against `store_bytes_per_token`.
Each capture pass reports its end-to-end rate (timer stopped once the last shard is committed: the goal's figure) and,
beside it, the rate until the GPU finished its last forward (`*_until_gpu_done`; the difference is the writer
draining what was still queued). Pinned staging buffers are allocated before the timer starts, as a long capture
allocates them in its first batches and then only reuses them.
Prints a table, then ONE JSON line with every number. Sample counts and sizes are flags; the default run (512 x 2048
tokens per pass, ~30 s each on an H200) fits in ~5 minutes (model init ~10 s, the JSON baseline ~20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hstap.store.writer as writer_mod  # noqa: E402
from hstap.batching import pack_by_tokens  # noqa: E402
from hstap.capture.hf import run_capture  # noqa: E402
from hstap.capture.staging import PinnedPool  # noqa: E402
from hstap.layers import default_aux_layers  # noqa: E402
from hstap.model_dir import auto_device  # noqa: E402
from hstap.models.target import Target  # noqa: E402
from hstap.store.format import store_bytes_per_token  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402
from hstap.store.writer import StoreWriter  # noqa: E402

LLAMA_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
            vocab_size=1000, max_position_embeddings=2048)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_target(shape: dict, dev: torch.device, dtype: torch.dtype, seed: int) -> Target:
    """A random Llama built directly on `dev` in `dtype` (HF's init runs there: no CPU init, nothing saved to disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa" and next(model.parameters()).device.type == dev.type
    model.eval().requires_grad_(False)
    return Target(model)


def make_batches(n: int, seq: int, batch_tokens: int, vocab: int, seed: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    samples = [{"id": f"s{i:06d}", "input_ids": torch.randint(0, vocab, (seq,), generator=g),
                "loss_mask": torch.ones(seq, dtype=torch.uint8)} for i in range(n)]
    return [[samples[i] for i in b] for b in pack_by_tokens([seq] * n, batch_tokens)]


def header(target: Target, layers: list[int], dtype: str, shape: dict) -> dict:
    return {"target": {"path": "random-llama (in memory)", "model_type": "llama", "num_layers": target.num_layers,
                       "hidden_size": target.hidden_size, "config_sha256": json.dumps(shape, sort_keys=True),
                       "weights_fingerprint": "random", "tokenizer_sha256": None, "chat_template_sha256": None},
            "engine": {"name": "hf", "version": "bench", "device": str(target.device),
                       "compute_dtype": str(target.dtype)},
            "dtype": dtype, "layers": layers, "hidden_size": target.hidden_size, "capture_config": {"bench": True}}


@torch.no_grad()
def bench_prefill(target: Target, batches, dev) -> dict:
    def run(bs):
        for b in bs:
            ids = torch.stack([s["input_ids"] for s in b]).to(dev, non_blocking=True)  # (B, T)
            target.base(input_ids=ids, use_cache=False)  # like Target.capture: no KV cache kept

    run(batches[:1])  # warm-up (kernels, allocator)
    sync(dev)
    t0 = time.perf_counter()
    run(batches)
    sync(dev)
    dt = time.perf_counter() - t0
    tok = sum(len(s["input_ids"]) for b in batches for s in b)
    return {"tokens": tok, "seconds": round(dt, 3), "tok_per_s": round(tok / dt, 1)}


def fit_batches(batches, bytes_per_sample: int, directory: Path, keep: float = 0.7):
    """As many batches as fit in `keep` of the free space of `directory` (a small /dev/shm must not end the run)."""
    free = shutil.disk_usage(directory).free * keep
    out, used = [], 0
    for b in batches:
        need = bytes_per_sample * len(b)
        if used + need > free:
            break
        out.append(b)
        used += need
    return out


def bench_capture(target: Target, layers, batches, directory: Path, dtype: str, shape: dict, shard_tokens: int,
                  queue_size: int, dev, tail: bool = True, writeback: bool = True) -> dict:
    """One timed capture pass. `tail`: tell the writer how many tokens are coming (StoreWriter.expect, what `hstap
    capture` does), so the shards shrink toward the end; False measures fixed-size shards. `writeback`: the writer
    starts each piece's writeback as soon as it is written (hstap.store.writer.START_WRITEBACK, the default)."""
    directory.mkdir(parents=True, exist_ok=True)
    seq = len(batches[0][0]["input_ids"])
    bps = store_bytes_per_token(len(layers), target.hidden_size, dtype) * seq
    use = fit_batches(batches, bps, directory)
    if len(use) < 2:
        return {"skipped": f"not enough free space in {directory} ({shutil.disk_usage(directory).free / 1e9:.1f} GB)"}
    out = Path(tempfile.mkdtemp(prefix="hstap-bench-store-", dir=directory))
    pool = PinnedPool() if dev.type == "cuda" else None
    prev, writer_mod.START_WRITEBACK = writer_mod.START_WRITEBACK, writeback
    try:
        w = StoreWriter(out / "warm", header(target, layers, dtype, shape), shard_tokens=shard_tokens)
        run_capture(target, layers, w, use[:1], dtype=dtype, queue_size=queue_size, pool=pool)  # warm-up: kernels
        w.close()
        if pool is not None:
            # the staging buffers a long capture allocates in its first batches and then reuses: queue + copy + writer
            # + those held by the open shard (the store keeps views of them until the shard is committed)
            batch_bytes = store_bytes_per_token(len(layers), target.hidden_size, dtype) * max(map(_tokens, use))
            pool.reserve(batch_bytes + 4096, queue_size + 3 + -(-shard_tokens * bps // seq // batch_bytes))
        w = StoreWriter(out / "store", header(target, layers, dtype, shape), shard_tokens=shard_tokens)
        if tail:
            w.expect(sum(map(_tokens, use)))
        pinned_before = pool.allocated if pool is not None else 0
        last = use[-1]
        marks = {}

        def progress(run, batch):
            if batch is last:  # when the GPU finished its last forward (the rest is the writer draining)
                sync(dev)
                marks["gpu_done"] = time.perf_counter()

        sync(dev)
        t0 = time.perf_counter()
        st = run_capture(target, layers, w, use, dtype=dtype, queue_size=queue_size, progress=progress, pool=pool)
        w.close()  # the last shard is committed: every byte is on the sink
        dt = time.perf_counter() - t0
        gpu_s = marks["gpu_done"] - t0
        s = open_store(out / "store")
        tok = sum(int(e["tokens"]) for e in s.manifest["shards"])
        nbytes = sum(int(e["bytes"]) for e in s.manifest["shards"])
        return {"dir": str(directory), "dtype": dtype, "samples": len(s), "tokens": tok, "seconds": round(dt, 3),
                "tok_per_s": round(tok / dt, 1), "gb": round(nbytes / 1e9, 3), "gb_per_s": round(nbytes / 1e9 / dt, 3),
                "gpu_done_s": round(gpu_s, 3), "tok_per_s_until_gpu_done": round(tok / gpu_s, 1),
                "drain_s": round(dt - gpu_s, 3), "tail": tail, "writeback": writeback,
                "shards": len(s.manifest["shards"]), "last_shard_tokens": int(s.manifest["shards"][-1]["tokens"]),
                "bytes_per_token": round(nbytes / tok, 2),
                "bytes_per_token_formula": store_bytes_per_token(len(layers), target.hidden_size, dtype),
                "gpu_waited_for_storage_s": round(st["writer_wait_s"], 3),
                "pinned_allocations_in_timed_run": st["pinned_allocations"] - pinned_before}
    finally:
        writer_mod.START_WRITEBACK = prev
        shutil.rmtree(out, ignore_errors=True)


def _tokens(batch) -> int:
    return sum(len(s["input_ids"]) for s in batch)


def bench_sink(directory: Path, gb: float, block_mb: int = 64) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(gb * 1e9)
    if shutil.disk_usage(directory).free * 0.7 < nbytes:
        nbytes = int(shutil.disk_usage(directory).free * 0.5)
    block = os.urandom(block_mb << 20)
    fd, path = tempfile.mkstemp(prefix="hstap-bench-sink-", dir=directory)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return {"dir": str(directory), "gb": round(written / 1e9, 3), "seconds": round(dt, 3),
            "gb_per_s": round(written / 1e9 / dt, 3)}


def bench_json_vs_binary(tokens: int, hidden: int, dev: torch.device, directory: Path) -> dict:
    """SGLang's return_hidden_states transport for one sample vs ours, for the same (T, 3*H) bf16 tensor."""
    x = torch.randn(tokens, 3, hidden, device=dev, dtype=torch.bfloat16)  # (T, 3, H): 2 aux layers + final
    sync(dev)
    t0 = time.perf_counter()
    lst = x.reshape(tokens, 3 * hidden).cpu().tolist()  # what the scheduler does per request
    t_list = time.perf_counter() - t0
    body = json.dumps({"meta_info": {"hidden_states": [lst]}})  # what the HTTP response carries
    t_json = time.perf_counter() - t0
    json_bytes = len(body)
    del lst, body

    hdr = {"target": {}, "engine": {}, "dtype": "bf16", "layers": [0, 1], "hidden_size": hidden}
    out = Path(tempfile.mkdtemp(prefix="hstap-bench-bin-", dir=directory))
    pin = dev.type == "cuda"
    try:
        aux_h = torch.empty(tokens, 2, hidden, dtype=torch.bfloat16, pin_memory=pin)  # (T, 2, H): pooled in capture
        final_h = torch.empty(tokens, hidden, dtype=torch.bfloat16, pin_memory=pin)  # (T, H)
        times = []
        for rep in range(3):  # best of 3 (first includes page faults of the fresh buffers)
            w = StoreWriter(out / f"s{rep}", hdr, shard_tokens=1 << 30)
            sync(dev)
            t0 = time.perf_counter()
            aux_h.copy_(x[:, :2], non_blocking=pin)
            final_h.copy_(x[:, 2], non_blocking=pin)
            sync(dev)
            w.add("one", torch.zeros(tokens, dtype=torch.int32), torch.ones(tokens, dtype=torch.uint8), aux_h, final_h)
            w.flush()  # shard written, fsynced, committed
            times.append(time.perf_counter() - t0)
            w.close()
        t_bin = min(times)
        bin_bytes = sum(int(e["bytes"]) for e in open_store(out / "s0").manifest["shards"])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"tokens": tokens, "width": 3 * hidden, "tolist_s": round(t_list, 3), "tolist_json_s": round(t_json, 3),
            "json_mb": round(json_bytes / 1e6, 1), "binary_s": round(t_bin, 4), "binary_mb": round(bin_bytes / 1e6, 1),
            "binary_dir": str(directory), "speedup": round(t_json / t_bin, 1)}


VARIANTS = {"default": (True, True), "fixed": (False, True), "nowb": (True, False), "old": (False, False)}
"""--disk-variants: (tail shards, early writeback) of each disk pass."""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto")
    ap.add_argument("--samples", type=int, default=None, help="samples per capture pass (default 512; tiny 16)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; tiny 128)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch (default 16384 = 8 x 2048)")
    ap.add_argument("--shard-tokens", type=int, default=32768, help="tokens per shard (32768 = 1 GiB for 8B bf16)")
    ap.add_argument("--queue-size", type=int, default=4)
    ap.add_argument("--shm-dir", default="/dev/shm", help="RAM-backed directory for (b)")
    ap.add_argument("--disk-dir", default=None, help="directory on a local disk for (c) and (d); skipped without it")
    ap.add_argument("--sink-gb", type=float, default=None, help="GB written for (d) (default 8; tiny 0.05)")
    ap.add_argument("--json-tokens", type=int, default=None, help="tokens of the JSON baseline sample (default 2048)")
    ap.add_argument("--json-hidden", type=int, default=None, help="hidden size of the JSON baseline (default 7168)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 capture pass")
    ap.add_argument("--disk-variants", default="default",
                    help="comma list of disk passes, run in this order: default (shards shrink at the end + early "
                         "writeback), fixed (fixed-size shards), nowb (no early writeback), old (neither)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    variants = a.disk_variants.split(",")
    bad = [v for v in variants if v not in VARIANTS] + [v for v in set(variants) if variants.count(v) > 1]
    if bad:
        ap.error(f"--disk-variants: unknown or repeated {bad} (choose from {', '.join(VARIANTS)})")

    dev = torch.device(auto_device(a.device))
    shape = TINY if a.tiny else LLAMA_8B
    samples = a.samples or (16 if a.tiny else 512)
    seq = a.seq or (128 if a.tiny else 2048)
    batch_tokens = a.batch_tokens or 8 * seq
    sink_gb = a.sink_gb if a.sink_gb is not None else (0.05 if a.tiny else 8.0)
    json_tokens = a.json_tokens or (128 if a.tiny else 2048)
    json_hidden = a.json_hidden or (256 if a.tiny else 7168)
    # bf16 on the GPU (what serving runs); fp32 on the CPU, where bf16 matmuls are slow and the smoke test checks flow
    cdtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    t_all = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                 "torch": torch.__version__, "compute_dtype": str(cdtype).replace("torch.", ""), "tiny": a.tiny,
                 "model": {k: shape[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                 "vocab_size")},
                 "samples": samples, "seq": seq, "batch_tokens": batch_tokens, "shard_tokens": a.shard_tokens}
    t0 = time.perf_counter()
    target = build_target(shape, dev, cdtype, a.seed)
    sync(dev)
    res["init_s"] = round(time.perf_counter() - t0, 2)
    layers = default_aux_layers(target.num_layers)
    res["layers"] = layers
    batches = make_batches(samples, seq, batch_tokens, shape["vocab_size"], a.seed)

    res["prefill"] = bench_prefill(target, batches, dev)
    shm = Path(a.shm_dir)
    res["capture_shm_bf16"] = bench_capture(target, layers, batches, shm, "bf16", shape, a.shard_tokens,
                                            a.queue_size, dev)
    if not a.no_fp8:
        res["capture_shm_fp8"] = bench_capture(target, layers, batches, shm, "fp8", shape, a.shard_tokens,
                                               a.queue_size, dev)
    res["sink_shm"] = bench_sink(shm, sink_gb)
    if a.disk_dir:
        disk = Path(a.disk_dir)
        for v in variants:
            tail, wb = VARIANTS[v]
            res["capture_disk_bf16" + ("" if v == "default" else f"_{v}")] = bench_capture(
                target, layers, batches, disk, "bf16", shape, a.shard_tokens, a.queue_size, dev, tail=tail,
                writeback=wb)
        res["sink_disk"] = bench_sink(disk, sink_gb)
    del target, batches
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        res["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
    res["json_vs_binary"] = bench_json_vs_binary(json_tokens, json_hidden, dev, shm)
    pre = res["prefill"]["tok_per_s"]
    for k in [k for k in res if k.startswith("capture_")]:
        if "tok_per_s" in res[k]:
            res[k]["vs_prefill"] = round(res[k]["tok_per_s"] / pre, 3)
            res[k]["vs_prefill_until_gpu_done"] = round(res[k]["tok_per_s_until_gpu_done"] / pre, 3)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    report(res)
    print(json.dumps(res, separators=(",", ":")))
    return res


def report(r: dict) -> None:
    m = r["model"]
    print(f"# hstap capture bench: {r['device']}, torch {r['torch']}, {r['compute_dtype']}; Llama shape "
          f"L{m['num_hidden_layers']} H{m['hidden_size']} I{m['intermediate_size']} V{m['vocab_size']}; "
          f"{r['samples']} x {r['seq']} tokens, batches of {r['batch_tokens']} tokens, layers {r['layers']}")
    print(f"{'measurement':40s} {'tok/s':>12s} {'vs prefill':>10s} {'GB/s':>8s} {'bytes/tok':>10s} {'formula':>8s}")
    p = r["prefill"]
    print(f"{'(a) plain prefill (no hooks)':40s} {p['tok_per_s']:12,.0f} {'1.000':>10s}")
    for key, label in (("capture_shm_bf16", "(b) capture bf16 -> /dev/shm"),
                       ("capture_shm_fp8", "(b) capture fp8 -> /dev/shm"),
                       ("capture_disk_bf16_old", "(c) capture bf16 -> disk, old writer"),
                       ("capture_disk_bf16_fixed", "(c) capture bf16 -> disk, fixed shards"),
                       ("capture_disk_bf16_nowb", "(c) capture bf16 -> disk, no writeback"),
                       ("capture_disk_bf16", "(c) capture bf16 -> disk")):
        c = r.get(key)
        if c is None:
            continue
        if "skipped" in c:
            print(f"{label:40s} skipped: {c['skipped']}")
            continue
        print(f"{label:40s} {c['tok_per_s']:12,.0f} {c['vs_prefill']:10.3f} {c['gb_per_s']:8.2f} "
              f"{c['bytes_per_token']:10.1f} {c['bytes_per_token_formula']:8d}  drain {c['drain_s']:.2f} s, "
              f"{c['shards']} shards")
    for key, label in (("sink_shm", "(d) sequential write /dev/shm"), ("sink_disk", "(d) sequential write disk")):
        if key in r:
            print(f"{label:40s} {'':12s} {'':10s} {r[key]['gb_per_s']:8.2f}")
    j = r["json_vs_binary"]
    print(f"(e) one {j['tokens']} x {j['width']} bf16 sample: .cpu().tolist() {j['tolist_s']:.2f} s, + json.dumps "
          f"{j['tolist_json_s']:.2f} s ({j['json_mb']:.0f} MB); binary D2H + store {j['binary_s'] * 1e3:.1f} ms "
          f"({j['binary_mb']:.0f} MB) -> {j['speedup']:,.0f}x")
    print(f"total {r['total_s']} s (model init {r['init_s']} s)")


if __name__ == "__main__":
    main()
