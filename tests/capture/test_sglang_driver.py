"""`hstap capture --engine sglang` against a real local HTTP server process.

The server (`tests/helpers/sglang.py serve`) is an emulation, not SGLang's server: it answers /server_info from a
real SGLang `ServerArgs` parsed from launch flags and resolved by SGLang's own code, attaches the `--forward-hooks`
specs to SGLang's real LogitsProcessor with SGLang's `register_forward_hooks`, computes hidden states with the HF target
and packs the prefill-only requests it receives into chunked EXTEND ForwardBatches (real sglang types). Everything on
the hstap side (driver, hook, store) is the production code."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # installed but broken must fail, not skip: no importorskip
    pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23, see docs/engines.md)",
                allow_module_level=True)

from helpers.capture import prepare_records  # noqa: E402
from helpers.sglang import import_sglang, records  # noqa: E402

from hstap.capture.sglang.driver import run_sglang_capture, server_problems  # noqa: E402
from hstap.capture.sglang.protocol import hook_spec  # noqa: E402
from hstap.capture.stage import CaptureConfig  # noqa: E402
from hstap.common import HstapError  # noqa: E402
from hstap.store.reader import open_store  # noqa: E402

LAYERS = [0, 2, 4]
TESTS = Path(__file__).resolve().parents[1]  # tests/: the emulated server is helpers.sglang


@pytest.fixture(scope="module")
def setup(tiny_llama, tiny_tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("sg-drv")
    data = prepare_records(tiny_tokenizer[1], d / "prepared", records(10, seed=5))
    store = d / "store"
    port_file = d / "port"
    flags = ["--disable-prefill-cuda-graph", "--chunked-prefill-size", "48",
             "--forward-hooks", json.dumps([hook_spec(store, data, LAYERS, flush_s=0.1)])]
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.Popen([sys.executable, "-m", "helpers.sglang", "serve", str(port_file),
                             str(tiny_llama), "--", *flags], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(d / "server.log", "w"))
    try:
        import_sglang()  # meanwhile: this process needs sglang for the settings checks below
        deadline = time.time() + 120
        while not port_file.exists():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"emulated server did not start: {(d / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield {"url": f"http://127.0.0.1:{port_file.read_text()}", "data": data, "store": store, "dir": d}
    finally:
        proc.kill()
        proc.wait()


def _cfg(setup, tiny_llama, **kw):
    kw.setdefault("layers", ",".join(map(str, LAYERS)))
    return CaptureConfig(target=str(tiny_llama), data=str(setup["data"]), out=str(setup["store"]), engine="sglang",
                         server=setup["url"], dtype="fp32", concurrency=4, **kw)


def _run(cfg):
    with contextlib.redirect_stdout(io.StringIO()):
        return run_sglang_capture(cfg, poll_s=0.1, commit_timeout_s=60)


@pytest.mark.procs
@pytest.mark.slow
def test_capture_through_server_equals_hf_and_resumes(setup, tiny_llama):
    from hstap.capture.hf.forward import capture_batch
    from hstap.data.prepare import load_prepared
    from hstap.artifacts.model_dir import load_target

    s = _run(_cfg(setup, tiny_llama))
    ds = load_prepared(setup["data"])
    assert s["samples"] == len(ds) and s["dropped"] == {} and s["skipped_committed"] == 0
    store = open_store(setup["store"])
    assert sorted(store.ids) == sorted(ds["id"]) and store.verify() == []
    assert store.manifest["engine"]["name"] == "sglang" and store.manifest["layers"] == LAYERS
    # the session's end closed the hook's store rank: a trainer following the store sees that writing has ended
    parts = [json.loads(f.read_text()) for f in sorted((setup["store"] / "parts").glob("rank*.json"))]
    assert s["writers_closed"] and store.manifest["writers"] == 1 and [q["closed"] for q in parts] == [True]
    target, _ = load_target(tiny_llama, "cpu", "fp32")
    want = capture_batch(target, [torch.tensor(x) for x in ds["input_ids"]], LAYERS)
    for i, (aux, final) in enumerate(want):
        got = store[store.index_of(ds[i]["id"])]
        assert got["input_ids"].tolist() == ds[i]["input_ids"] and got["loss_mask"].tolist() == ds[i]["loss_mask"]
        torch.testing.assert_close(got["aux"], aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["final"], final, rtol=1e-4, atol=1e-4)
    again = _run(_cfg(setup, tiny_llama))  # resume: everything is committed, nothing is sent
    assert again["samples"] == 0 and again["skipped_committed"] == len(ds) and again["writers_closed"]
    assert (setup["store"] / "config.json").is_file()


@pytest.mark.procs
@pytest.mark.slow
def test_driver_refuses_a_hook_for_other_layers(setup, tiny_llama):
    with pytest.raises(HstapError, match=r"config\.layers is \[0, 2, 4\], this run needs \[1, 2, 3\].*--forward-hooks"):
        _run(_cfg(setup, tiny_llama, layers="1,2,3"))


def _info(tiny_llama, *flags):
    """/server_info of a server launched with these flags, as SGLang itself resolves them."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import build_server_info

    sa = prepare_server_args(["--model-path", str(tiny_llama), "--device", "cpu", *flags])
    sa.resolve_once()
    return json.loads(json.dumps(build_server_info(sa, {}), default=str))


@pytest.mark.procs
@pytest.mark.slow
def test_server_settings_are_checked(setup, tiny_llama):
    store, data = setup["store"], setup["data"]
    hooks = ["--forward-hooks", json.dumps([hook_spec(store, data, LAYERS)])]
    assert server_problems(_info(tiny_llama, "--disable-prefill-cuda-graph", *hooks), store, data, LAYERS) == []
    p = server_problems(_info(tiny_llama, "--disable-prefill-cuda-graph"), store, data, LAYERS)
    assert len(p) == 1 and "--forward-hooks" in p[0] and str(store) in p[0]
    p = server_problems(_info(tiny_llama, "--cuda-graph-backend-prefill", "breakable", *hooks), store, data, LAYERS)
    assert len(p) == 1 and "add --disable-prefill-cuda-graph" in p[0]
    p = server_problems(_info(tiny_llama, "--disable-prefill-cuda-graph", "--enable-mixed-chunk", *hooks), store, data,
                        LAYERS)
    assert len(p) == 1 and "drop --enable-mixed-chunk" in p[0]
    ok = _info(tiny_llama, "--disable-prefill-cuda-graph", "--enable-return-aux-hidden-states",
               "--speculative-algorithm", "EAGLE3", "--return-aux-hidden-state-layer-ids", "0", "2", "4", *hooks)
    assert ok["speculative_algorithm"] is None and server_problems(ok, store, data, LAYERS) == []  # capture-only mode
    bad = server_problems(dict(ok, return_aux_hidden_state_layer_ids=[1, 2, 3]), store, data, LAYERS)
    assert len(bad) == 1 and "need [0, 2, 4]" in bad[0]
    # settings a CPU resolution cannot produce, as a GPU server reports them
    for key, value, fix in (("enable_two_batch_overlap", True, "drop --enable-two-batch-overlap"),
                            ("pp_size", 2, "use --pp-size 1"),
                            ("speculative_algorithm", "EAGLE3", "drop --speculative"),
                            ("enable_pdmux", True, "drop it")):
        p = server_problems(dict(ok, **{key: value}), store, data, LAYERS)
        assert len(p) == 1 and fix in p[0], (key, p)


def test_layer_n_minus_1_is_refused_before_the_server_is_asked(tiny_llama, tmp_path, capsys):
    """SGLang captures layer inputs (`set_eagle3_layers_to_capture` stores id+1, srt/models/llama.py:941; the forward
    captures only i in range(start_layer, end_layer), :486-492): the last layer's output (canonical 5 of 6) is never
    taken. The driver says so in one line, before it asks the server anything (nothing listens at port 9) and before
    it creates the store."""
    from hstap.cli import main

    data = prepare_records(tiny_llama, tmp_path / "p", records(2, seed=1))
    capsys.readouterr()  # prepare's own warnings are not the driver's
    code = main(["capture", "--engine", "sglang", "--server", "http://127.0.0.1:9", "--target", str(tiny_llama),
                 "--data", str(data), "--out", str(tmp_path / "s"), "--layers", "1,3,5"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("hstap: error: --layers: SGLang cannot capture canonical layer 5, the last layer's output")
    assert not (tmp_path / "s").exists()
