"""What the vLLM connector tests share: vLLM 0.34.0 configs on CPU for a tiny local model
(``tiny-llama/config.json``: 4 KV heads of 32, 2 layers; no weights, no tokenizer), and KV
caches allocated by vLLM's own code (``get_kv_cache_config_from_groups`` and
``allocate_kv_cache``), so that the connector sees the views a vLLM worker registers.

Run with the venv of ``.ci/vllm-venv``; ``tests/vllm.rs`` runs each script under ``cargo test``.
Exit status 77: vLLM is not importable here (a skip, which ``MORI_TP_REQUIRE_TOOLS=1`` turns
into a failure).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Dict, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
SKIPPED = 77


def require_vllm() -> None:
    """Exits 77 (a skip), saying why, when vLLM 0.34.0 cannot be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        print(f"skipped: vLLM is not importable with {sys.executable} ({error}); make its venv "
              "with .ci/vllm-venv")
        sys.exit(SKIPPED)
    if vllm.__version__ != "0.34.0":
        print(f"skipped: vLLM {vllm.__version__} here; these tests are written for 0.34.0")
        sys.exit(SKIPPED)


def model_dir(num_kv_heads: int = 4, num_layers: int = 2, head_dim: int = 32) -> str:
    """A directory with a Llama config.json of these sizes (vLLM reads only the config with
    ``skip_tokenizer_init``; no weights are loaded)."""
    if (num_kv_heads, num_layers, head_dim) == (4, 2, 32):
        return os.path.join(HERE, "tiny-llama")
    import json

    path = tempfile.mkdtemp(prefix="mori-tp-vllm-model-")
    with open(os.path.join(HERE, "tiny-llama", "config.json")) as source:
        config = json.load(source)
    heads = max(8, num_kv_heads)
    config.update(num_key_value_heads=num_kv_heads, num_attention_heads=heads,
                  head_dim=head_dim, hidden_size=heads * head_dim,
                  num_hidden_layers=num_layers)
    with open(os.path.join(path, "config.json"), "w") as out:
        json.dump(config, out)
    return path


def vllm_config(role: str, *, engine: str = "mooncake", tp_size: int = 1,
                tp_rank: Optional[int] = None, block_size: int = 16, layout: str = "LBNHC",
                side_port: int = 0, model: Optional[str] = None, hybrid: bool = True,
                timeout: float = 30.0, staging_bytes: int = 8 << 20,
                engine_id: Optional[str] = None) -> Any:
    """A VllmConfig for one engine with MoriTpConnector (``role``: kv_producer or kv_consumer)
    and the hybrid KV cache manager on unless ``hybrid`` is False. ``tp_rank``: this worker's
    rank, passed to the connector (``kv_connector_extra_config["tp_rank"]``) since one process
    holds several ranks here, without vLLM's TP group."""
    import torch  # noqa: F401 - vllm.config needs it imported first on some paths
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    extra: Dict[str, Any] = {"engine": engine, "host": "127.0.0.1", "timeout": timeout,
                             "staging_bytes": staging_bytes}
    if side_port:
        extra["side_port"] = side_port
    if tp_rank is not None:
        extra["tp_rank"] = tp_rank
    mc = ModelConfig(model=model or model_dir(), dtype="bfloat16", seed=0,
                     skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                         enable_chunked_prefill=True, is_encoder_decoder=False,
                         disable_hybrid_kv_cache_manager=None if hybrid else True)
    cc = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True)
    cc.kv_cache_layout = layout
    kt = KVTransferConfig(kv_connector="MoriTpConnector",
                          kv_connector_module_path="mori_tp.vllm.connector", kv_role=role,
                          kv_connector_extra_config=extra, engine_id=engine_id)
    pc = ParallelConfig(tensor_parallel_size=tp_size)
    config = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                        kv_transfer_config=kt, parallel_config=pc,
                        device_config=DeviceConfig("cpu"))
    if hybrid:
        # vLLM turns the hybrid manager off on CPU (no platform support); a GPU platform
        # keeps it on, which is what these tests exercise: the factory's SupportsHMA check.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def kv_cache_config(config: Any, num_blocks: int) -> Any:
    """vLLM's KVCacheConfig for ``config``'s model on one TP rank: one full-attention group of
    every layer (the spec vLLM's attention layers report), ``num_blocks`` blocks."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    model = config.model_config
    heads = model.get_num_kv_heads(config.parallel_config)
    spec = FullAttentionSpec(block_size=config.cache_config.block_size, num_kv_heads=heads,
                             head_size=model.get_head_size(), dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn"
              for i in range(model.get_num_layers(config.parallel_config))]
    groups = [KVCacheGroupSpec(layers, spec)]
    return get_kv_cache_config_from_groups(config, groups, num_blocks * spec.page_size_bytes
                                           * len(layers))


def allocate(config: Any, kv_config: Any) -> Dict[str, Any]:
    """The per-layer views vLLM's worker allocates (``allocate_kv_cache``) on CPU."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = config.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(kv_config, torch.device("cpu"), layout)


def worker(config: Any, kv_config: Any) -> Tuple[Any, Dict[str, Any]]:
    """A worker-side MoriTpConnector made by vLLM's factory, with its KV caches registered."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_config)
    caches = allocate(config, kv_config)
    connector.register_kv_caches(caches)
    return connector, caches
