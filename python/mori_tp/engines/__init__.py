"""Moving one request between a prefill rank and a decode rank through an RDMA-style transfer
engine (Mooncake, NIXL, MORI-IO), with mori-tp's slices and staging.

The engine-neutral part lives here; each engine has a small adapter module that imports its
engine only when used, so ``import mori_tp`` and ``import mori_tp.engines`` work without any of
them (numpy is needed here)::

    from mori_tp import engines
    from mori_tp.engines.mooncake import MooncakeTransport

    transport = MooncakeTransport.start("10.0.0.5")         # one per process
    transport.register(local)                               # once: buffers and staging pool

    # Per request, on the prefill rank (the initiator):
    plan = engines.plan_request(config, src_pages, dst_pages, local=local, remote=remote)
    transport.send(decode_session_id, plan)                 # pack if staged, write segments

    # On the decode rank, once the connector says the request has landed:
    engines.unpack_request(config, dst_pages, memory=decode_local)  # unpack if staged

For any page layout (HND pages, page sizes that differ, a partial last page), pass a
:class:`~mori_tp.PairConfig` and a :class:`~mori_tp.Request` instead of a SliceConfig and page
lists: ``plan_request(pair, request, local=..., remote=...)`` and ``unpack_request(pair,
request, memory=...)``; the staging default is then :func:`mori_tp.pair_staging_for`.

``local`` and ``remote`` are :class:`KvMemory`: the buffer addresses, their capacity and a
staging region of each rank. The decode rank sends its :class:`KvMemory` (``to_dict()``) and its
engine address to the prefill rank at handshake, as connectors already do for buffer pointers.
Both ranks derive the staging mode from the pair's config (:func:`mori_tp.staging_for`, or
:func:`mori_tp.pair_staging_for`) unless the connector chooses another and tells the receiver.
:class:`CostModel` (:mod:`mori_tp.engines.costs`) chooses each request's mode and chunk count
from the plan's segment counts, the transport's measured costs and the copy speed; with a
:class:`Streamer` the chosen mode travels in every notification, and the decode rank's
``Receiver.expect(..., staging=BY_SENDER)`` takes it from there.

:class:`Streamer` and :class:`Receiver` (:mod:`mori_tp.engines.streaming`) move a request in
chunks of buffers instead, so that packing, writing and unpacking overlap, or layer by layer as
the prefill's compute finishes each layer; a :class:`mori_tp.StagingPool` per rank provides the
staging slots. Their notifications carry a per-request token that the decode rank draws
(:func:`new_token`, ``Receiver.expect``) and sends with the request's slot and pages
(:mod:`mori_tp.engines.protocol`; who can reach what: REFERENCE.md section 18).

A hybrid model's request of several groups (:class:`mori_tp.Group`: full and sliding-window KV,
per-token records, state slots) is planned with :func:`plan_groups` and moves through the same
``transport.send`` as one write with one completion; the decode rank calls
:func:`unpack_groups` (:mod:`mori_tp.engines.groups`).
"""

from __future__ import annotations

# This file only re-exports: the code lives in the modules below, which import one another one
# way (faults, protocol and chunks below _requests; _requests below costs; costs below
# streaming; streaming below groups).
from ._requests import (  # noqa: F401
    BufferRanges,
    KvMemory,
    RequestPlan,
    SendResult,
    _int,
    _ranges,
    _staging,
    buffer_indices,
    plan_request,
    unpack_request,
)
from .faults import (  # noqa: F401
    PeerLostError,
    StaleRegistrationError,
    TransferError,
    TransferTimeoutError,
    new_epoch,
)
from .protocol import check_token  # noqa: F401

__all__ = [
    "BY_SENDER",
    "DEFAULT_TIMEOUT",
    "BufferRanges",
    "Choice",
    "CopyCosts",
    "CostModel",
    "GroupsPlan",
    "Incoming",
    "KvMemory",
    "Receiver",
    "RequestStream",
    "Streamer",
    "chunk_ranges",
    "layer_buffers",
    "new_token",
    "RequestPlan",
    "SendResult",
    "PeerLostError",
    "StaleRegistrationError",
    "TransportCosts",
    "TransferError",
    "TransferTimeoutError",
    "new_epoch",
    "plan_groups",
    "plan_request",
    "unpack_groups",
    "unpack_request",
]

# The engine-neutral chunked transfers; imported last, as they build on the names above.
from .costs import Choice, CopyCosts, CostModel, TransportCosts  # noqa: E402
from .streaming import (  # noqa: E402
    BY_SENDER,
    DEFAULT_TIMEOUT,
    Incoming,
    Receiver,
    RequestStream,
    Streamer,
    chunk_ranges,
    layer_buffers,
    new_token,
)

# Requests of several groups; imported last, as they build on the names above.
from .groups import GroupsPlan, plan_groups, unpack_groups  # noqa: E402
