"""Embedded-engine capture in process (hstap.capture.hf: forward, runner, driver; hstap.capture.stage): batching, padding, equality with HF
output_hidden_states, dtypes, resume, refusals. The staging buffers are tests/capture/test_staging.py's, the model directory
tests/test_model_dir.py's."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil

import pytest
import torch
from helpers.capture import assert_same_store, corpus, make_prepared, store_samples

from hstap.batching import pack_by_tokens
from hstap.capture.hf.forward import capture_batch, forward_packed
from hstap.capture.hf.runner import CaptureRunner
from hstap.capture.config import CaptureConfig
from hstap.capture.stage import capture
from hstap.common import HstapError
from hstap.data.fits import check_tokenizer
from hstap.artifacts.model_dir import load_target, target_fingerprint
from hstap.store.format import store_bytes_per_token
from hstap.store.reader import open_store
from hstap.store.writer import StoreWriter

LAYERS = "0,2,4"  # HF hidden_states[1], [3], [5] of a 6-layer model; final = hidden_states[6]


def prepared_records() -> list[dict]:
    """The chats of this module's `prepared` set (conftest.py)."""
    return corpus(24, seed=1)


def _capture(target, data, out, **kw):
    cfg = CaptureConfig(target=str(target), data=str(data), out=str(out), device="cpu", **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        return capture(cfg)


def test_pack_by_tokens_packs_longest_first():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(200)] + [1000, 700]
    batches = pack_by_tokens(lengths, 512)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every sample exactly once
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # descending length
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) * longest <= 512 or len(b) == 1
    assert [1000] in [[lengths[i] for i in b] for b in batches]  # longer than the budget: alone
    assert max(len(b) for b in batches) > 4  # short samples do share batches
    assert pack_by_tokens(lengths, 512) == batches  # deterministic
    assert pack_by_tokens([], 10) == []
    with pytest.raises(HstapError, match="batch-tokens"):
        pack_by_tokens([3], 0)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_deepseek"])
def test_right_padding_never_reaches_real_tokens(which, request):
    target, _ = load_target(request.getfixturevalue(which))
    g = torch.Generator().manual_seed(0)
    lens = [17, 9, 4]
    ids = [torch.randint(6, target.vocab_size, (L,), generator=g) for L in lens]
    aux_ref, final_ref, _ = forward_packed(target, ids, [1, 3])  # (S, K, H), (S, H): padding filled with 0
    # the same samples with garbage in the padding and extra padding columns: real rows must not change at all
    B, T = len(ids), 30
    x = torch.randint(0, target.vocab_size, (B, T), generator=g)  # (B, T)
    for b, s in enumerate(ids):
        x[b, : s.numel()] = s
    aux, final, _ = target.capture(x, [1, 3])  # (B, T, K, H), (B, T, H)
    rows = torch.cat([torch.arange(L) + b * T for b, L in enumerate(lens)])  # (S,)
    torch.testing.assert_close(aux.reshape(B * T, 2, -1)[rows], aux_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(final.reshape(B * T, -1)[rows], final_ref, rtol=0, atol=1e-6)
    # and each equals the sample run alone, in input order, whether batched together or re-packed by length
    for out in (capture_batch(target, ids, [1, 3]), capture_batch(target, ids, [1, 3], batch_tokens=20)):
        for (a, f), s in zip(out, ids):
            a1, f1, _ = target.capture(s[None], [1, 3])  # (1, T, K, H), (1, T, H)
            assert a.shape == (s.numel(), 2, target.hidden_size)
            torch.testing.assert_close(a, a1[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f, f1[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_deepseek"])
def test_store_equals_hf_output_hidden_states(which, request, prepared, tmp_path):
    """Every stored sample = HF output_hidden_states of that sample run alone, whatever batch it was captured in."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(which)
    s = _capture(model_dir, prepared, tmp_path / "store", layers=LAYERS, dtype="fp32", batch_tokens=400,
                 shard_tokens=500)
    assert s["samples"] == 24 and s["store_samples"] == 24
    store = open_store(tmp_path / "store")
    assert store.verify() == []
    assert store.layers == [0, 2, 4]
    assert store.manifest["target"]["model_type"] == {"tiny_llama": "llama", "tiny_deepseek": "deepseek_v3"}[which]
    assert len(store.manifest["shards"]) > 2  # several shards committed
    assert max(len(b) for b in pack_by_tokens(store.lengths, 400)) >= 3  # samples really shared batches
    assert len(set(store.lengths)) > 10  # mixed lengths
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    N = model.config.num_hidden_layers
    for i in range(len(store)):
        x = store[i]
        with torch.no_grad():
            hs = model(input_ids=x["input_ids"][None], output_hidden_states=True).hidden_states  # N+1 x (1, T, H)
        ref_aux = torch.stack([hs[j + 1][0] for j in (0, 2, 4)], dim=1)  # (T, K, H)
        assert x["aux"].dtype == torch.float32
        torch.testing.assert_close(x["aux"], ref_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x["final"], hs[N][0], rtol=1e-5, atol=1e-5)  # hidden_states[N] is post-norm
    # the tapped layers differ from each other (a wrong index would likely repeat one)
    assert not torch.allclose(x["aux"][:, 0], x["aux"][:, 1])


def test_low_precision_stores_and_bytes_per_token(tiny_llama, prepared, tmp_path):
    ref = store_samples(_capture_dir(tiny_llama, prepared, tmp_path / "fp32", "fp32"))
    for dtype, tol in (("bf16", 2e-2), ("fp8", 7e-2)):
        s = _capture(tiny_llama, prepared, tmp_path / dtype, layers=LAYERS, dtype=dtype, batch_tokens=300)
        got = store_samples(tmp_path / dtype)
        assert sorted(got) == sorted(ref)
        for sid, x in got.items():
            r = ref[sid]
            assert torch.equal(x["input_ids"], r["input_ids"]) and torch.equal(x["loss_mask"], r["loss_mask"])
            scale = r["aux"].abs().amax(-1, keepdim=True)  # (T, K, 1): fp8/bf16 error is relative to the row's range
            assert ((x["aux"].float() - r["aux"]).abs() / scale).max() < tol, dtype
            assert ((x["final"].float() - r["final"]).abs() / r["final"].abs().amax(-1, keepdim=True)).max() < tol
        formula = store_bytes_per_token(3, 64, dtype)
        assert s["bytes_per_token_formula"] == formula
        assert formula <= s["bytes_per_token"] < formula * 1.5  # + per-shard header and offsets, nothing padded


def _capture_dir(target, data, out, dtype):
    _capture(target, data, out, layers=LAYERS, dtype=dtype, batch_tokens=300)
    return out


def test_resume_skips_committed_and_refuses_other_target_or_layers(tiny_llama, tiny_deepseek, prepared, tmp_path):
    out = tmp_path / "store"
    a = _capture(tiny_llama, prepared, out, layers=LAYERS, dtype="fp32", max_samples=10, shard_tokens=50)
    assert a["samples"] == 10 and a["store_samples"] == 10
    b = _capture(tiny_llama, prepared, out, layers=LAYERS, dtype="fp32", batch_tokens=999, shard_tokens=50)
    assert b["samples"] == 14 and b["skipped_committed"] == 10 and b["store_samples"] == 24
    assert_same_store(store_samples(out), store_samples(_capture_dir(tiny_llama, prepared, tmp_path / "one", "fp32")))
    c = _capture(tiny_llama, prepared, out, layers=LAYERS, dtype="fp32")  # nothing left to do
    assert c["samples"] == 0 and c["store_samples"] == 24
    assert (out / "config.json").is_file()

    with pytest.raises(HstapError, match="layers: the store was made with"):
        _capture(tiny_llama, prepared, out, layers="1,3,4", dtype="fp32")
    with pytest.raises(HstapError, match="dtype"):
        _capture(tiny_llama, prepared, out, layers=LAYERS, dtype="bf16")
    with pytest.raises(HstapError, match="target.config_sha256"):
        _capture(tiny_deepseek, prepared, out, layers=LAYERS, dtype="fp32")
    assert len(open_store(out)) == 24  # refusals touched nothing
    d = _capture(tiny_deepseek, prepared, out, layers="1,3,4", dtype="fp32", new=True)
    assert d["samples"] == 24 and d["skipped_committed"] == 0
    st = open_store(out)
    assert st.layers == [1, 3, 4] and st.manifest["target"]["model_type"] == "deepseek_v3" and len(st) == 24


def test_zero_copy_only_when_a_shard_fits_the_limit(tmp_path, monkeypatch):
    """The CUDA path's choice between zero-copy and copying, decided from the writer's real shard limit."""
    from hstap.capture.hf import runner as hf

    header = {"target": {}, "engine": {}, "dtype": "bf16", "layers": [1, 2], "hidden_size": 64}
    with StoreWriter(tmp_path / "s", header, shard_tokens=1 << 20, shard_bytes=1000 * 100) as w:
        monkeypatch.setattr(hf, "ZERO_COPY_MAX_SHARD", w.shard_limit_bytes)
        assert hf.zero_copy_ok(w)
        monkeypatch.setattr(hf, "ZERO_COPY_MAX_SHARD", w.shard_limit_bytes - 1)
        assert not hf.zero_copy_ok(w)
        assert not hf.zero_copy_ok(object())  # a duck-typed writer without the limit: copies


def test_capture_runner_handles_writer_errors(tiny_llama, tmp_path):
    """An error in the writer thread (here: a sample the store refuses) surfaces in the main thread, once, cleanly."""
    target, _ = load_target(tiny_llama)
    header = {"target": {}, "engine": {}, "dtype": "fp32", "layers": [1, 2], "hidden_size": 64}
    writer = StoreWriter(tmp_path / "s", header, shard_tokens=10)
    samples = [{"id": "same", "input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]}]
    with pytest.raises(HstapError, match="added twice|already committed"):
        with CaptureRunner(target, [1, 2], writer, dtype="fp32", queue_size=1) as run:
            for _ in range(50):  # the writer fails on the second batch; submit/close must raise, not hang
                run.submit(samples)
    assert not run.queue.alive()
    with pytest.raises(HstapError, match="outside the target's vocabulary"):
        with CaptureRunner(target, [1, 2], writer, dtype="fp32") as run:
            run.submit([{"id": "big", "input_ids": [1, target.vocab_size], "loss_mask": [1, 1]}])


def test_demux_drops_exactly_the_padding_and_leaves_an_unpadded_batch_uncopied():
    from hstap.capture.hf.forward import demux

    B, T, K, H = 3, 5, 2, 4
    aux = torch.randn(B, T, K, H)
    final = torch.randn(B, T, H)
    lens = [5, 2, 4]
    rows = torch.cat([torch.arange(L) + b * T for b, L in enumerate(lens)])  # (11,) what a right-padded batch has
    a, f = demux(aux, final, rows)  # (11, K, H), (11, H)
    keep = [(b, t) for b, L in enumerate(lens) for t in range(L)]
    assert torch.equal(a, torch.stack([aux[b, t] for b, t in keep]))
    assert torch.equal(f, torch.stack([final[b, t] for b, t in keep]))
    a, f = demux(aux, final, None)  # every sample T tokens long: no rows to drop
    assert a.data_ptr() == aux.data_ptr() and f.data_ptr() == final.data_ptr()
    assert torch.equal(a, aux.reshape(B * T, K, H)) and torch.equal(f, final.reshape(B * T, H))


def test_capture_profile_times_every_stage_of_a_cpu_pass(tiny_llama, tmp_path):
    """CaptureRunner(profile=...): every stage of both threads is timed, the batches counted, the store writer's own
    split filled; without a profile the same store results."""
    from hstap.capture.hf.runner import run_capture
    from hstap.capture.profile import MAIN_STAGES, WRITER_STAGES, CaptureProfile

    target, _ = load_target(tiny_llama)
    header = {"target": {}, "engine": {}, "dtype": "bf16", "layers": [1, 2], "hidden_size": 64}
    g = torch.Generator().manual_seed(0)
    batches = [[{"id": f"{b}-{i}", "input_ids": torch.randint(0, target.vocab_size, (3 + 4 * i,), generator=g),
                 "loss_mask": torch.ones(3 + 4 * i, dtype=torch.uint8)} for i in range(3)] for b in range(4)]
    sums = []
    for prof in (CaptureProfile(torch.device("cpu")), None):
        with StoreWriter(tmp_path / f"s{prof is None}", header, shard_tokens=40) as w:
            run_capture(target, [1, 2], w, batches, dtype="bf16", queue_size=1, profile=prof)
        sums.append([e["sha256"] for e in open_store(tmp_path / f"s{prof is None}").manifest["shards"]])
        if prof is not None:
            d = prof.as_dict()
            assert d["batches"] == 4 and "device_s" not in d  # device times are CUDA events: none on the CPU
            # the unrounded seconds: the report rounds to 0.1 ms, which a tiny batch's stage can stay under
            assert all(prof.host_s[k] > 0 for k in ("inputs", "forward", "convert", "store")), prof.host_s
            assert set(d["host_s"]) == set(MAIN_STAGES + WRITER_STAGES)
            st = w.stats
            assert st["samples"] == 12 and st["shards"] >= 2 and st["bytes"] > 0
            assert st["flush_s"] >= st["write_s"] > 0 and st["hash_s"] > 0 and st["commit_s"] > 0
    assert sums[0] == sums[1]




def test_data_rendered_with_another_chat_template_is_refused_unless_allowed(tiny_tokenizer, tiny_llama, tmp_path):
    """One line naming both template hashes; --allow-template-mismatch captures anyway (and the store records it)."""
    from hstap.data.prepare import read_meta
    from hstap.demo.toy import CHAT_TEMPLATE

    other = tmp_path / "other.jinja"
    other.write_text(CHAT_TEMPLATE.replace("|>\n{{ m['content'] }}", "|> {{ m['content'] }}"))
    data = make_prepared(tiny_tokenizer[1], tmp_path / "prepared", n=4, seed=2, chat_template=str(other))
    got, want = read_meta(data)["chat_template_sha256"], target_fingerprint(tiny_llama)["chat_template_sha256"]
    assert got != want
    with pytest.raises(HstapError) as e:
        _capture(tiny_llama, data, tmp_path / "store", layers=LAYERS, dtype="fp32")
    msg = str(e.value)
    assert "\n" not in msg and "chat_template_sha256" in msg and got[:12] in msg and want[:12] in msg
    assert "--allow-template-mismatch" in msg and not (tmp_path / "store").exists()  # refused before any write
    r = _capture(tiny_llama, data, tmp_path / "store", layers=LAYERS, dtype="fp32", allow_template_mismatch=True)
    st = open_store(tmp_path / "store")
    assert r["store_samples"] == 4 and st.header["data"]["chat_template_sha256"] == got
    assert st.header["capture_config"]["allow_template_mismatch"] is True


def test_tokenizer_check_without_a_target_tokenizer(tiny_llama):
    block = {**target_fingerprint(tiny_llama), "tokenizer_sha256": None}
    V = block["vocab_size"]
    check_tokenizer("P", {"vocab_size": V}, block, max_token_id=lambda: V - 1)
    with pytest.raises(HstapError, match="vocab_size"):
        check_tokenizer("P", {"vocab_size": V + 1}, block)
    with pytest.raises(HstapError, match=f"token id {V} is out of"):
        check_tokenizer("P", {"vocab_size": V}, block, max_token_id=lambda: V)
    with pytest.raises(HstapError, match="tokenizer_sha256"):
        check_tokenizer("P", {"tokenizer_sha256": "0" * 64}, target_fingerprint(tiny_llama))


def test_config_validation():
    ok = dict(target="t", data="d", out="o")
    for bad, match in ((dict(dtype="fp16"), "--dtype"), (dict(engine="trt"), "--engine"),
                       (dict(device="tpu"), "--device"), (dict(batch_tokens=0), "--batch-tokens"),
                       (dict(compute_dtype="fp8"), "--compute-dtype"), (dict(max_samples=0), "--max-samples")):
        with pytest.raises(HstapError, match=match):
            CaptureConfig(**ok, **bad)
    assert CaptureConfig(**ok, device="cuda:1").device == "cuda:1"


# ---------------------------------------------------------------------------------------------------------------------
# bad inputs: one error line naming the file / field / flag, exit 2, nothing written or rewritten


@pytest.fixture(scope="module")
def resumable(tiny_llama, prepared, tmp_path_factory):
    """A store of the first 8 samples in several shards: a capture to resume."""
    out = tmp_path_factory.mktemp("cap-bad") / "store"
    _capture(tiny_llama, prepared, out, layers=LAYERS, dtype="fp32", max_samples=8, shard_tokens=60)
    assert len(open_store(out).manifest["shards"]) >= 3
    return out


def _copy_target(src, dst, drop=()):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    return dst


def _truncated(store):
    f = store / open_store(store).manifest["shards"][1]["file"]
    os.truncate(f, f.stat().st_size // 2)
    return f.name, "bytes, its manifest entry records"


def _flipped(store):
    f = store / open_store(store).manifest["shards"][1]["file"]
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x40  # one bit in the states: the size and the safetensors header still look right
    f.write_bytes(bytes(b))
    return f.name, "sha256 differs from the one recorded"


def _no_template(t):
    (t / "chat_template.jinja").unlink(missing_ok=True)
    conf = json.loads((t / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (t / "tokenizer_config.json").write_text(json.dumps(conf))


def _unloadable(t):
    f = t / "model.safetensors"
    b = f.read_bytes()
    f.write_bytes(b[:8] + b"{garbage" + b[16:])  # the header no longer parses; file names and sizes unchanged


@pytest.mark.parametrize("case", ["truncated shard", "flipped byte", "no weights", "weights that do not load",
                                  "a conversations file", "template of a target without one", "negative layer",
                                  "zero samples"])
def test_bad_inputs_are_one_line_and_write_nothing(case, tiny_llama, prepared, resumable, tmp_path, capsys):
    """Capture refuses, in one line and before the store is created or extended: a resumed store with a damaged shard
    (its samples are not counted as already captured), a target without weights or whose weights do not load (no
    store is left to refuse the next, correct run), a raw data file for --data, data rendered with a template for a
    target that has none, --layers -1,3,4 (the option's value, not an argparse "expected one argument"),
    --max-samples 0 (an empty store is not a success)."""
    from helpers.refusals import refused

    out, target, data, opts, expect = tmp_path / "store", tiny_llama, prepared, [], []
    if case in ("truncated shard", "flipped byte"):
        shutil.copytree(resumable, out)
        expect = [*(_truncated if case == "truncated shard" else _flipped)(out), "--new"]
    elif case == "no weights":
        target = _copy_target(tiny_llama, tmp_path / "t", drop=("*.safetensors",))
        expect = [str(target), "no weight files"]
    elif case == "weights that do not load":
        target = _copy_target(tiny_llama, tmp_path / "t")
        _unloadable(target)
        expect = [str(target), "cannot load the target model"]
    elif case == "a conversations file":
        data = prepared.parent / f"{prepared.name}.jsonl"
        expect = [str(data), "not a prepared dataset directory", "hstap prepare"]
    elif case == "template of a target without one":
        target = _copy_target(tiny_llama, tmp_path / "t")
        _no_template(target)
        expect = ["meta.json:1: chat_template_sha256", "the target's tokenizer has none", "--allow-template-mismatch"]
    elif case == "negative layer":
        opts, expect = ["--layers", "-1,3,4"], ["--layers: layer id -1 is out of range"]
    else:
        opts, expect = ["--max-samples", "0"], ["--max-samples"]
    argv = ["capture", "--target", target, "--data", data, "--out", out, "--dtype", "fp32", "--device", "cpu",
            *(opts or ["--layers", LAYERS])]
    refused(argv, capsys, *expect, untouched=[out])


def test_a_failed_start_leaves_nothing_that_blocks_the_next_run(tiny_llama, prepared, tmp_path):
    """A target whose weights are missing, then one whose weights do not load: no store is created, so the same
    command with the complete target then captures into that --out (before: refused by the store the failed start
    had made, with the fingerprint of no weights)."""
    out = tmp_path / "store"
    for drop, damage in (("*.safetensors", None), ((), _unloadable)):
        t = _copy_target(tiny_llama, tmp_path / f"t{len(list(tmp_path.iterdir()))}", drop=drop)
        if damage:
            damage(t)
        with pytest.raises(HstapError):
            _capture(t, prepared, out, layers=LAYERS, dtype="fp32", max_samples=2)
        assert not out.exists()
    assert _capture(tiny_llama, prepared, out, layers=LAYERS, dtype="fp32", max_samples=2)["samples"] == 2
