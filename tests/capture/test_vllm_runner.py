"""vLLM's model runners (hstap/engines/vllm_runner.py): the paths that read V1's runner refuse Model Runner V2 in one
line naming the setting, before anything is written. V2 cannot start on this CPU (no Triton CPU backend), so its
runner is simulated by an instance of vLLM's own V2 runner classes made without their constructor; the V1 run is the
live tests' (tests/capture/test_vllm_driver.py, tests/test_serve_loop.py: the hello file records "v1")."""

from __future__ import annotations

import types

import pytest
from helpers.vllm import require_vllm

from hstap.common import HstapError


def _bare(cls):
    return object.__new__(cls)  # a runner object of that class, none of its engine state built


def test_the_runner_is_told_from_vllms_own_classes():
    require_vllm()
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CpuV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CpuV1
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GpuV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GpuV1

    from hstap.engines.vllm_runner import configured_runner, runner_of

    assert [runner_of(_bare(c)) for c in (GpuV1, CpuV1, GpuV2, CpuV2)] == ["v1", "v1", "v2", "v2"]
    assert configured_runner(types.SimpleNamespace(use_v2_model_runner=True)) == "v2"
    assert configured_runner(types.SimpleNamespace(use_v2_model_runner=False)) == "v1"


def test_the_tap_start_refuses_a_v2_runner_before_wrapping_anything():
    require_vllm()
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GpuV2

    from hstap.capture.vllm.eagle_tap import BOOK
    from hstap.serve_loop.worker import HstapWorker

    worker = HstapWorker()
    worker.model_runner = runner = _bare(GpuV2)
    runner.execute_model = execute = object()  # what install would wrap
    with pytest.raises(HstapError, match=r"Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER=0") as e:
        worker.hstap_tap_start()
    assert "\n" not in str(e.value) and "_model_forward" in str(e.value)
    assert runner.execute_model is execute and not BOOK.installed


def test_the_tap_connector_refuses_v2_before_its_store_is_touched(tmp_path):
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hstap.capture.vllm.eagle_tap import HstapEagleTapConnector

    store = tmp_path / "store"
    cfg = types.SimpleNamespace(use_v2_model_runner=True)  # the config a V2 server's connector gets
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(HstapError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            HstapEagleTapConnector(cfg, role)
    assert not store.exists() and list(tmp_path.iterdir()) == []


def test_hstaps_own_launches_pin_v1_unless_the_environment_names_a_runner():
    from hstap.engines.vllm_runner import ENV, pin_v1

    assert pin_v1({})[ENV] == "0"
    assert pin_v1({ENV: "1"})[ENV] == "1"  # the user's choice, for the paths that run under V2
    assert pin_v1({ENV: "1"}, force=True)[ENV] == "0"


def test_serve_loop_refuses_a_v2_environment_before_anything_is_written(tmp_path, monkeypatch):
    from hstap.serve_loop.config import ServeLoopConfig
    from hstap.serve_loop.stage import serve_loop

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    out = tmp_path / "w"
    with pytest.raises(HstapError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        serve_loop(ServeLoopConfig(target=str(tmp_path), prompts=str(prompts), out=str(out)))
    assert not out.exists()
