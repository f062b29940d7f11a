"""`hstap generate --capture` (hstap/capture/tap.py): the target's answers and their hidden states in one pass. The
decode-path states equal a prefill recompute of the same tokens (`hstap verify --target`, fp32); each conversation's
JSONL line appears only once its sample is committed; a resume after a line was lost regenerates it without a second
sample; the store header says what it holds."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hstap.capture.tap import generate
from hstap.data.generate_config import GenerateConfig

CORPUS = [{"id": f"c{i}", "conversations": [{"role": "user", "content": f"question {i}: " + "indent " * i},
                                            {"role": "assistant", "content": "x"}]} for i in range(5)] + [
    {"id": "multi", "messages": [{"role": "user", "content": "Explain the decoder."},
                                 {"role": "assistant", "content": "ORIGINAL ONE"},
                                 {"role": "user", "content": "And the encoder?"},
                                 {"role": "assistant", "content": "ORIGINAL TWO"}]},
    {"id": "no-assistant", "conversations": [{"role": "user", "content": "nobody answers"}]}]


def _run(tiny_llama, root, **kw):
    data = root / "c.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    cfg = GenerateConfig(data=[str(data)], out=str(root / "g.jsonl"), target=str(tiny_llama), max_new_tokens=12,
                         batch_size=3, capture=str(root / "store"), layers="1,2,3", capture_dtype="fp32", **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        return generate(cfg)


@pytest.fixture(scope="module")
def tapped(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tap")
    return root, _run(tiny_llama, root)


def test_samples_are_prompt_plus_answer_and_equal_a_prefill_recompute(tapped, tiny_llama):
    from hstap.data.decode import EmbeddedEngine
    from hstap.store.reader import open_store
    from hstap.verify.stage import recompute

    root, summary = tapped
    s = open_store(root / "store")
    assert sorted(s.ids) == sorted(r["id"] for r in CORPUS if r["id"] != "no-assistant")
    assert summary["captured_samples"] == len(s) and s.manifest["contents"]["kind"] == "generated"
    assert s.manifest["engine"]["name"] == "hf-generate" and s.layers == [1, 2, 3]
    eng = EmbeddedEngine(str(tiny_llama), "cpu", "fp32")
    lines = {json.loads(x)["id"]: json.loads(x)["conversations"] for x in (root / "g.jsonl").read_text().splitlines()}
    for i, sid in enumerate(s.ids):
        x = s[i]
        msgs = lines[sid]
        prompt = eng.prompt_ids(msgs[:-1])  # the last turn's prompt: every earlier turn, as regenerated
        P = len(prompt)
        assert x["input_ids"][:P].tolist() == prompt
        assert x["loss_mask"][:P].sum() == 0 and bool(x["loss_mask"][P:].all())
        assert 1 <= len(x["input_ids"]) - P <= 12  # the answer's fed tokens (--max-new-tokens 12)
    rep = recompute(str(root / "store"), str(tiny_llama), samples=len(s), device="cpu", compute_dtype="fp32")
    assert rep["ok"], rep["problems"]  # decode-path states == prefill of the same tokens, fp32 limits, every layer
    assert all(m["rel_max"] < 1e-4 for m in rep["metrics"])


def test_a_line_lost_after_its_commit_is_written_again_once(tapped, tiny_llama, tmp_path):
    import shutil

    from hstap.store.reader import open_store

    root, _ = tapped
    for name in ("store", "c.jsonl", "g.jsonl"):
        (shutil.copytree if name == "store" else shutil.copy)(root / name, tmp_path / name)
    rec = (root / "g.jsonl.config.json").read_text()  # the answers' run record, its paths moved with them
    (tmp_path / "g.jsonl.config.json").write_text(rec.replace(str(root), str(tmp_path)))
    lines = (tmp_path / "g.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "g.jsonl").write_text("".join(lines[:-2]))  # killed between two commits and their lines
    before = open_store(tmp_path / "store")
    s = _run(tiny_llama, tmp_path)
    assert s["already_done"] == len(lines) - 2 and s["captured_samples"] == 0  # regenerated, not stored twice
    after = open_store(tmp_path / "store")
    assert after.ids == before.ids
    assert sorted((tmp_path / "g.jsonl").read_text().splitlines()) == sorted(x.rstrip("\n") for x in lines)


def test_a_servers_tap_keeps_a_stable_fraction_and_bounds_the_store(tmp_path):
    from hstap.capture.tap import TapBudget
    from hstap.capture.tap import tapped as keeps

    ids = [f"req-{i}" for i in range(4000)]
    kept = [i for i in ids if keeps(i, 0.25)]
    assert 0.22 < len(kept) / len(ids) < 0.28 and kept == [i for i in ids if keeps(i, 0.25)]
    assert set(kept) <= {i for i in ids if keeps(i, 0.5)} and all(keeps(i, 1.0) for i in ids[:10])

    (tmp_path / "shard-0").write_bytes(b"x" * 1000)
    b = TapBudget(str(tmp_path), max_gb=2000 / 1e9, rescan_s=3600.0)  # 2000 bytes
    assert b.take(500) and not b.take(600)  # 1000 on disk + 500 taken; 600 more would pass 2000
    (tmp_path / "shard-0").unlink()  # a consumer deleted the shard: room again at the next reading of the disk
    b = TapBudget(str(tmp_path), max_gb=2000 / 1e9, rescan_s=3600.0)
    assert b.take(1500) and not b.take(600)
    assert TapBudget(str(tmp_path / "absent"), max_gb=None).take(10 ** 15)


def test_a_target_that_does_not_load_leaves_no_store_and_no_output(tiny_llama, tmp_path, capsys):
    """A failed start leaves nothing that blocks the next run: weights that do not load fail the run before its first
    answer; the store is made at the first answer, so neither it, the output nor its config exists."""
    import shutil

    from helpers.refusals import refused

    t = tmp_path / "t"
    shutil.copytree(tiny_llama, t)
    f = t / "model.safetensors"
    b = f.read_bytes()
    f.write_bytes(b[:8] + b"{garbage" + b[16:])
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CORPUS[:2]))
    out = tmp_path / "out"
    refused(["generate", "--target", t, "--data", data, "--out", out / "g.jsonl", "--capture", out / "store",
             "--layers", "1,2,3", "--capture-dtype", "fp32"], capsys, f"{t}: cannot load the target model",
            untouched=[out])
