"""mori-tp requests over NVIDIA's NIXL (``nixl_agent``, UCX backend by default).

Needs: the NIXL wheel for your CUDA (``nixl-cu12``, or ``nixl``) and numpy. For host memory
``pip install --no-deps nixl-cu12 numpy`` is enough: the wheel declares torch but only uses it
for torch tensors. The agent is imported only by :meth:`NixlTransport.start` (as ``nixl._api``,
else ``nixl_cu12``); a transport can also wrap an agent the connector already has.

Who calls what:

- Both ranks: one :class:`NixlTransport` per process, :meth:`~NixlTransport.register` of its
  :class:`~mori_tp.engines.KvMemory` once, and the agents' metadata exchanged at handshake
  (:meth:`~NixlTransport.metadata` on one side, :meth:`~NixlTransport.add_peer` on the other;
  the prefill rank needs the decode rank's, and the decode rank the prefill rank's to receive
  notifications).
- Prefill rank (initiator): :func:`mori_tp.engines.plan_request`, then
  :meth:`~NixlTransport.send` with a notification message; it returns once NIXL reports the
  write done.
- Decode rank (target): :meth:`~NixlTransport.wait_notification` for that message, then
  :func:`mori_tp.engines.unpack_request`. NIXL delivers the notification after the data.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from . import KvMemory, RequestPlan, SendResult, TransferError

__all__ = ["NixlTransport"]


def _import_agent() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError as error:
            raise ImportError(
                "the NIXL transport needs a NIXL wheel (pip install --no-deps nixl-cu12 numpy "
                f"for host memory): {error}"
            ) from error
    return nixl_agent, nixl_agent_config


class NixlTransport:
    """Writes mori-tp requests through one ``nixl_agent`` (one per process).

    Args:
        agent: a ``nixl_agent`` with a backend that handles ``mem_type`` (UCX for DRAM).
        mem_type: ``"DRAM"`` for host memory, ``"VRAM"`` for GPU memory.
        device_id: the GPU of the buffers (0 for DRAM).
        poll_interval: seconds between polls while waiting for a transfer or a notification.
    """

    def __init__(self, agent: Any, *, mem_type: str = "DRAM", device_id: int = 0,
                 poll_interval: float = 0.0) -> None:
        self.agent = agent
        self.mem_type = mem_type
        self.device_id = device_id
        self.poll_interval = poll_interval
        self._registered: List[Any] = []

    @classmethod
    def start(cls, name: str, *, backends: Sequence[str] = ("UCX",), mem_type: str = "DRAM",
              device_id: int = 0) -> "NixlTransport":
        """Creates a ``nixl_agent(name)`` with ``backends`` (names must be unique among the
        agents that talk to each other)."""
        nixl_agent, nixl_agent_config = _import_agent()
        agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        return cls(agent, mem_type=mem_type, device_id=device_id)

    @property
    def name(self) -> str:
        return _text(self.agent.name)

    def metadata(self) -> bytes:
        """This agent's metadata, for the peer's :meth:`add_peer` (send it after
        :meth:`register`, so that it describes the registered memory)."""
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata; returns the peer's name, which :meth:`send` and
        :meth:`wait_notification` take."""
        return _text(self.agent.add_remote_agent(metadata))

    def register(self, memory: KvMemory) -> None:
        """Registers every buffer and the staging region of ``memory`` with the agent."""
        regions = [(address, length, self.device_id, "") for address, length in memory.regions()]
        if regions:
            self._registered.append(self.agent.register_memory(regions, self.mem_type))

    def unregister(self) -> None:
        """Deregisters everything :meth:`register` registered (before the memory is freed)."""
        while self._registered:
            self.agent.deregister_memory(self._registered.pop())

    def _descs(self, addresses: "np.ndarray", lengths: "np.ndarray") -> Any:
        table = np.empty((len(lengths), 3), dtype=np.uint64)
        table[:, 0] = addresses
        table[:, 1] = lengths
        table[:, 2] = self.device_id
        return self.agent.get_xfer_descs(table, self.mem_type)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              *, notification: bytes = b"", timeout: float = 60.0) -> int:
        """Writes ``lengths[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]`` as one
        NIXL transfer, and waits until NIXL reports it done; ``notification`` reaches the peer
        after the data. Returns the number of transfers posted (1, or 0 for an empty list)."""
        lengths = np.asarray(lengths, dtype=np.uint64)
        if not len(src) == len(dst) == len(lengths):
            raise ValueError(f"{len(src)} sources, {len(dst)} destinations, {len(lengths)} lengths")
        if not len(lengths):
            # Nothing to move (a pair that is not SEND): the peer still gets its notification.
            if notification:
                self.agent.send_notif(peer, notification)
            return 0
        local = self._descs(np.asarray(src, dtype=np.uint64), lengths)
        remote = self._descs(np.asarray(dst, dtype=np.uint64), lengths)
        handle = self.agent.initialize_xfer("WRITE", local, remote, peer, notification)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"nixl: a write of {len(lengths)} segments to {peer} was still in "
                        f"progress after {timeout} s"
                    )
                if self.poll_interval:
                    time.sleep(self.poll_interval)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(
                    f"nixl: a write of {len(lengths)} segments to {peer} ended in state {state}"
                )
        finally:
            self.agent.release_xfer_handle(handle)
        return 1

    def send(self, peer: str, plan: RequestPlan, *, notification: bytes = b"",
             timeout: float = 60.0, backend: str = "auto",
             stream: Optional[int] = None) -> SendResult:
        """Moves one request: packs the local staging region if the plan's staging is SRC or
        BOTH, then writes every segment of every buffer to ``peer`` as one NIXL transfer, with
        ``notification`` delivered to the peer after the data."""
        pack_seconds = plan.pack(backend=backend, stream=stream)
        src, dst, lengths = plan.addresses()
        start = time.perf_counter()
        calls = self.write(peer, src, dst, lengths, notification=notification, timeout=timeout)
        return SendResult(plan.staging, plan.segments, plan.bytes, calls, pack_seconds,
                          time.perf_counter() - start)

    def wait_notification(self, peer: str, message: bytes, *, timeout: float = 60.0) -> None:
        """Waits until ``peer`` has sent exactly ``message`` (a :meth:`send` notification) and
        consumes it. Raises :class:`TransferError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._take_notification(peer, message):
            if time.monotonic() > deadline:
                raise TransferError(
                    f"nixl: no notification {message!r} from {peer} within {timeout} s"
                )
            time.sleep(self.poll_interval or 0.0005)

    def _take_notification(self, peer: str, message: bytes) -> bool:
        # Exact match: check_remote_xfer_done matches prefixes, so b"req-1" would take b"req-10".
        notifs: Dict[Any, List[bytes]] = self.agent.update_notifs()
        for key in (peer, peer.encode()):
            messages = notifs.get(key)
            if messages and message in messages:
                messages.remove(message)
                return True
        return False


def _text(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)
