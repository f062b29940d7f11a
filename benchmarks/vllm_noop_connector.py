"""A baseline for benchmarks/bench_vllm_capture.py: hstap's connector with its worker side doing nothing (no gather, no
copy, no store), so that vLLM runs exactly as under `hstap capture --engine vllm` (extract_hidden_states, blocks held
until reported) minus what capture adds. Loaded by vLLM as `kv_connector_module_path: vllm_noop_connector` with
benchmarks/ on the path; never used outside the benchmark."""

from __future__ import annotations

from hstap.capture.vllm.connector import HstapConnector


class NoopConnector(HstapConnector):
    def _take(self, s) -> None:
        self._copies[s.req_id] = None  # reported sent at once, nothing copied or written
