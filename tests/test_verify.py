"""hstap verify: integrity, recomputation against the target with dtype-aware tolerances, layer-offset detection, --a/--b.

Stores come from the real pipeline (prepare -> capture with the embedded HF engine); the deliberately wrong ones (shifted
layers, missing final norm, NaN, subsets) are re-written from real captures with StoreWriter, as the task asks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hstap.common import HstapError
from hstap.verify.parity import TOLERANCES
from hstap.verify.config import VerifyConfig
from hstap.verify.stage import compare_stores, quick_check, recompute, verify
from helpers.store import rewrite as _rewrite


PREPARE = {"max_len": 96}  # `prepare`'s settings of this module's `prepared` set (conftest.py)


def prepared_records() -> list[dict]:
    """The chats of this module's `prepared` set: five 500-character pieces of the toy documentation."""
    from hstap.demo.toy import sample_texts

    text = "\n".join(sample_texts())
    chunks = [text[i * 500:(i + 1) * 500] for i in range(5)]
    return [{"id": f"c{i}", "conversations": [{"role": "user", "content": c[:40]},
                                              {"role": "assistant", "content": c[40:]}]} for i, c in enumerate(chunks)]


@pytest.fixture(scope="module")
def stores(tiny_llama, prepared, tmp_path_factory) -> dict[str, Path]:
    """Real captures of the tiny Llama: {name: store path}."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture

    d = tmp_path_factory.mktemp("verify-stores")
    out = {}
    for name, layers, dtype, compute in (("f32", "1,2,4", "fp32", "fp32"), ("b16", "1,2,4", "bf16", "bf16"),
                                         ("f8", "1,2,4", "fp8", "bf16"), ("f8c32", "1,2,4", "fp8", "fp32"),
                                         ("l235", "2,3,5", "fp32", "fp32")):
        out[name] = d / name
        capture(CaptureConfig(target=str(tiny_llama), data=str(prepared), out=str(out[name]), layers=layers,
                              dtype=dtype, device="cpu", compute_dtype=compute))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# recompute


def test_fp32_capture_is_near_exact(stores, tiny_llama, tmp_path):
    rep = verify(VerifyConfig(store=str(stores["f32"]), target=str(tiny_llama), samples=5, report=str(tmp_path / "r.json")))
    assert rep["ok"] and rep["tolerance_class"] == "fp32 store, fp32 compute" and len(rep["samples"]) == 5
    for m in rep["metrics"]:
        assert m["rel_max"] < 1e-5 and m["cos_min"] > 0.999999 and m["ulp_p99"] < 0.01, m
    assert [m["best_match"] for m in rep["metrics"]] == ["output of layer 1", "output of layer 2", "output of layer 4",
                                                         "the final-norm output"]
    assert json.loads((tmp_path / "r.json").read_text())["metrics"][0]["name"] == "layer 1"


@pytest.mark.parametrize("name,cls", [("b16", "bf16 store, bf16 compute"), ("f8", "fp8 store, bf16 compute"),
                                      ("f8c32", "fp8 store, fp32 compute")])
def test_lower_precision_captures_pass_their_tolerance(name, cls, stores, tiny_llama, target):
    rep = recompute(str(stores[name]), str(tiny_llama), samples=3, target=target)
    assert rep["ok"], rep["problems"]
    assert rep["tolerance_class"] == cls
    tol = TOLERANCES[tuple(cls.replace(" store,", "").replace(" compute", "").split())]
    for m in rep["metrics"]:
        assert tol["cos_min"] <= m["cos_min"] < 1.0 and 0 < m["rel_max"] <= tol["rel_max"]  # real error, within bounds


def test_tolerance_depends_on_the_capture_precision(stores, tiny_llama, target, tmp_path):
    """The same bf16-compute capture, labelled as computed in fp32, fails the tighter fp32-compute tolerance."""
    lie = tmp_path / "lie"
    shutil.copytree(stores["b16"], lie)
    m = json.loads((lie / "manifest.json").read_text())
    m["engine"]["compute_dtype"] = "fp32"
    (lie / "manifest.json").write_text(json.dumps(m))
    rep = recompute(str(lie), str(tiny_llama), samples=3, target=target)
    assert rep["tolerance_class"] == "bf16 store, fp32 compute" and not rep["ok"]
    assert any("bf16 ulps" in p or "relative error" in p for p in rep["problems"])


def test_shifted_layers_are_caught_on_every_sample(stores, tiny_llama, target, tmp_path):
    shifted = _rewrite(stores["l235"], tmp_path / "shifted", layers=[1, 2, 4])  # holds layers 2,3,5, claims 1,2,4
    rep = recompute(str(shifted), str(tiny_llama), samples=5, target=target)
    assert not rep["ok"]
    assert rep["problems"] == ["stored layer 1 matches output of layer 2 (off by +1)",
                               "stored layer 2 matches output of layer 3 (off by +1)",
                               "stored layer 4 matches output of layer 5 (off by +1)"]
    for m, true in zip(rep["metrics"], (2, 3, 5)):
        assert m["best_per_sample"] == [f"output of layer {true}"] * 5  # every sample, not just on average
    with pytest.raises(HstapError, match=r"stored layer 1 matches output of layer 2 \(off by \+1\) \(\+2 more problems\)"):
        quick_check(str(shifted), str(tiny_llama))
    with pytest.raises(HstapError, match=r"off by \+1"):
        verify(VerifyConfig(store=str(shifted), target=str(tiny_llama), samples=1))


def test_shifted_bf16_capture_is_caught(stores, tiny_llama, target, tmp_path):
    """bf16 noise is ~50x below the gap between adjacent layers: a bf16 capture claimed one layer too low is caught."""
    shifted = _rewrite(stores["b16"], tmp_path / "shifted16", layers=[0, 1, 3])  # holds layers 1,2,4
    rep = recompute(str(shifted), str(tiny_llama), samples=2, target=target)
    assert rep["tolerance_class"] == "bf16 store, bf16 compute"
    assert rep["problems"] == ["stored layer 0 matches output of layer 1 (off by +1)",
                               "stored layer 1 matches output of layer 2 (off by +1)",
                               "stored layer 3 matches output of layer 4 (off by +1)"]


def test_missing_final_norm_is_named(stores, tiny_llama, target, tmp_path):
    def prenorm(x):  # the last layer's output (slot of layer 5) stored as `final`: a capture that skipped the norm
        x["final"] = x["aux"][:, 2].clone()
        return x

    bad = _rewrite(stores["l235"], tmp_path / "nonorm", edit=prenorm)
    rep = recompute(str(bad), str(tiny_llama), samples=2, target=target)
    assert rep["problems"] == ["final matches pre-norm output of the last layer: missing final norm"]
    assert [m["ok"] for m in rep["metrics"]] == [True, True, True, False]


def test_store_from_another_target_fails(stores, tiny_tokenizer, tmp_path):
    from hstap.demo.toy import build_random_target

    other = tmp_path / "other"
    build_random_target(other, tiny_tokenizer[0], model_type="llama", num_layers=6, hidden_size=64, seed=1)
    with pytest.raises(HstapError, match="matches no target layer") as e:
        quick_check(str(stores["f32"]), str(other))
    assert "a different target" in str(e.value)
    rep = recompute(str(stores["f32"]), str(other), samples=2)
    assert any("fingerprint differs" in n for n in rep["notes"])
    assert all(m["cos_min"] < 0.9 for m in rep["metrics"])


def test_nan_in_store_is_refused(stores, tiny_llama, target, tmp_path):
    def poison(x):
        x["aux"] = x["aux"].clone()
        x["aux"][3, 1, 7] = float("nan")
        return x

    bad = _rewrite(stores["f32"], tmp_path / "nan", edit=poison)
    rep = recompute(str(bad), str(tiny_llama), samples=5, target=target)
    assert not rep["ok"] and sum("NaN/Inf" in p for p in rep["problems"]) == 5
    with pytest.raises(HstapError, match="NaN"):
        verify(VerifyConfig(store=str(bad)))  # the integrity check finds it too


def test_quick_check_passes_a_good_store(stores, tiny_llama):
    rep = quick_check(str(stores["b16"]), str(tiny_llama))
    assert rep["ok"] and len(rep["samples"]) == 2 and rep["samples"][0] != rep["samples"][1]


# ---------------------------------------------------------------------------------------------------------------------
# integrity


def test_integrity_ok_and_corruption(stores, tmp_path):
    rep = verify(VerifyConfig(store=str(stores["f8"])))
    assert rep["ok"] and rep["samples"] == 5 and rep["tokens"] > 100
    bad = tmp_path / "corrupt"
    shutil.copytree(stores["f32"], bad)
    shard = sorted((bad / "shards").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(HstapError, match="sha256 mismatch"):
        verify(VerifyConfig(store=str(bad)))


# ---------------------------------------------------------------------------------------------------------------------
# --a / --b


def test_compare_bf16_fp32_and_fp8_bf16(stores):
    rep = verify(VerifyConfig(a=str(stores["b16"]), b=str(stores["f32"])))
    assert rep["ok"] and rep["tolerance_class"] == "bf16 store, bf16 compute" and rep["compared"] == 5
    assert [m["name"] for m in rep["metrics"]] == ["layer 1", "layer 2", "layer 4", "final"]
    assert all(0 < m["rel_max"] <= 0.1 for m in rep["metrics"])
    rep = compare_stores(str(stores["f8"]), str(stores["b16"]))
    assert rep["ok"] and rep["tolerance_class"] == "fp8 store, bf16 compute"
    assert rep["missing_in_a"] == rep["missing_in_b"] == []


def test_compare_reports_missing_ids_and_shifted_layers(stores, tmp_path):
    from hstap.store.reader import open_store

    ids = open_store(stores["f32"]).ids
    extra = {"sample_id": "only-in-a", "input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.long),
             "aux": torch.randn(4, 3, 64), "final": torch.randn(4, 64)}
    sub = _rewrite(stores["f32"], tmp_path / "sub", keep=set(ids[:3]), extra=[extra])
    rep = compare_stores(str(sub), str(stores["f32"]))
    assert rep["ok"] and rep["compared"] == 3
    assert rep["missing_in_b"] == ["only-in-a"] and sorted(rep["missing_in_a"]) == sorted(ids[3:])
    shifted = _rewrite(stores["l235"], tmp_path / "shifted", layers=[1, 2, 4])
    with pytest.raises(HstapError, match="layer 1: cosine"):
        verify(VerifyConfig(a=str(shifted), b=str(stores["f32"])))
    rep = compare_stores(str(shifted), str(stores["f32"]))
    assert [m["ok"] for m in rep["metrics"]] == [False, False, False, True]  # final is right, every layer is not


def test_compare_refuses_different_tokens(stores, tmp_path):
    def retok(x):
        x["input_ids"] = x["input_ids"].clone()
        x["input_ids"][0] += 1
        return x

    bad = _rewrite(stores["f32"], tmp_path / "retok", edit=retok)
    with pytest.raises(HstapError, match="input_ids differ"):
        verify(VerifyConfig(a=str(bad), b=str(stores["f32"])))


def test_config_validation_and_cli_docs():
    import dataclasses

    from hstap.cli import field_docs, make_config
    for kw, msg in (({}, "nothing to verify"), ({"a": "x"}, "go together"), ({"a": "x", "b": "y", "store": "s"}, "not both"),
                    ({"target": "t"}, "needs --store"), ({"store": "s", "samples": 0}, "samples")):
        with pytest.raises(HstapError, match=msg):
            VerifyConfig(**kw)
    cfg = make_config("verify", VerifyConfig, ["--store", "S", "--target", "T", "--samples", "3", "--compute-dtype", "bf16"])
    assert (cfg.store, cfg.target, cfg.samples, cfg.compute_dtype) == ("S", "T", 3, "bf16")
    assert set(field_docs(VerifyConfig)) == {f.name for f in dataclasses.fields(VerifyConfig)}
