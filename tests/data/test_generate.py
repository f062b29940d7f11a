"""`hstap generate` and `hstap serve`: greedy output equals HF `generate` token for token, turns are replaced in order,
the HTTP client against a real server process matches the embedded engine (through injected 503s), and a SIGKILLed
run resumes with nothing lost or duplicated."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from hstap.common import HstapError
from hstap.data.decode import EmbeddedEngine, generate_batch, stop_token_ids
from hstap.data.answers import recover_output
from hstap.data.generate_config import GenerateConfig
from hstap.data.generate import generate
from hstap.data.openai_client import ChatClient

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[2]
NEW = 12  # max_new_tokens of the end-to-end runs: the tiny random model rarely stops by itself, so turns run to it
FAIL_FIRST = 3  # 503s the server injects before answering


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


CORPUS = [
    {"id": "single", "conversations": [{"role": "user", "content": "What does json.dumps do?"},
                                       {"role": "assistant", "content": "It serializes."}]},
    {"id": "multi", "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Explain the decoder."},
                                 {"role": "assistant", "content": "ORIGINAL ONE"},
                                 {"role": "user", "content": "And the encoder?"},
                                 {"role": "assistant", "content": "ORIGINAL TWO"}]},
    {"id": "trailing-user", "conversations": [{"role": "user", "content": "first"},
                                              {"role": "assistant", "content": "old"},
                                              {"role": "user", "content": "left unanswered"}]},
    {"id": "no-assistant", "conversations": [{"role": "user", "content": "nobody answers"}]},
    {"id": "sharegpt", "conversations": [{"from": "human", "value": "textwrap.fill width?"},
                                         {"from": "gpt", "value": "70"}]},
] + [{"id": f"q{i}", "conversations": [{"role": "user", "content": f"question {i}: " + "indent " * i},
                                       {"role": "assistant", "content": "x"}]} for i in range(4)]


@pytest.fixture(scope="module")
def server_proc(tiny_llama, tmp_path_factory):
    """`hstap serve` over tiny_llama on a free port, injecting FAIL_FIRST 503s; started early so that its
    imports overlap the in-process tests, killed at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HSTAP_SERVE_FAIL_FIRST": str(FAIL_FIRST), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hstap.cli", "serve", "--target", str(tiny_llama), "--port", str(port),
                                 "--batch-size", "4"], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    yield proc, f"http://127.0.0.1:{port}", log
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _start_server_early(server_proc):
    yield


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(server_proc):
    proc, url, log = server_proc
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"hstap serve exited: {log.read_text()[-2000:]}"
        try:
            _health(url)
            return url
        except OSError:
            assert time.monotonic() < deadline, "hstap serve did not come up"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return EmbeddedEngine(str(tiny_llama))


def _hf_greedy(model, prompt: list[int], n: int, stops: list[int], finish: list | None = None) -> list[int]:
    """Reference: HF generate, stop token stripped (generate_batch does not return it); `finish` gets "stop" or
    "length"."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=stops,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
    toks = out.tolist()
    stopped = bool(toks) and toks[-1] in stops
    if finish is not None:
        finish.append("stop" if stopped else "length")
    return toks[:-1] if stopped else toks


def _expected(engine, messages: list[dict], n: int) -> list[dict]:
    """The spec, one HF generate call per turn over the whole history (no cache carried across turns): each assistant
    turn conditions on the already regenerated ones, and says why it ended."""
    msgs = [dict(m) for m in messages]
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            fin: list = []
            toks = _hf_greedy(engine.target.model, engine.prompt_ids(msgs[:i]), n, engine.stop_ids, fin)
            msgs[i] = {"role": "assistant", "content": engine.tokenizer.decode(toks, skip_special_tokens=True),
                       "finish_reason": fin[0]}
    return msgs


def test_generate_batch_matches_hf_greedy(engine):
    tok = engine.tokenizer
    prompts = [engine.prompt_ids([{"role": "user", "content": c}]) for c in
               ("hi", "a much longer question about the json decoder and its scanner", "textwrap")]
    assert len({len(p) for p in prompts}) == 3  # left padding really happens
    model = engine.target.model
    stops = stop_token_ids(model, tok)
    assert stops == [tok.eos_token_id]
    res = generate_batch(engine.target, prompts, [20, 20, 7], stops, pad_id=tok.pad_token_id)
    for p, n, (toks, fin) in zip(prompts, [20, 20, 7], res):
        ref = _hf_greedy(model, p, n, stops)
        assert toks == ref and fin == ("length" if len(ref) == n else "stop")
    assert [len(t) for t, _ in res] == [20, 20, 7]
    # A stop token ends the turn (and is not returned): use the 4th greedy token of row 0 as the stop.
    stop = res[0][0][3]
    res2 = generate_batch(engine.target, prompts, 20, [stop])
    cut = res[0][0].index(stop)
    assert res2[0] == (res[0][0][:cut], "stop")
    for p, (toks, fin) in zip(prompts, res2):
        assert toks == _hf_greedy(model, p, 20, [stop])


def test_sampling_is_per_row_reproducible(engine):
    prompts = [engine.prompt_ids([{"role": "user", "content": c}]) for c in ("alpha", "beta gamma")]
    t = engine.target
    a = generate_batch(t, prompts, 16, [], temperature=1.0, top_p=0.95, seeds=[11, 12])
    assert generate_batch(t, prompts, 16, [], temperature=1.0, top_p=0.95, seeds=[11, 12]) == a
    # A row's draws come from its own seed: alone, or next to a different row, it samples the same tokens.
    assert generate_batch(t, prompts[1:], 16, [], temperature=1.0, top_p=0.95, seeds=[12]) == a[1:]
    assert generate_batch(t, prompts, 16, [], temperature=1.0, top_p=0.95, seeds=[99, 12])[1] == a[1]
    assert generate_batch(t, prompts, 16, [], temperature=1.0, top_p=0.95, seeds=[99, 12])[0] != a[0]
    greedy = generate_batch(t, prompts, 16, [])
    assert a[0] != greedy[0]
    # A nucleus of (almost) zero mass keeps only the top token: sampling collapses to greedy. Mixed rows in one batch.
    assert generate_batch(t, prompts, 16, [], temperature=[1.0, 0.0], top_p=[1e-9, 1.0], seeds=[5, 6]) == greedy


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_jsonl(tmp_path_factory.mktemp("corpus") / "in.jsonl", CORPUS)


@pytest.fixture(scope="module")
def embedded_run(corpus, tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "regen.jsonl"
    summary = generate(GenerateConfig(data=[str(corpus)], out=str(out), target=str(tiny_llama), max_new_tokens=NEW,
                                      batch_size=4))
    return out, summary


def test_embedded_replaces_turns_in_order(embedded_run, engine, corpus, tiny_llama):
    from hstap.data.conversations import read_conversations

    out, summary = embedded_run
    got = {r["id"]: r["conversations"] for r in _read_jsonl(out)}
    src = dict(read_conversations([str(corpus)]))
    assert sorted(got) == sorted(src)  # the same ids (written in completion order: rows refill as they finish)
    for sid, msgs in src.items():
        exp = _expected(engine, msgs, NEW)
        assert got[sid] == exp, sid
        assert [m["role"] for m in got[sid]] == [m["role"] for m in msgs]
        assert [m for m in got[sid] if m["role"] != "assistant"] == [m for m in msgs if m["role"] != "assistant"]
    assert got["no-assistant"] == src["no-assistant"] and got["trailing-user"][-1]["content"] == "left unanswered"
    assert "ORIGINAL" not in json.dumps(got["multi"])
    # Turn 2 saw the regenerated turn 1: conditioned on the original turn 1 it would differ.
    m = src["multi"]
    on_original = _hf_greedy(engine.target.model, engine.prompt_ids(m[:4]), NEW, engine.stop_ids)
    assert got["multi"][4]["content"] != engine.tokenizer.decode(on_original, skip_special_tokens=True)
    assert summary["conversations"] == len(CORPUS) and summary["no_assistant"] == 1
    assert summary["assistant_turns"] == sum(m["role"] == "assistant" for ms in src.values() for m in ms)
    assert summary["generated_tokens"] > 0 and summary["tokens_per_s"] > 0
    meta = json.loads(Path(str(out) + ".config.json").read_text())
    assert meta["stage"] == "generate" and meta["config"]["target"] == os.path.abspath(tiny_llama)


def test_output_feeds_prepare_and_cut_answers_stay_cut(embedded_run, engine, tiny_llama, tmp_path):
    from hstap.data.prepare_config import PrepareConfig
    from hstap.data.prepare import load_prepared, prepare

    out, summary = embedded_run
    recs = {r["id"]: r["conversations"] for r in _read_jsonl(out)}
    fins = [m["finish_reason"] for ms in recs.values() for m in ms if m["role"] == "assistant"]
    assert set(fins) <= {"stop", "length"} and fins.count("length") == summary["truncated_turns"] > 0
    s = prepare(PrepareConfig(tokenizer=str(tiny_llama), data=[str(out)], out=str(tmp_path / "prep")))
    ds = load_prepared(tmp_path / "prep")
    assert s["written"] == len(ds) and set(ds["id"]) <= {r["id"] for r in CORPUS}
    assert s["cut_answers"] == fins.count("length")  # prepare read every cut, from the answers file
    end = engine.tokenizer.convert_tokens_to_ids("<|end|>")
    for sid, ids, mask in zip(ds["id"], ds["input_ids"], ds["loss_mask"]):
        turns = [m for m in recs[sid] if m["role"] == "assistant"]
        # a closing <|end|> is trained exactly after the answers the target ended itself
        assert sum(1 for i, m in zip(ids, mask) if i == end and m) == sum(t["finish_reason"] == "stop" for t in turns)
        if recs[sid][-1]["role"] == "assistant" and turns[-1]["finish_reason"] == "length":
            assert ids[-1] != end and mask[-1] == 1  # the sample ends at the cut, on a trained answer token
    assert sum(ds["loss_mask"][list(ds["id"]).index("multi")]) > 0


TURNS = ["What does json.dumps do?", "And json.loads?", "Give an example.", "Shorter, please.", "Why?", "And then?",
         "One more?", "Bye."]


def test_prefix_cache_equals_reprefill_and_its_prefill_is_linear(engine, tiny_llama, tmp_path):
    """Eight turns of one conversation: the kept row gives the re-prefill answers token for token (greedy, fp32), and
    prefills each token of the conversation about once (+1 a turn: the cut answer's last token, never fed), where
    re-prefilling costs the sum of every turn's prompt (~ turns^2)."""
    rec = {"id": "eight", "conversations": [m for u in TURNS for m in ({"role": "user", "content": u},
                                                                       {"role": "assistant", "content": "old"})]}
    src = _write_jsonl(tmp_path / "in.jsonl", [rec])
    runs = {cache: generate(GenerateConfig(data=[str(src)], out=str(tmp_path / f"o{cache}.jsonl"),
                                           target=str(tiny_llama), max_new_tokens=6, prefix_cache=cache))
            for cache in (True, False)}
    assert _read_jsonl(tmp_path / "oTrue.jsonl") == _read_jsonl(tmp_path / "oFalse.jsonl")
    on, off = runs[True], runs[False]
    assert off["prefilled_tokens"] == off["prompt_tokens"] == on["prompt_tokens"]
    final = len(engine.prompt_ids(_read_jsonl(tmp_path / "oTrue.jsonl")[0]["conversations"][:-1]))  # last prompt
    # (a turn may re-prefill a token or two where the re-rendered text merges across the answer's end: `restarts`)
    assert on["prefilled_tokens"] <= final + 2 * len(TURNS) < off["prefilled_tokens"] / 3


def test_prefix_cache_batches_conversations_of_different_lengths(tiny_llama, tmp_path):
    recs = [{"id": f"c{n}", "conversations": [m for u in TURNS[:n] for m in (
        {"role": "user", "content": u + " " * n}, {"role": "assistant", "content": "old"})]} for n in (1, 5, 3, 2)]
    src = _write_jsonl(tmp_path / "in.jsonl", recs)
    runs = {}
    for cache in (True, False):
        out = tmp_path / f"out-{cache}.jsonl"
        runs[cache] = generate(GenerateConfig(data=[str(src)], out=str(out), target=str(tiny_llama), max_new_tokens=5,
                                              batch_size=3, prefix_cache=cache))
    assert _read_jsonl(tmp_path / "out-True.jsonl") == _read_jsonl(tmp_path / "out-False.jsonl")
    on, off = runs[True], runs[False]
    assert on["prompt_tokens"] == off["prompt_tokens"] == off["prefilled_tokens"] > 2 * on["prefilled_tokens"]


def test_reference_target_greedy(ref_target, ref_corpus, tmp_path):
    from hstap.data.conversations import read_conversations

    src = tmp_path / "ref.jsonl"
    recs = []
    for sid, msgs in read_conversations([str(ref_corpus / "eval.jsonl.gz")]):
        recs.append({"id": sid, "conversations": msgs})
        if len(recs) == 3:
            break
    _write_jsonl(src, recs)
    out = tmp_path / "ref-regen.jsonl"
    s = generate(GenerateConfig(data=[str(src)], out=str(out), target=str(ref_target), max_new_tokens=24, batch_size=3))
    eng = EmbeddedEngine(str(ref_target))
    got = {r["id"]: r["conversations"] for r in _read_jsonl(out)}
    assert list(got) == [r["id"] for r in recs] and s["assistant_turns"] == 3
    for r in recs:
        assert got[r["id"]] == _expected(eng, r["conversations"], 24)


def test_server_client_matches_embedded_through_503s(server, embedded_run, corpus, tmp_path):
    before = _health(server)
    assert before["fail_left"] == FAIL_FIRST  # this test is the first to talk to the server
    out = tmp_path / "srv.jsonl"
    s = generate(GenerateConfig(data=[str(corpus)], out=str(out), server=server, max_new_tokens=NEW, concurrency=3,
                                backoff=0.05))
    after = _health(server)
    assert s["retried"] == FAIL_FIRST and after["injected_failures"] == FAIL_FIRST and after["fail_left"] == 0
    assert s["model"] == engine_name(server) and s["conversations"] == len(CORPUS)
    got = {r["id"]: r for r in _read_jsonl(out)}
    exp = {r["id"]: r for r in _read_jsonl(embedded_run[0])}
    assert len(got) == len(CORPUS) and got == exp


def engine_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
        return json.loads(r.read())["data"][0]["id"]


def test_server_rejections_and_give_up(server, tmp_path):
    long = {"id": "too-long", "conversations": [{"role": "user", "content": "indent " * 5000},
                                                {"role": "assistant", "content": "x"}]}
    src = _write_jsonl(tmp_path / "in.jsonl", [CORPUS[0], long])
    base = dict(data=[str(src)], server=server, max_new_tokens=4, backoff=0.0)
    with pytest.raises(HstapError, match="too-long: .*HTTP 400"):
        generate(GenerateConfig(out=str(tmp_path / "a.jsonl"), **base))
    s = generate(GenerateConfig(out=str(tmp_path / "b.jsonl"), on_error="skip", **base))
    assert s["skipped"] == 1 and [r["id"] for r in _read_jsonl(tmp_path / "b.jsonl")] == ["single"]
    with socket.socket() as sk:  # a port nobody listens on: connection refused on every try
        sk.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sk.getsockname()[1]}"
    c = ChatClient(dead, retries=2, backoff=0.0)
    with pytest.raises(HstapError, match="giving up after 3 attempts"):
        c.chat("m", [{"role": "user", "content": "x"}], 4, 0.0, 1.0, None)
    assert c.retried == 2


@pytest.mark.slow
def test_resume_after_sigkill(server, tiny_llama, tmp_path):
    n = 48
    recs = [{"id": f"r{i:02d}", "conversations": [{"role": "user", "content": f"resume {i} " + "wrap " * (i % 5)},
                                                  {"role": "assistant", "content": "old"}]} for i in range(n)]
    src = _write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out.jsonl"
    args = ["--data", str(src), "--out", str(out), "--server", server, "--max-new-tokens", "16", "--concurrency", "2"]
    cmd = [sys.executable, "-m", "hstap.cli", "generate", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no output from the generate process"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    killed_at = out.read_bytes().count(b"\n")  # complete records at the kill
    assert 3 <= killed_at < n
    with open(out, "ab") as f:  # what a crash in the middle of a write leaves behind
        f.write(b'{"id": "r47", "conversations": [{"role": "user", "con')
    s = generate(GenerateConfig(data=[str(src)], out=str(out), server=server, max_new_tokens=16, concurrency=4))
    assert s["already_done"] == killed_at and s["conversations"] == n - killed_at
    got = _read_jsonl(out)
    ids = [r["id"] for r in got]
    assert len(ids) == len(set(ids)) == n and set(ids) == {r["id"] for r in recs}
    # Nothing half-done survived: every record equals an uninterrupted embedded greedy run.
    ref = tmp_path / "ref.jsonl"
    generate(GenerateConfig(data=[str(src)], out=str(ref), target=str(tiny_llama), max_new_tokens=16, batch_size=8))
    assert {r["id"]: r for r in got} == {r["id"]: r for r in _read_jsonl(ref)}


def test_recover_output_and_resume_guards(tmp_path, corpus):
    out = tmp_path / "o.jsonl"
    good = b'{"id": "a", "conversations": []}\n{"id": "b", "conversations": []}\n'
    out.write_bytes(good + b'{"id": "c", "conv')
    assert recover_output(out) == {"a", "b"} and out.read_bytes() == good
    out.write_bytes(b'{"id": "a", "conversations": []}\nnot json\n')
    with pytest.raises(HstapError, match=r"o\.jsonl:2: not a generate output record"):
        recover_output(out)
    # A resume with other sampling settings would mix two distributions in one file.
    out.write_bytes(good)
    cfg_path = Path(str(out) + ".config.json")
    old = {"server": "http://127.0.0.1:9", "temperature": 0.0}
    cfg_path.write_text(json.dumps({"stage": "generate", "hstap_version": "0", "config": old}))
    with pytest.raises(HstapError, match="--temperature 0.0.*--new"):
        generate(GenerateConfig(data=[str(corpus)], out=str(out), server="http://127.0.0.1:9", temperature=0.7))
    with pytest.raises(HstapError, match="exactly one of --target"):
        GenerateConfig(data=[str(corpus)], out=str(out))
    with pytest.raises(HstapError, match="top_p"):
        GenerateConfig(data=[str(corpus)], out=str(out), server="http://x", top_p=0.0)
    with pytest.raises(HstapError, match="also an input"):
        GenerateConfig(data=[str(corpus)], out=str(corpus), server="http://x")


def test_a_sliding_window_cache_falls_back_to_reprefill(tiny_tokenizer, tmp_path):
    """A cache that cannot be carried across turns (sliding-window layers) is not: the whole history is prefilled
    each turn, with the same answers, and generate --capture still stores every last turn."""
    from hstap.capture.tap import generate as generate_capture
    from hstap.demo.toy import build_random_target

    build_random_target(tmp_path / "m", tiny_tokenizer[0], model_type="mistral", num_layers=2, sliding_window=8)
    recs = [{"id": f"c{n}", "conversations": [m for u in TURNS[:n] for m in (
        {"role": "user", "content": u}, {"role": "assistant", "content": "old"})]} for n in (3, 2)]
    src = _write_jsonl(tmp_path / "in.jsonl", recs)
    runs = {cache: generate_capture(GenerateConfig(
        data=[str(src)], out=str(tmp_path / f"o{cache}.jsonl"), target=str(tmp_path / "m"), max_new_tokens=5,
        prefix_cache=cache, capture=str(tmp_path / f"s{cache}"), layers="0,1", capture_dtype="fp32"))
        for cache in (True, False)}
    assert _read_jsonl(tmp_path / "oTrue.jsonl") == _read_jsonl(tmp_path / "oFalse.jsonl")
    assert runs[True]["prefilled_tokens"] == runs[True]["prompt_tokens"]  # nothing reused
    assert runs[True]["captured_samples"] == runs[False]["captured_samples"] == 2


@pytest.mark.parametrize("case", ["server that does not answer", "malformed input"])
def test_a_failed_start_leaves_no_output_and_no_config(case, tmp_path, capsys):
    """A failed start leaves nothing that blocks the next run: with a server that does not answer, or a malformed
    first input line, neither the output file nor its `.config.json` exists. The output (and its directory) is created
    at the first record; before it, nothing is."""
    from helpers.refusals import refused

    with socket.socket() as sk:  # a port nobody listens on: connection refused
        sk.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sk.getsockname()[1]}"
    src = _write_jsonl(tmp_path / "in.jsonl", CORPUS[:1])
    opts, expect = ["--retries", "0"], [f"{dead}/v1/models: giving up after 1 attempts"]
    if case == "malformed input":
        with open(src, "a") as f:
            f.write('{"id": "cut", "conversations": [\n')
        opts, expect = ["--model", "m"], [f"{src}:2: invalid JSON"]  # --model: no request before the first record
    out = tmp_path / "new-dir" / "out.jsonl"
    refused(["generate", "--server", dead, "--data", src, "--out", out, "--backoff", "0", *opts], capsys, *expect,
            untouched=[out.parent])


def test_max_len_drops_turns_and_leaves_out_what_does_not_fit(tiny_llama, tmp_path):
    """--max-len bounds a conversation: an answer is cut where it would pass it, the turns whose prompt no longer fits
    are dropped (the conversation ends with its last answered turn) and a conversation whose first prompt does not fit
    is left out; both counted, nothing raised."""
    recs = [{"id": "long", "conversations": [{"role": "user", "content": "indent " * 80},
                                             {"role": "assistant", "content": "x"}]},
            {"id": "turns", "conversations": [m for u in TURNS for m in ({"role": "user", "content": u},
                                                                         {"role": "assistant", "content": "old"})]}]
    src = _write_jsonl(tmp_path / "in.jsonl", recs)
    s = generate(GenerateConfig(data=[str(src)], out=str(tmp_path / "o.jsonl"), target=str(tiny_llama),
                                max_new_tokens=6, max_len=60))
    got = {r["id"]: r["conversations"] for r in _read_jsonl(tmp_path / "o.jsonl")}
    assert s["too_long"] == 1 and list(got) == ["turns"]
    conv = got["turns"]
    answered = sum(m["role"] == "assistant" for m in conv)
    assert conv[-1]["role"] == "assistant" and 0 < answered < len(TURNS)
    assert s["dropped_turns"] == len(TURNS) - answered and s["assistant_turns"] == answered
