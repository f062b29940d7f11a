"""`hstap capture --engine vllm-import`: files in vLLM's extract_hidden_states format, built from a real HF model's
hidden states (the residual stream entering layer j for vLLM id j; id N = the last layer's output before the final
norm), are imported and must equal the HF capture: aux = output_hidden_states[j] for the aux ids, final =
output_hidden_states[N] (post-norm, which the importer recomputes from the pre-norm slot with the target's norm)."""

from __future__ import annotations

import contextlib
import io
import pickle

import pytest
import torch
from helpers.capture import prepare_records
from helpers.sglang import records
from safetensors.torch import save_file

from hstap.capture.config import CaptureConfig
from hstap.capture.vllm.importer import import_vllm
from hstap.common import HstapError
from hstap.layers import parse_vllm_layers
from hstap.store.reader import open_store

VLLM_IDS = [2, 4, 5, 6]  # N = 6: aux = inputs of layers 2, 4, 5 = canonical [1, 3, 4]; 6 = pre-norm final


@pytest.fixture(scope="module")
def world(tiny_llama, tiny_tokenizer, tmp_path_factory):
    """A prepared set, and per sample the HF reference (aux, final) and the vLLM-format tensors."""
    from transformers import AutoModelForCausalLM

    from hstap.data.prepare import load_prepared

    d = tmp_path_factory.mktemp("vllm")
    data = prepare_records(tiny_tokenizer[1], d / "prepared", records(5, seed=9, hostile=False))
    ds = load_prepared(data)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    last = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("h", (o[0] if isinstance(o, tuple) else o).detach()))
    out = []
    with torch.no_grad():
        for r in range(len(ds)):
            ids = torch.tensor(ds[r]["input_ids"])
            hs = model(ids[None], output_hidden_states=True).hidden_states  # N+1 x (1, T, H)
            pre_norm = last["h"][0]  # (T, H): last layer output, before model.norm
            stack = torch.stack([hs[j][0] for j in VLLM_IDS[:-1]] + [pre_norm], dim=1)  # (T, L, H)
            out.append({"ids": ids, "vllm": stack, "aux": torch.stack([hs[j][0] for j in VLLM_IDS[:-1]], 1),
                        "final": hs[6][0]})
    hook.remove()
    return {"dir": d, "data": data, "ds": ds, "ref": out}


def _write(src, name, ref, dtype=torch.float32, token_ids=None):
    src.mkdir(exist_ok=True)
    save_file({"hidden_states": ref["vllm"].to(dtype).contiguous(),
               "token_ids": (ref["ids"] if token_ids is None else token_ids).contiguous()}, str(src / name))


def _import(world, tiny_llama, src, out, **kw):
    cfg = CaptureConfig(target=str(tiny_llama), data=str(world["data"]), out=str(out), engine="vllm-import",
                        src=str(src), vllm_layers=",".join(map(str, VLLM_IDS)), dtype="fp32", **kw)
    with contextlib.redirect_stdout(io.StringIO()):
        return import_vllm(cfg)


def test_import_equals_hf_hidden_states(world, tiny_llama, tmp_path):
    src, ref = tmp_path / "hs", world["ref"]
    for r in range(4):  # speculators' naming: hs_{row}
        _write(src, f"hs_{r}.safetensors", ref[r])
    _write(src, "cmpl-8f1c.safetensors", ref[4])  # a vLLM request id: found by its token ids
    s = _import(world, tiny_llama, src, tmp_path / "store")
    assert s["samples"] == 5 and s["prepared_without_file"] == 0
    store = open_store(tmp_path / "store")
    assert store.layers == [1, 3, 4] and store.verify() == []
    for r in range(5):
        got = store[store.index_of(world["ds"][r]["id"])]
        assert got["input_ids"].tolist() == world["ds"][r]["input_ids"]
        assert got["loss_mask"].tolist() == world["ds"][r]["loss_mask"]
        assert torch.equal(got["aux"], ref[r]["aux"])  # copied as is
        torch.testing.assert_close(got["final"], ref[r]["final"], rtol=1e-5, atol=1e-5)  # our norm == HF's
    again = _import(world, tiny_llama, src, tmp_path / "store")  # resume
    assert again["samples"] == 0 and again["skipped_committed"] == 5


def test_bf16_files_import(world, tiny_llama, tmp_path):
    src = tmp_path / "hs"
    _write(src, "hs_0.safetensors", world["ref"][0], dtype=torch.bfloat16)
    _import(world, tiny_llama, src, tmp_path / "store")
    got = open_store(tmp_path / "store")[0]
    assert torch.equal(got["aux"], world["ref"][0]["aux"].bfloat16().float())
    torch.testing.assert_close(got["final"], world["ref"][0]["final"], rtol=3e-2, atol=3e-2)


def test_wrong_token_ids_are_refused(world, tiny_llama, tmp_path):
    src, ref = tmp_path / "hs", world["ref"]
    bad = ref[1]["ids"].clone()
    bad[3] += 1
    _write(src, "hs_1.safetensors", ref[1], token_ids=bad)
    with pytest.raises(HstapError, match=r"hs_1\.safetensors: token_ids .* differ from prepared row 1"):
        _import(world, tiny_llama, src, tmp_path / "store")
    (src / "hs_1.safetensors").unlink()
    _write(src, "req-9.safetensors", ref[1], token_ids=bad)
    with pytest.raises(HstapError, match=r"req-9\.safetensors: its token_ids .* match no sample"):
        _import(world, tiny_llama, src, tmp_path / "store2")


def test_pickle_stores_are_refused_unread(world, tiny_llama, tmp_path):
    src = tmp_path / "hs"
    _write(src, "hs_0.safetensors", world["ref"][0])
    marker = tmp_path / "unpickled"

    class Payload:  # unpickling this creates `marker`: the test fails if anything ever loads it
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (src / "data_0.ckpt").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(HstapError, match=r"data_0\.ckpt: pickle-based .* not read"):
        _import(world, tiny_llama, src, tmp_path / "store")
    assert not marker.exists() and not (tmp_path / "store").exists()


def test_vllm_layer_ids():
    assert parse_vllm_layers("2,16,29,32", 32) == ([2, 16, 29, 32], [1, 15, 28])
    for bad, msg in (("2,16,29", "last id must be 32"), ("", "required"), ("32", "at least one aux"),
                     ("0,32", "out of range")):
        with pytest.raises(HstapError, match=msg):
            parse_vllm_layers(bad, 32)
