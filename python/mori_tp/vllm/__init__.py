"""mori-tp inside vLLM: a KV connector (``KVConnectorBase_V1`` and ``SupportsHMA``) that pushes
each request's KV from the prefill engine into the decode engine's blocks, layer by layer, with
mori-tp's head slices, staging and streaming, over Mooncake or NIXL.

Load it by module path; nothing in vLLM needs patching (vLLM 0.34.0's
``KVConnectorFactory.get_connector_class`` imports ``kv_connector_module_path`` and takes the
class named ``kv_connector`` from it)::

    --kv-transfer-config '{"kv_connector": "MoriTpConnector",
                           "kv_connector_module_path": "mori_tp.vllm.connector",
                           "kv_role": "kv_producer",          # or "kv_consumer"
                           "kv_connector_extra_config": {"engine": "mooncake",   # or "nixl"
                                                         "host": "10.0.0.5",
                                                         "side_port": 47000}}'

REFERENCE.md section 21 describes the request's path, the side channel and the limits.
This package imports vLLM only in :mod:`mori_tp.vllm.connector`: ``import mori_tp`` and
``import mori_tp.vllm`` work without vLLM, and :func:`view_layout` (the layout of a registered
KV view) and :func:`pair_actions` need no vLLM either.
"""

from __future__ import annotations

from typing import Any

from .layout import (
    local_heads,
    view_layout,
    view_extent,
    pair_actions,
    layout_to_wire,
    layout_from_wire,
    request_id_for,
)

__all__ = [
    "local_heads",
    "view_layout",
    "view_extent",
    "pair_actions",
    "layout_to_wire",
    "layout_from_wire",
    "request_id_for",
    "MoriTpConnector",
]


def __getattr__(name: str) -> Any:
    if name == "MoriTpConnector":
        from .connector import MoriTpConnector

        return MoriTpConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
