"""``MoriTpConnector``: vLLM 0.34.0's ``KVConnectorBase_V1`` and ``SupportsHMA``, pushing KV from
prefill to decode as MoRIIO's WRITE mode does, with mori-tp's head slices, staging and streaming.

The facts of vLLM 0.34.0 this module relies on (``vllm/distributed/kv_transfer/kv_connector/v1/
base.py`` unless named):

- The constructor is ``(vllm_config, role, kv_cache_config)``; the scheduler process makes one
  with ``KVConnectorRole.SCHEDULER``, each worker one with ``KVConnectorRole.WORKER``
  (``KVConnectorFactory.create_connector``, ``kv_connector/factory.py``), which refuses a class
  that does not subclass ``SupportsHMA`` while the hybrid KV cache manager is on.
- Scheduler side: ``get_num_new_matched_tokens(request, num_computed_tokens)`` returns
  ``(tokens, load_async)``; ``update_state_after_alloc(request, blocks, num_external_tokens)``
  follows the allocation; ``build_connector_meta(scheduler_output)`` is called once per step
  before ``_update_after_schedule`` (``v1/core/sched/scheduler.py``), so a request's
  ``num_computed_tokens`` there excludes the step's tokens; ``request_finished_all_groups``
  (``SupportsHMA``) returning True keeps the request's blocks until a worker reports it in
  ``finished_sending``; ``bind_kv_cache_manager`` gives the manager whose ``get_block_ids``
  lists a request's blocks per group.
- Worker side: ``register_kv_caches(kv_caches)`` once, a dict from layer name to that layer's
  ``[B, H, N, C]`` view (``v1/kv_cache_interface.py``, ``create_kv_cache_views``);
  ``start_load_kv`` before the forward pass, ``save_kv_layer`` from each attention layer,
  ``wait_for_save`` once per step after the forward, ``get_transfer_results(finished_req_ids)``
  with ``finished_sending``, ``finished_recving`` and ``failed_recving`` (a failed receive is
  also in ``finished_recving``, so that the scheduler releases the request).
- The scheduler frees a request's blocks when ``finished_sending`` names it, and schedules a
  ``WAITING_FOR_REMOTE_KVS`` request once ``finished_recving`` does
  (``Scheduler._update_from_kv_xfer_finished``).
- MoRIIO's WRITE mode (``v1/moriio/moriio_connector.py``): the decode side tells the prefill
  side which blocks it allocated ("blocks ready", ``update_state_after_alloc``); the prefill
  side writes each layer once it is computed and seals the count after the forward pass
  (``wait_for_save``: ``seal_pending_transfers``), after the last chunk of a chunked prefill;
  pair configs come from a TP mapping made at handshake (``moriio_tp_mapping.py``); a decode
  request loads ``num_prompt_tokens - num_computed_tokens`` tokens asynchronously.

The request's path:

1. Decode scheduler: a request with ``kv_transfer_params["do_remote_prefill"]`` loads its prompt
   from prefill; once blocks are allocated, its block ids go to the workers in the step's
   :class:`MoriTpMetadata` (``reqs_to_recv``) and ``do_remote_prefill`` is cleared, as vLLM's NIXL
   connector does, so that it is loaded once.
2. Decode worker, ``start_load_kv``: handshake (once per prefill rank, over the side channel:
   each side's :class:`mori_tp.Layout`, taken from the registered view, its engine address and
   registered memory); then for each prefill rank the pair's action by mori-tp's rule. For a
   SEND pair it takes a staging slot from its pool, expects the stream on its
   :class:`~mori_tp.engines.Receiver` (the sender chooses the staging mode) and sends the
   "recv" message (pages, token, slot); a SKIP_REPLICA or NOT_PAIRED pair gets a "recv" that
   says nothing is to be sent, so that every prefill rank knows the request's targets.
3. Prefill scheduler: the step that completes a ``do_remote_decode`` request's prompt puts its
   blocks in ``reqs_to_send``; ``request_finished_all_groups`` holds the blocks until the
   workers report the send.
4. Prefill worker: ``start_load_kv`` opens one stream per SEND target whose "recv" has come
   (plan by :func:`mori_tp.engines.plan_request` with a :class:`mori_tp.PairConfig`, staging
   chosen by the streamer's cost model), ``save_kv_layer`` submits each layer behind its CUDA
   event, ``wait_for_save`` seals; a request whose decode side has not answered yet is sent
   whole from ``get_transfer_results`` once it has. A rank whose every pair is a replica or
   unpaired sends nothing and reports the request done.
5. Decode worker, ``get_transfer_results``: a request is ``finished_recving`` once every stream
   of it landed (unpacked when staged), and also ``failed_recving`` if any failed.

Limits (not done): one KV cache group of attention layers (no sliding-window, Mamba or hybrid
groups); vLLM's ``[B, H, N, C]`` views only (head slots packed otherwise, ``num_head_slots``,
are refused); pipeline and data parallelism, decode context parallelism and speculative decoding
are not handled; the side channel does not authenticate peers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import mori_tp
from mori_tp import Action, InvalidArgumentError, Layout, Request, Staging, StagingPool

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .layout import layout_from_wire, layout_to_wire, request_id_for, view_extent, view_layout
from .side import SideClient, SideServer

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger("mori_tp.vllm")

#: Seconds a transfer may go without progress, and a side-channel call may take, unless
#: ``kv_connector_extra_config`` says otherwise (``timeout``).
DEFAULT_TIMEOUT = 60.0
#: Bytes of each worker's staging pool unless ``kv_connector_extra_config["staging_bytes"]``.
DEFAULT_STAGING_BYTES = 64 << 20
ENGINES = ("mooncake", "nixl")


# --- what the scheduler tells the workers ---------------------------------------------------


@dataclass
class RecvSpec:
    """A decode request to receive: its blocks and where its prefill engine listens."""

    transfer_id: str
    block_ids: List[int]
    num_tokens: int
    #: Tokens at the start already in this engine's cache (a local prefix hit).
    num_computed_tokens: int
    remote_host: str
    remote_port: int
    remote_tp_size: int


@dataclass
class SendSpec:
    """A prefill request whose prompt this step completes: its blocks, to push."""

    transfer_id: str
    block_ids: List[int]
    num_tokens: int


@dataclass
class MoriTpMetadata(KVConnectorMetadata):
    reqs_to_recv: Dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: Dict[str, SendSpec] = field(default_factory=dict)


def _extra(vllm_config: Any) -> Dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def _timeout(extra: Dict[str, Any]) -> float:
    value = float(extra.get("timeout", DEFAULT_TIMEOUT))
    if not 0 < value < math.inf:
        raise InvalidArgumentError(f"mori_tp.vllm: timeout {value!r} must be a finite number of "
                                   "seconds above 0")
    return value


class MoriTpConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector; set ``kv_connector_extra_config`` to choose:

    - ``engine``: ``"mooncake"`` (default) or ``"nixl"``;
    - ``host``: the address this worker's engine and side channel listen on (default
      ``127.0.0.1``);
    - ``side_port``: the prefill engine's side-channel base port, rank ``r`` listening at
      ``side_port + r`` (a producer needs it; decode learns it from the request's
      ``kv_transfer_params["remote_port"]``);
    - ``staging_bytes``: each worker's staging pool (default 64 MiB);
    - ``timeout``: seconds a transfer may go without progress (default 60);
    - ``nixl_progress_thread``: start NIXL's own progress thread (default True: with protocol
      v4 a prefill agent must progress while it waits for the decode rank's ``done``, and
      several agents of one process polled only by the connector's threads stalled writes
      for 60 s in the tests; False saves its polling, about a third of a core);
    - ``tp_rank``: this worker's TP rank, when vLLM's TP group is not initialized (one process
      driving several ranks, as the tests do); otherwise vLLM's own.

    A decode request carries ``kv_transfer_params`` ``{"do_remote_prefill": true,
    "remote_host": ..., "remote_port": ..., "remote_tp_size": ..., "transfer_id": ...}``; the
    prefill request ``{"do_remote_decode": true, "transfer_id": ...}`` (default transfer id: the
    request id).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: Optional[_SchedulerSide] = _SchedulerSide(self, vllm_config)
            self._worker: Optional[_WorkerSide] = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(vllm_config, kv_cache_config)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """REGISTERS: the workers register the KV cache with an RDMA-style engine (vLLM 0.34.0's
        ``KVCacheAccess.REGISTERS``: one physical allocation per segment)."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS

    # -- scheduler side --

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(self, request: Any,
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
            self, request: Any,
            block_ids: Tuple[List[int], ...]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # -- worker side --

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, MoriTpMetadata)
        self._worker.start_step(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a decode request is scheduled only once all of it has landed (it loads
        asynchronously, between steps), so no layer waits inside a forward pass."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any,
                      **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step()

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.poll()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- for tests and tools --

    @property
    def worker(self) -> "_WorkerSide":
        assert self._worker is not None
        return self._worker


# --- the scheduler side ---------------------------------------------------------------------


class _SchedulerSide:
    def __init__(self, connector: MoriTpConnector, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self._recv: Dict[str, RecvSpec] = {}
        #: Producer requests not yet handed to the workers, and those that were.
        self._to_send: Dict[str, Any] = {}
        self._sent: Dict[str, str] = {}

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        tokens = max(request.num_prompt_tokens - num_computed_tokens, 0)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        transfer_id = str(params.get("transfer_id") or request.request_id)
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            missing = [k for k in ("remote_host", "remote_port", "remote_tp_size")
                       if k not in params]
            if missing:
                raise InvalidArgumentError(
                    f"mori_tp.vllm: request {request.request_id} has do_remote_prefill but no "
                    f"{', '.join(missing)} in its kv_transfer_params")
            groups = blocks.get_block_ids()
            if len(groups) != 1:
                raise InvalidArgumentError(
                    f"mori_tp.vllm: request {request.request_id} has {len(groups)} KV cache "
                    "groups; this connector moves one group of attention layers")
            self._recv[request.request_id] = RecvSpec(
                transfer_id, list(groups[0]), request.num_prompt_tokens,
                request.num_prompt_tokens - num_external_tokens, str(params["remote_host"]),
                int(params["remote_port"]), int(params["remote_tp_size"]))
            # Loaded once: the scheduler asks again after the load (vLLM's NIXL connector
            # clears the flag the same way).
            params["do_remote_prefill"] = False
        if params.get("do_remote_decode"):
            self._to_send[request.request_id] = (request, transfer_id)

    def build_connector_meta(self, scheduler_output: Any, manager: Any) -> MoriTpMetadata:
        metadata = MoriTpMetadata(reqs_to_recv=self._recv)
        self._recv = {}
        for req_id, (request, transfer_id) in list(self._to_send.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            # The step that computes the last prompt token (build_connector_meta runs before
            # the scheduler adds the step's tokens to num_computed_tokens).
            if scheduled and request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                groups = manager.get_block_ids(req_id)
                metadata.reqs_to_send[req_id] = SendSpec(transfer_id, list(groups[0]),
                                                         request.num_prompt_tokens)
                del self._to_send[req_id]
                self._sent[req_id] = transfer_id
        return metadata

    def request_finished(self, request: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        self._to_send.pop(req_id, None)
        self._recv.pop(req_id, None)
        # Blocks handed to the workers stay until they report the send (finished_sending).
        return self._sent.pop(req_id, None) is not None, None


# --- the worker side ------------------------------------------------------------------------


@dataclass
class _Peer:
    """Another engine's rank, as the handshake described it."""

    layout: Layout
    tp_size: int
    #: Prefill side: the decode rank's memory and the transport's handle for it.
    memory: Any = None
    handle: Any = None
    #: Decode side: the prefill rank's name in notifications, and its side channel.
    sender: Any = None
    client: Optional[SideClient] = None


@dataclass
class _Target:
    """One decode rank a prefill request goes to (from its "recv")."""

    decode_rank: int
    send: bool
    dst_pages: List[int] = field(default_factory=list)
    skip_tokens: int = 0
    token: str = ""
    staging: int = 0
    staging_capacity: int = 0


@dataclass
class _Outgoing:
    req_id: str
    spec: SendSpec
    engine_id: str = ""
    targets: Dict[int, _Target] = field(default_factory=dict)
    streams: List[Any] = field(default_factory=list)
    opened: bool = False
    #: Layers submitted so far in this step (streams opened at start_step).
    submitted: set = field(default_factory=set)
    deadline: float = 0.0


@dataclass
class _Expected:
    """A decode request: its streams, one per sending prefill rank."""

    req_id: str
    incomings: List[Any] = field(default_factory=list)
    error: Optional[str] = None


class _WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        extra = _extra(vllm_config)
        self.extra = extra
        self.engine = str(extra.get("engine", "mooncake"))
        if self.engine not in ENGINES:
            raise InvalidArgumentError(f"mori_tp.vllm: engine {self.engine!r} is not one of "
                                       f"{', '.join(ENGINES)}")
        self.host = str(extra.get("host", "127.0.0.1"))
        self.side_port = int(extra.get("side_port", 0))
        self.staging_bytes = int(extra.get("staging_bytes", DEFAULT_STAGING_BYTES))
        self.timeout = _timeout(extra)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.tp_rank = self._tp_rank(extra)
        model = vllm_config.model_config
        #: H for mori-tp: MLA keeps one latent "head" that every rank holds whole (vLLM 0.34.0
        #: ``ModelConfig.get_num_kv_heads`` returns 1 with ``use_mla``).
        self.total_kv_heads = 1 if model.use_mla else int(model.get_total_num_kv_heads())
        self.layout: Optional[Layout] = None
        self.layers: List[str] = []
        self._layer_index: Dict[str, int] = {}
        self.memory: Any = None
        self.transport: Any = None
        self.pool: Optional[StagingPool] = None
        self.streamer: Any = None
        self.receiver: Any = None
        self._lock = threading.Lock()
        self._peers: Dict[Tuple[str, int], _Peer] = {}
        #: Prefill side: "recv" messages per transfer id, from each decode rank.
        self._recvs: Dict[str, Dict[int, _Target]] = {}
        self._recv_engine: Dict[str, Tuple[str, int]] = {}
        self._outgoing: Dict[str, _Outgoing] = {}
        self._step: List[_Outgoing] = []
        self._expected: Dict[str, _Expected] = {}
        self._server: Optional[SideServer] = None
        #: Bytes and streams this worker has sent, for tests and logs.
        self.sent_bytes = 0
        self.sent_streams = 0

    def _tp_rank(self, extra: Dict[str, Any]) -> int:
        if "tp_rank" in extra:
            rank = int(extra["tp_rank"])
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                model_parallel_is_initialized,
            )

            rank = get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0
        if not 0 <= rank < self.tp_size:
            raise InvalidArgumentError(f"mori_tp.vllm: tp_rank {rank} outside the "
                                       f"{self.tp_size} ranks of tensor_parallel_size")
        return rank

    @property
    def is_producer(self) -> bool:
        return self.vllm_config.kv_transfer_config.kv_role in ("kv_producer", "kv_both")

    # -- registration, once --

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        """Takes each layer's layout from its view and spec, checks they agree, and registers
        the layers and a staging pool with the engine once."""
        if self.memory is not None:
            raise InvalidArgumentError("mori_tp.vllm: register_kv_caches called twice")
        config = self.kv_cache_config
        groups = list(getattr(config, "kv_cache_groups", None) or [])
        if len(groups) != 1:
            raise InvalidArgumentError(
                f"mori_tp.vllm: {len(groups)} KV cache groups; this connector moves one group of "
                "attention layers (hybrid models are not supported yet)")
        spec = groups[0].kv_cache_spec
        from vllm.v1.kv_cache_interface import AttentionSpec

        if not isinstance(spec, AttentionSpec):
            raise InvalidArgumentError(f"mori_tp.vllm: the KV cache group's spec is "
                                       f"{type(spec).__name__}, not an attention spec")
        if getattr(spec, "sliding_window", None):
            raise InvalidArgumentError("mori_tp.vllm: sliding-window groups are not supported")
        # Both engines run the same model: the group's layer order is the same on each side.
        self.layers = [name for name in groups[0].layer_names if name in kv_caches]
        if sorted(self.layers) != sorted(kv_caches):
            raise InvalidArgumentError(
                f"mori_tp.vllm: registered layers {sorted(kv_caches)} differ from the KV cache "
                f"group's {groups[0].layer_names}")
        layouts, buffers, extents = [], [], []
        for name in self.layers:
            view = kv_caches[name]
            layout = view_layout(name, view.shape, view.stride(), view.element_size(),
                                 num_heads=spec.num_heads, num_states=spec.num_states,
                                 content_bytes=spec.state_content_size_bytes,
                                 total_kv_heads=self.total_kv_heads, tp_size=self.tp_size,
                                 tp_rank=self.tp_rank)
            layouts.append(layout)
            buffers.append(int(view.data_ptr()))
            extents.append(view_extent(view.shape, view.stride(), view.element_size()))
        if any(layout != layouts[0] for layout in layouts):
            raise InvalidArgumentError("mori_tp.vllm: the layers' views differ in layout: "
                                       f"{sorted(set(map(str, layouts)))}")
        spans = sorted(zip(buffers, extents))
        for (a, n), (b, _) in zip(spans, spans[1:]):
            if a + n > b:
                raise InvalidArgumentError(
                    f"mori_tp.vllm: layer views overlap (0x{a:x} + {n} > 0x{b:x}): a layout "
                    "with blocks outside layers interleaves them, and each layer is registered "
                    "as one region; use a layer-compact KV cache layout")
        self.layout = layouts[0]
        self._layer_index = {name: i for i, name in enumerate(self.layers)}
        from mori_tp.engines import KvMemory, Receiver, Streamer

        self.pool = StagingPool(self.staging_bytes)
        self.transport = self._start_transport()
        self.memory = self.transport.register(KvMemory(
            tuple(buffers), max(extents), self.pool.address, self.pool.info().capacity))
        if self.is_producer:
            self.streamer = Streamer(self.transport, timeout=self.timeout)
            self._server = SideServer(self.host, self.side_port + self.tp_rank if self.side_port
                                      else 0, self._answer)
        else:
            self.receiver = Receiver(self.transport).start()

    def _start_transport(self) -> Any:
        if self.engine == "mooncake":
            from mori_tp.engines.mooncake import MooncakeTransport

            return MooncakeTransport.start(self.host)
        from mori_tp.engines.nixl import NixlTransport

        # NIXL's own progress thread (``nixl_progress_thread``, above): on unless asked off.
        progress = bool(self.extra.get("nixl_progress_thread", True))
        return NixlTransport.start(f"mori-tp-{self.engine_id}-{self.tp_rank}-{os.getpid()}",
                                   progress_thread=progress)

    @property
    def side_address(self) -> Tuple[str, int]:
        """Where this (prefill) worker's side channel listens."""
        assert self._server is not None
        return self.host, self._server.port

    def _address(self) -> Any:
        if self.engine == "mooncake":
            return self.transport.session_id
        return self.transport.metadata().hex()

    def _sender(self) -> str:
        return self.transport.session_id if self.engine == "mooncake" else self.transport.name

    # -- prefill: the side channel --

    def _answer(self, message: Dict[str, Any]) -> Dict[str, Any]:
        kind = message.get("type")
        engine_id, rank = str(message["engine_id"]), int(message["tp_rank"])
        if kind == "hello":
            from mori_tp.engines import KvMemory

            memory = KvMemory.from_dict(message["memory"])
            address = message["address"]
            handle = (address if self.engine == "mooncake"
                      else self.transport.add_peer(bytes.fromhex(address)))
            if memory.epoch:
                self.transport.set_peer_epoch(handle, memory.epoch)
            peer = _Peer(layout_from_wire(message["layout"]), int(message["tp_size"]),
                         memory=memory, handle=handle)
            mori_tp.pair_config(self.layout, peer.layout)  # refuses layouts that cannot pair
            with self._lock:
                self._peers[(engine_id, rank)] = peer
            reply = {"ok": True, "layout": layout_to_wire(self.layout), "tp_size": self.tp_size,
                     "tp_rank": self.tp_rank, "sender": self._sender()}
            if self.engine != "mooncake":
                # The decode rank answers each stream (done, cancel: protocol v4), and NIXL
                # notifies only an agent whose metadata it loaded: this agent's connection info
                # without memory, so the decode rank can answer but neither read nor write here.
                reply["answer"] = self.transport.answer_metadata().hex()
            return reply
        if kind == "recv":
            with self._lock:
                peer = self._peers.get((engine_id, rank))
            if peer is None:
                raise InvalidArgumentError(f"recv from decode rank {rank} of {engine_id} "
                                           "before its hello")
            send = bool(message["send"])
            action = mori_tp.pair_config(self.layout, peer.layout).action
            if send != (action is Action.SEND):
                raise InvalidArgumentError(
                    f"decode rank {rank} says send={send}, but mori-tp's rule gives {action.name} "
                    f"for prefill rank {self.tp_rank}")
            target = _Target(rank, send, [int(b) for b in message.get("dst_pages", [])],
                             int(message.get("skip_tokens", 0)), str(message.get("token", "")),
                             int(message.get("staging", 0)),
                             int(message.get("staging_capacity", 0)))
            with self._lock:
                self._recvs.setdefault(str(message["transfer_id"]), {})[rank] = target
                self._recv_engine[str(message["transfer_id"])] = (engine_id, peer.tp_size)
            return {"ok": True}
        raise InvalidArgumentError(f"unknown message type {kind!r}")

    # -- the step --

    def start_step(self, metadata: MoriTpMetadata) -> None:
        for req_id, spec in metadata.reqs_to_recv.items():
            self._expect(req_id, spec)
        self._step = []
        now = time.monotonic()
        for req_id, spec in metadata.reqs_to_send.items():
            outgoing = _Outgoing(req_id, spec, deadline=now + self.timeout)
            self._outgoing[req_id] = outgoing
            if self._try_open(outgoing):
                self._step.append(outgoing)

    def save_layer(self, layer_name: str, kv_layer: Any) -> None:
        layer = self._layer_index.get(layer_name)
        if not self._step or layer is None:
            # Nothing to send this step, or a layer this connector did not register (a draft
            # model's): nothing of it moves.
            return
        ready = None
        if getattr(kv_layer, "is_cuda", False):
            import torch

            # The layer's KV is written by kernels on the current stream: the stream packs or
            # writes it once they are done (MoRIIO WRITE: one write per layer after its event).
            ready = torch.cuda.Event()
            ready.record()
        for outgoing in self._step:
            if layer not in outgoing.submitted:
                outgoing.submitted.add(layer)
                for stream in outgoing.streams:
                    stream.submit(layer, ready=ready)

    def end_step(self) -> None:
        """Submits the layers save_kv_layer did not (a model runner that calls it for some
        layers only) and seals: the count is final after the forward pass."""
        for outgoing in self._step:
            self._submit_rest(outgoing)
        self._step = []

    def _submit_rest(self, outgoing: _Outgoing) -> None:
        for layer in range(len(self.layers)):
            if layer not in outgoing.submitted:
                outgoing.submitted.add(layer)
                for stream in outgoing.streams:
                    stream.submit(layer)
        for stream in outgoing.streams:
            stream.seal()

    def _try_open(self, outgoing: _Outgoing) -> bool:
        """Opens the request's streams once every decode rank's "recv" has come; False while
        some has not."""
        transfer_id = outgoing.spec.transfer_id
        with self._lock:
            targets = dict(self._recvs.get(transfer_id, {}))
            engine = self._recv_engine.get(transfer_id)
        if engine is None or len(targets) < engine[1]:
            return False
        with self._lock:
            self._recvs.pop(transfer_id, None)
            self._recv_engine.pop(transfer_id, None)
        outgoing.engine_id = engine[0]
        outgoing.targets = targets
        outgoing.opened = True
        for rank in sorted(targets):
            target = targets[rank]
            if target.send:
                outgoing.streams.append(self._open(outgoing, target))
        return True

    def _open(self, outgoing: _Outgoing, target: _Target) -> Any:
        from mori_tp.engines import plan_request

        with self._lock:
            peer = self._peers[(outgoing.engine_id, target.decode_rank)]
        pair = mori_tp.pair_config(self.layout, peer.layout)
        request = _request(self.layout, peer.layout, outgoing.spec.block_ids, target.dst_pages,
                           outgoing.spec.num_tokens, target.skip_tokens)
        remote = dataclasses.replace(peer.memory, staging=target.staging,
                                     staging_capacity=target.staging_capacity)
        rid = request_id_for(outgoing.spec.transfer_id, self.tp_rank)
        choice = self.streamer.choose(peer.handle, pair, request, remote=remote, request_id=rid)
        staging, slot = choice.staging, None
        if staging.packs:
            need = len(self.memory.buffers) * mori_tp.pair_staging_len(pair, request.num_tokens)
            assert self.pool is not None
            slot = self.pool.try_alloc(need) if need else None
            if slot is None:
                staging = self.streamer.choose(
                    peer.handle, pair, request, remote=remote, request_id=rid,
                    modes=[Staging.NONE, Staging.DST]).staging
        local = (dataclasses.replace(self.memory, staging=0, staging_capacity=0) if slot is None
                 else dataclasses.replace(self.memory, staging=slot.address,
                                          staging_capacity=slot.size))
        plan = plan_request(pair, request, local=local, remote=remote, staging=staging,
                            token=target.token)
        pool = self.pool
        release = (lambda: pool.free(slot)) if slot is not None else None
        self.sent_streams += 1
        return self.streamer.open(peer.handle, plan, rid, layers=len(self.layers),
                                  timeout=self.timeout, release=release)

    # -- decode: expecting a request --

    def _hello(self, spec: RecvSpec, rank: int) -> _Peer:
        key = (f"{spec.remote_host}:{spec.remote_port}", rank)
        with self._lock:
            peer = self._peers.get(key)
        if peer is not None:
            return peer
        client = SideClient(spec.remote_host, spec.remote_port + rank, self.timeout)
        reply = client.call({"type": "hello", "engine_id": self.engine_id,
                             "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                             "layout": layout_to_wire(self.layout),
                             "memory": self.memory.to_dict(), "address": self._address()})
        if int(reply["tp_rank"]) != rank or int(reply["tp_size"]) != spec.remote_tp_size:
            raise InvalidArgumentError(
                f"mori_tp.vllm: prefill side channel {spec.remote_host}:{spec.remote_port + rank} "
                f"is rank {reply['tp_rank']} of {reply['tp_size']}, expected {rank} of "
                f"{spec.remote_tp_size}")
        if reply.get("answer"):
            self.transport.add_peer(bytes.fromhex(reply["answer"]))
        peer = _Peer(layout_from_wire(reply["layout"]), int(reply["tp_size"]),
                     sender=reply["sender"], client=client)
        with self._lock:
            self._peers[key] = peer
        return peer

    def _expect(self, req_id: str, spec: RecvSpec) -> None:
        expected = _Expected(req_id)
        self._expected[req_id] = expected
        try:
            for rank in range(spec.remote_tp_size):
                peer = self._hello(spec, rank)
                pair = mori_tp.pair_config(peer.layout, self.layout)
                message: Dict[str, Any] = {"type": "recv", "engine_id": self.engine_id,
                                           "tp_rank": self.tp_rank,
                                           "transfer_id": spec.transfer_id,
                                           "send": pair.action is Action.SEND}
                if pair.action is Action.SEND:
                    message.update(self._expect_from(expected, spec, rank, peer, pair))
                assert peer.client is not None
                peer.client.call(message)
        except Exception as error:  # noqa: BLE001 - the request fails, vLLM is told
            logger.error("mori_tp.vllm: request %s cannot be received: %s", req_id, error)
            expected.error = f"{type(error).__name__}: {error}"
            # The ranks already asked may still write: give up on them now (their senders
            # are told; the memory is held until each answers).
            for incoming in expected.incomings:
                self.receiver.cancel(incoming, f"request {req_id} cannot be received")

    def _expect_from(self, expected: _Expected, spec: RecvSpec, rank: int, peer: _Peer,
                     pair: Any) -> Dict[str, Any]:
        from mori_tp.engines import BY_SENDER

        skip = _skip_tokens(peer.layout, self.layout, spec.num_computed_tokens)
        request = _request(peer.layout, self.layout, None, spec.block_ids, spec.num_tokens, skip)
        need = len(self.memory.buffers) * mori_tp.pair_staging_len(pair, request.num_tokens)
        assert self.pool is not None
        slot = self.pool.try_alloc(need) if need else None
        memory = (dataclasses.replace(self.memory, staging=0, staging_capacity=0) if slot is None
                  else dataclasses.replace(self.memory, staging=slot.address,
                                           staging_capacity=slot.size))
        pool = self.pool
        incoming = self.receiver.expect(
            request_id_for(spec.transfer_id, rank), pair, request, memory=memory,
            staging=BY_SENDER, peer=peer.sender, timeout=self.timeout,
            on_done=(lambda _incoming: pool.free(slot)) if slot is not None else None)
        expected.incomings.append(incoming)
        return {"dst_pages": list(spec.block_ids), "skip_tokens": skip, "token": incoming.token,
                "staging": memory.staging, "staging_capacity": memory.staging_capacity}

    # -- results --

    def poll(self) -> Tuple[set, set, set]:
        sending: set = set()
        now = time.monotonic()
        for req_id, outgoing in list(self._outgoing.items()):
            if not outgoing.opened:
                if self._try_open(outgoing):
                    # Its decode side answered after the forward pass: the whole request now.
                    self._submit_rest(outgoing)
                elif now > outgoing.deadline:
                    logger.error("mori_tp.vllm: request %s: its decode side never said where to "
                                 "write after %s s; the blocks are released unsent", req_id,
                                 self.timeout)
                    sending.add(req_id)
                    del self._outgoing[req_id]
                continue
            if outgoing in self._step:
                continue
            if all(stream.over for stream in outgoing.streams):
                for stream in outgoing.streams:
                    try:
                        result = stream.wait(0.001)
                        self.sent_bytes += result.bytes
                    except Exception as error:  # noqa: BLE001 - logged; the blocks are freed
                        logger.error("mori_tp.vllm: request %s: %s", req_id, error)
                sending.add(req_id)
                del self._outgoing[req_id]
        recving: set = set()
        failed: set = set()
        for req_id, expected in list(self._expected.items()):
            # A request is reported (and vLLM frees or reuses its blocks) only once it has
            # settled: after a failure, the decode rank holds the memory until the sender has
            # answered the cancel that every write of it returned (protocol v4), so a late write
            # of a stalled prefill cannot land in blocks vLLM gave to another request.
            if not all(i.done.is_set() and i.settled.is_set() for i in expected.incomings):
                continue
            errors = [str(i.error) for i in expected.incomings if i.error is not None]
            if expected.error is not None:
                errors.insert(0, expected.error)
            if errors:
                logger.error("mori_tp.vllm: request %s failed: %s", req_id, "; ".join(errors))
                failed.add(req_id)
            recving.add(req_id)
            del self._expected[req_id]
        return sending, recving, failed

    def shutdown(self) -> None:
        """Stops the side channel, the receiver and the streamer (waiting for its writes), and
        deregisters Mooncake's memory, so that the engine no longer reaches it."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        for peer in self._peers.values():
            if peer.client is not None:
                peer.client.close()
        if self.transport is not None and self.memory is not None and self.engine == "mooncake":
            self.transport.unregister(self.memory)
            self.memory = None
        # NIXL's registration stays until the process exits: deregister_memory after a peer
        # loaded this agent's metadata hung here (nixl-cu12, host memory, no progress thread).


def _skip_tokens(prefill: Layout, decode: Layout, num_computed_tokens: int) -> int:
    """Tokens at the start that need not move: the decode engine's local prefix hit, rounded
    down to a page boundary of both sides."""
    unit = prefill.page_size * decode.page_size // math.gcd(prefill.page_size, decode.page_size)
    return num_computed_tokens // unit * unit


def _request(prefill: Layout, decode: Layout, src_blocks: Optional[List[int]],
             dst_blocks: List[int], num_tokens: int, skip: int) -> Request:
    """The mori-tp Request of tokens ``skip .. num_tokens - 1``. The decode rank does not know
    the prefill rank's blocks and never reads them (it only unpacks its own staging slot into its
    own pages): it passes ``src_blocks`` None, and page 0 stands in for each."""
    count = num_tokens - skip
    src_first, dst_first = skip // prefill.page_size, skip // decode.page_size
    src_need = -(-count // prefill.page_size)
    dst = dst_blocks[dst_first:dst_first + -(-count // decode.page_size)]
    src = [0] * src_need if src_blocks is None else src_blocks[src_first:src_first + src_need]
    return Request(src, dst, count)
