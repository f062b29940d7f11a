"""verify on a target too large to load (hstap/verify/partial.py): under a memory budget it loads the embedding and the
first layers only, checks the stored layers among them and names what it did not check. Proof that nothing else was
read: the shard files holding only higher layers are cut off after their header once the stores are captured (opened
as safetensors, they fail), and the check still passes on the layers below."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from hstap.common import HstapError
from hstap.verify.partial import layer_of, tensor_elements
from hstap.verify.stage import recompute


@pytest.fixture(scope="module")
def sharded(tiny_tokenizer, prepared, tmp_path_factory) -> dict:
    """A 6-layer Llama saved in 60 kB shards, an fp32 capture of it (layers 1, 2, 4) and a (2, 3, 5) one claiming
    (1, 2, 4); then every shard holding only layers >= 3 cut off after its header."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.stage import capture
    from hstap.demo.toy import build_random_target

    root = tmp_path_factory.mktemp("partial")
    t = root / "target"
    model = build_random_target(t, tiny_tokenizer[0], num_layers=6, hidden_size=64)
    (t / "model.safetensors").unlink()
    model.save_pretrained(str(t), max_shard_size="60KB")
    stores = {}
    for name, layers in (("right", "1,2,4"), ("shifted", "2,3,5")):
        stores[name] = root / name
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            capture(CaptureConfig(target=str(t), data=str(prepared), out=str(stores[name]), layers=layers,
                                  dtype="fp32", device="cpu", compute_dtype="fp32"))
    from helpers.store import rewrite

    stores["shifted"] = rewrite(stores["shifted"], root / "shifted-claims", layers=[1, 2, 4])
    elems = tensor_elements(t)
    files = json.loads((t / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, set] = {}
    for k, f in files.items():
        by_file.setdefault(f, set()).add(layer_of(k))
    garbage = [f for f, ls in by_file.items() if None not in ls and min(ls) >= 3]
    for f in garbage:  # the header kept (the plan reads shapes), the tensors cut off: safetensors refuses to open it
        raw = (t / f).read_bytes()
        (t / f).write_bytes(raw[: 8 + int.from_bytes(raw[:8], "little")])
    # fp32 bytes of everything outside the layers plus layers 0-2, and half of layer 3: the budget of a 3-layer load
    rest = sum(n for k, n in elems.items() if layer_of(k) is None) * 4
    layer = [sum(n for k, n in elems.items() if layer_of(k) == i) * 4 for i in range(6)]
    budget = (rest + sum(layer[:3]) + layer[3] / 2) / 1e9
    return {"target": t, **stores, "garbage": garbage, "budget_gb": budget, "rest": rest, "layer": layer}


def prepared_records() -> list[dict]:
    from helpers.capture import corpus

    return corpus(4, seed=3)


def test_only_the_needed_layers_are_loaded_and_the_rest_is_named(sharded):
    from safetensors import SafetensorError, safe_open

    assert sharded["garbage"]  # shards no check below layer 3 may read
    with pytest.raises(SafetensorError):  # reading any of them would have failed
        safe_open(str(sharded["target"] / sharded["garbage"][0]), framework="pt")
    rep = recompute(str(sharded["right"]), str(sharded["target"]), samples=2, load_gb=sharded["budget_gb"])
    assert rep["ok"], rep["problems"]
    assert [m["name"] for m in rep["metrics"]] == ["layer 1", "layer 2"]
    assert rep["loaded"] == {"layers": 3, "of": 6, "skipped": ["layer 4", "final"]}
    assert any("only the embedding and layers 0-2 of 6 were loaded" in n and "layer 4, final" in n
               for n in rep["notes"])


def test_a_shift_is_still_caught_on_the_loaded_layers(sharded):
    rep = recompute(str(sharded["shifted"]), str(sharded["target"]), samples=2, load_gb=sharded["budget_gb"])
    assert not rep["ok"] and rep["metrics"][0].get("offset") == 1, rep["problems"]


def test_a_budget_below_the_lowest_stored_layer_is_one_error(sharded):
    too_small = (sharded["rest"] + sharded["layer"][0]) / 1e9  # layer 1 does not fit
    with pytest.raises(HstapError, match=r"even its stored layer 1 cannot be checked within the .* GB budget"):
        recompute(str(sharded["right"]), str(sharded["target"]), samples=1, load_gb=too_small)


def test_the_twin_is_left_out_when_only_it_keeps_a_stored_layer_from_fitting(sharded, tmp_path):
    from helpers.store import rewrite

    # a store that says it was computed in bf16: the check would hold a bf16 twin (2 bytes an element) beside fp32
    def bf16_header(src, dst):
        out = rewrite(src, dst)
        import json as _json

        man = _json.loads((out / "manifest.json").read_text())
        man["engine"]["compute_dtype"] = "bf16"
        (out / "manifest.json").write_text(_json.dumps(man))
        return out

    store = bf16_header(sharded["right"], tmp_path / "bf16-says")
    fits_alone = (sharded["rest"] + sum(sharded["layer"][:2]) * 1.01) / 1e9  # layers 0-1 in fp32, no room for a twin
    rep = recompute(str(store), str(sharded["target"]), samples=1, load_gb=fits_alone)
    assert rep["loaded"]["layers"] == 2 and rep["compute"]["served_activations"] is None
    assert any("no twin" in n for n in rep["notes"]) and all("noise_floor" not in m for m in rep["metrics"])
