"""Stand-ins for the Mooncake, NIXL and MORI-IO engine objects, for tests that run in one
process: each records the calls the transports make, checks what the real engine checks
(registered memory, list types, Mooncake's per-call limit), and performs the writes with
memmove, so that a request's bytes can be compared with send_kvcache's."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple


class Memory:
    """Registered (address, length) regions of one fake engine."""

    def __init__(self) -> None:
        self.regions: List[Tuple[int, int]] = []

    def add(self, address: int, length: int) -> None:
        self.regions.append((address, length))

    def check(self, address: int, length: int, what: str) -> None:
        if not any(a <= address and address + length <= a + n for a, n in self.regions):
            raise AssertionError(f"{what} [0x{address:x}, +{length}) is not registered")


class TransferOpcode:
    """``mooncake.engine.TransferOpcode``."""

    Read = "read"
    Write = "write"


@dataclass
class TransferNotify:
    """``mooncake.engine.TransferNotify``: a sender-chosen name and a message."""

    name: str
    msg: str


class FakeMooncake:
    """``mooncake.engine.TransferEngine`` after initialize(): one per side; ``peers`` maps a
    session id to the peer fake whose memory it writes."""

    QUEUE_LIMIT = 2048  # the TCP transport's default per-peer queue

    def __init__(self, port: int, peers: Dict[str, "FakeMooncake"]) -> None:
        self.port = port
        self.peers = peers
        self.memory = Memory()
        self.calls: List[Tuple[str, int]] = []
        self.register_status = 0
        #: Notifications received, oldest first (get_notifies takes them).
        self.inbox: List[TransferNotify] = []
        self.lock = threading.Lock()

    def get_rpc_port(self) -> int:
        return self.port

    def register_memory(self, address: int, length: int) -> int:
        self.memory.add(address, length)
        return self.register_status

    def unregister_memory(self, address: int) -> int:
        self.memory.regions = [r for r in self.memory.regions if r[0] != address]
        return 0

    def batch_transfer_sync_write(self, session: str, src: List[int], dst: List[int],
                                  lengths: List[int]) -> int:
        for values in (src, dst, lengths):
            assert type(values) is list and all(type(v) is int for v in values), \
                "the binding takes list[int]"
        self.calls.append((session, len(lengths)))
        if len(lengths) > self.QUEUE_LIMIT:
            return -1
        peer = self.peers[session]
        for s, d, n in zip(src, dst, lengths):
            self.memory.check(s, n, "source")
            peer.memory.check(d, n, "destination")
            ctypes.memmove(d, s, n)
        return 0

    def batch_transfer_sync(self, session: str, src: List[int], dst: List[int],
                            lengths: List[int], opcode: Any, notify: Any = None) -> int:
        assert opcode in (TransferOpcode.Write, TransferOpcode.Read)
        if not lengths:
            return -1  # the real engine refuses an empty batch, notification or not
        if opcode == TransferOpcode.Write:
            status = self.batch_transfer_sync_write(session, src, dst, lengths)
        else:
            status = self.batch_transfer_sync_read(session, src, dst, lengths)
        if status == 0 and notify is not None:
            # After every transfer of the batch completed, as the engine does.
            peer = self.peers[session]
            with peer.lock:
                peer.inbox.append(TransferNotify(notify.name, notify.msg))
        return status

    def batch_transfer_sync_read(self, session: str, dst: List[int], src: List[int],
                                 lengths: List[int]) -> int:
        """Reads the peer's ``src[i]`` into local ``dst[i]`` (the binding's argument order:
        local buffers first)."""
        self.calls.append((session, len(lengths)))
        peer = self.peers[session]
        for d, s, n in zip(dst, src, lengths):
            self.memory.check(d, n, "local buffer")
            peer.memory.check(s, n, "remote source")
            ctypes.memmove(d, s, n)
        return 0

    def get_notifies(self) -> List[TransferNotify]:
        with self.lock:
            taken, self.inbox = self.inbox, []
        return taken


class FakeNixlAgent:
    """``nixl_agent``: descriptor tables, one transfer per initialize_xfer, completion after
    ``polls`` checks, notifications delivered to the peer agent."""

    def __init__(self, name: str, agents: Dict[str, "FakeNixlAgent"]) -> None:
        self.name = name
        self.agents = agents
        agents[name] = self
        self.memory = Memory()
        self.notifs: Dict[str, List[bytes]] = {}
        self.polls = 2
        self.final_state = "DONE"
        self.transfers: List[Tuple[str, int, bytes]] = []
        self.released = 0

    def register_memory(self, regions: List[Tuple[int, int, int, str]], mem_type: str) -> Any:
        assert mem_type == "DRAM"
        for address, length, device, _ in regions:
            assert device == 0
            self.memory.add(address, length)
        return list(regions)

    def deregister_memory(self, descs: Any) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata  # nixl returns the name as bytes

    def get_xfer_descs(self, table: Any, mem_type: str) -> Any:
        assert mem_type == "DRAM" and table.shape[1] == 3
        return table.copy()

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str,
                        notif: bytes) -> Dict[str, Any]:
        assert op == "WRITE" and len(local) == len(remote)
        assert (local[:, 1] == remote[:, 1]).all()
        return {"local": local, "remote": remote, "peer": peer, "notif": notif, "left": 0}

    def transfer(self, handle: Dict[str, Any]) -> str:
        peer = self.agents[handle["peer"]]
        for (s, n, _), (d, _, _) in zip(handle["local"].tolist(), handle["remote"].tolist()):
            self.memory.check(s, n, "source")
            peer.memory.check(d, n, "destination")
            ctypes.memmove(d, s, n)
        self.transfers.append((handle["peer"], len(handle["local"]), handle["notif"]))
        handle["left"] = self.polls
        return self.check_xfer_state(handle) if self.polls == 0 else "PROC"

    def check_xfer_state(self, handle: Dict[str, Any]) -> str:
        if handle["left"] is None:
            return "PROC"  # never finishes
        handle["left"] -= 1
        if handle["left"] > 0:
            return "PROC"
        if self.final_state == "DONE" and handle["notif"]:
            # NIXL delivers the notification after the data.
            self.agents[handle["peer"]].notifs.setdefault(self.name, []).append(handle["notif"])
        return self.final_state

    def release_xfer_handle(self, handle: Dict[str, Any]) -> None:
        self.released += 1

    def update_notifs(self) -> Dict[str, List[bytes]]:
        return self.notifs

    def send_notif(self, peer: str, message: bytes) -> None:
        self.agents[peer].notifs.setdefault(self.name, []).append(message)


@dataclass
class FakeMemoryDesc:
    """``mori.io.MemoryDesc``: what register_memory returns and the peer unpacks."""

    engine_key: str
    data: int
    size: int
    device_id: int
    loc: str


class FakeStatus:
    def __init__(self, ok: bool, message: str = "") -> None:
        self.ok = ok
        self.message = message

    def InProgress(self) -> bool:  # noqa: N802 - MORI-IO's method names
        return False

    def Succeeded(self) -> bool:  # noqa: N802
        return self.ok

    def Failed(self) -> bool:  # noqa: N802
        return not self.ok

    def Code(self) -> str:  # noqa: N802
        return "SUCCESS" if self.ok else "ERR_RDMA_OP"

    def Message(self) -> str:  # noqa: N802
        return self.message


class FakeMoriIo:
    """``mori.io.IOEngine``: records register_memory, allocate_transfer_uid and batch_write
    calls; batch_write copies every (entry, segment) from the local to the remote region."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.calls: List[Tuple[str, Any]] = []
        self.next_uid = 100
        self.fail_entry: Optional[int] = None

    def register_memory(self, ptr: int, size: int, device_id: int, loc: Any) -> FakeMemoryDesc:
        self.calls.append(("register_memory", (ptr, size, device_id, loc)))
        return FakeMemoryDesc(self.key, ptr, size, device_id, loc)

    def allocate_transfer_uid(self) -> int:
        self.next_uid += 1
        return self.next_uid

    def batch_write(self, local_descs, local_offsets, remote_descs, remote_offsets, sizes,
                    uids):
        self.calls.append(("batch_write", (local_descs, local_offsets, remote_descs,
                                           remote_offsets, sizes, uids)))
        statuses = []
        for i, (ld, lo, rd, ro, n) in enumerate(zip(local_descs, local_offsets, remote_descs,
                                                    remote_offsets, sizes)):
            for s, d, k in zip(lo, ro, n):
                assert s + k <= ld.size and d + k <= rd.size, "outside the registered region"
                ctypes.memmove(rd.data + d, ld.data + s, k)
            statuses.append(FakeStatus(i != self.fail_entry, "remote QP in error state"))
        return statuses
