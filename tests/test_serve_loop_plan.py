"""The serve loop's plan (hstap/serve_loop/plan.py), without vLLM: every input resolved once before anything is
written (the start drafter's layers, depth and vocabulary; the prompts; the stop ids), and what the loop then writes
and starts built from it (OUT/vocab_map.safetensors, the trainer's config, the server's EAGLE-3 and tap configs from
hstap/engines/vllm.py), on the small trained run of the bad-input tests."""

from __future__ import annotations

import json


def test_the_loop_resolves_its_inputs_once_into_a_plan_that_builds_the_run(small_run, tmp_path):
    """hstap/serve_loop/plan.py: the start drafter's layers, depth and vocabulary read once (nothing written); what
    the loop then writes and starts is built from the plan: OUT/vocab_map.safetensors, the trainer's config, the
    server's two vLLM JSON arguments (hstap/engines/vllm.py's)."""
    import torch

    from hstap.artifacts.drafter_dir import load_drafter, resolve_drafter_dir
    from hstap.artifacts.vocab_map import load_vocab_map
    from hstap.capture.vllm.protocol import TAP_CONNECTOR, TAP_CONNECTOR_MODULE
    from hstap.config import from_flags
    from hstap.engines.vllm import eagle3_config
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.serve_loop.plan import WHOLE_VOCABULARY, resolve
    from hstap.serve_loop.stage import server_args, start_drafter, trainer_config

    base = dict(target=str(small_run["target"]), prompts=str(small_run["chats"]), device="cpu", requests=4)
    out = tmp_path / "w"
    cfg = from_flags(ServeLoopConfig, **base, out=str(out), drafter=str(small_run["run"]), holdout_frac=0.2)
    plan = resolve(cfg, out)
    d = resolve_drafter_dir(small_run["run"])
    meta = json.loads((d / "drafter.json").read_text())
    assert plan.drafter == d and list(plan.layers) == meta["config"]["aux_layers"] == [1, 3, 4]
    assert plan.draft_layers == meta["config"].get("num_layers", 1) and plan.vocab.sha256() == meta["vocab_map_sha256"]
    assert (len(plan.prompts), plan.device, plan.dtype) == (4, "cpu", "fp32") and plan.stop_ids
    rec = json.loads(json.dumps(plan.record()))  # OUT/plan.json: the resolved facts, JSON as they are
    assert rec["aux_layers"] == [1, 3, 4] and rec["vocab_map"]["sha256"] == meta["vocab_map_sha256"]
    assert rec["requests"] == 4 and rec["target"]["path"] == str(small_run["target"].resolve())
    assert not out.exists()  # resolving writes nothing

    out.mkdir()
    assert start_drafter(cfg, plan, out) == d
    d2t, t2d = load_vocab_map(out / "vocab_map.safetensors")  # written atomically, the drafter's own map
    assert torch.equal(d2t, plan.vocab.d2t) and torch.equal(t2d, plan.vocab.t2d)
    t = trainer_config(cfg, out, d, plan.draft_layers, plan.device)
    assert t.stream.holdout_frac == 0.2 and t.drafter.draft_layers == plan.draft_layers and t.drafter.init_from == str(d)
    served = out / "exports" / "v0000"
    args = server_args(cfg, plan.device, plan.dtype, served, out / "store")
    assert json.loads(args[args.index("--speculative-config") + 1]) == eagle3_config(served, cfg.k) == {
        "method": "eagle3", "model": str(served), "num_speculative_tokens": cfg.k}
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert (kv["kv_connector"], kv["kv_connector_module_path"], kv["kv_role"]) == (
        TAP_CONNECTOR, TAP_CONNECTOR_MODULE, "kv_producer")
    assert kv["kv_connector_extra_config"] == {"store": str(out / "store"), "tap": True, "tap_dtype": cfg.tap_dtype,
                                               "shard_tokens": cfg.shard_tokens, "flush_s": cfg.flush_s}
    fixed = server_args(from_flags(ServeLoopConfig, **base, out=str(out), mode="fixed", drafter=str(d)), "cpu",
                        "fp32", served, out / "store")
    assert "--speculative-config" in fixed and "--kv-transfer-config" not in fixed  # the loop off: no tap

    # from nothing: --layers, the whole vocabulary, the trainer's initialisation written when the loop starts
    out2 = tmp_path / "w2"
    cfg2 = from_flags(ServeLoopConfig, **base, out=str(out2), layers="1,3,4")
    plan2 = resolve(cfg2, out2)
    V = json.loads((small_run["target"] / "config.json").read_text())["vocab_size"]
    assert (plan2.drafter, plan2.layers, plan2.draft_layers) == (None, (1, 3, 4), 1)
    assert (plan2.vocab.size, plan2.vocab.source) == (V, WHOLE_VOCABULARY)
    out2.mkdir()
    d0 = start_drafter(cfg2, plan2, out2)
    drafter, _ = load_drafter(d0)
    assert d0 == out2 / "drafter-init" and list(drafter.config.aux_layers) == [1, 3, 4]
    assert load_vocab_map(out2 / "vocab_map.safetensors")[0].numel() == V
