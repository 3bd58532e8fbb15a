"""How silent TCP connections to a Mooncake rank's session port delay mori-tp's requests
(REFERENCE.md section 18; issue 44 F10): the engine's behaviour, measured. This process is the
prefill rank (a Streamer with a 6 s stream timeout), the decode rank a StreamPeer child, both
on 127.0.0.1. For 0, 1, 3 and 6 connections that are opened to the decode's session port and
send nothing, one request of one chunk is timed; then the connections close and one more is
timed. Prints each time and, for a request that failed, its error whole (what the timeout
names).

    PYTHONPATH=python:python/tests python3 python/benchmarks/silent_connections.py
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import replace

import numpy as np

import mori_tp
from layouts import Layout
from mori_tp.engines import KvMemory, Streamer, TransferError, plan_request
from mori_tp.engines.loopback import StreamPeer, driver, engine_available, run_program

LAYOUT = Layout(heads=8, p_tp=8, d_tp=2, page_size=4, bytes_per_head=64)
BUFFERS, PAGES = 6, 32
STREAM_TIMEOUT = 6.0


def main() -> int:
    problem = engine_available("mooncake")
    if problem:
        print(f"SKIPPED: {problem}")
        return 77
    drv = driver("mooncake")
    transport = drv.start("prefill")
    config = LAYOUT.config(1, 0)
    mode = mori_tp.staging_for(config)
    cap_src, cap_dst = PAGES * LAYOUT.src_item_len, PAGES * LAYOUT.dst_item_len
    src = [np.random.default_rng(b).integers(0, 256, cap_src, dtype=np.uint8)
           for b in range(BUFFERS)]
    local = transport.register(KvMemory(tuple(int(b.ctypes.data) for b in src), cap_src))
    pool = mori_tp.StagingPool(1 << 20)
    transport.register(KvMemory((), 0, pool.address, pool.capacity))
    peer = StreamPeer("mooncake", [(BUFFERS, cap_dst)], 1 << 22, 30.0, min_slot=1 << 12,
                      linger=0.25)
    remote = drv.connect(transport, peer.address, peer.epoch)
    peer.connect(drv.sender(transport))
    host, port = str(peer.address).rsplit(":", 1)
    streamer = Streamer(transport, timeout=STREAM_TIMEOUT)
    need = BUFFERS * mori_tp.staging_len(config, 4)
    count = [0]

    def request() -> str:
        count[0] += 1
        rid = f"r{count[0]}"
        slot_address, token = peer.expect(rid, 0, config, [0, 1, 2, 3], int(mode),
                                          need if mode.unpacks else 0, timeout=10.0)
        slot = pool.alloc(need)
        memory = replace(local, staging=slot.address, staging_capacity=slot.size)
        remote_memory = peer.memories[0]
        if slot_address:
            remote_memory = replace(remote_memory, staging=slot_address,
                                    staging_capacity=need)
        plan = plan_request(config, [4, 5, 6, 7], [0, 1, 2, 3], local=memory,
                            remote=remote_memory, staging=mode, token=token)
        start = time.monotonic()
        try:
            streamer.send(remote, plan, rid, chunks=1, release=lambda: pool.free(slot))
            return f"ok in {time.monotonic() - start:.2f} s"
        except TransferError as error:
            return f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {error}"

    print(f"no silent connection: {request()}")
    for n in (1, 3, 6):
        sockets = [socket.create_connection((host, int(port))) for _ in range(n)]
        time.sleep(0.2)
        print(f"{n} silent connection(s) held: {request()}", flush=True)
        for s in sockets:
            s.close()
        time.sleep(0.5)
        print(f"   after they closed: {request()}", flush=True)
    streamer.close()
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_program(main))
