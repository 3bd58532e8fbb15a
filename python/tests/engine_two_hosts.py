"""Two hosts on one machine: a prefill process and a decode process in two network namespaces
joined by a veth pair, moving requests through a real transfer engine over TCP (Mooncake's TCP
transport; NIXL's UCX restricted to its TCP transport, ``UCX_TLS=tcp``), every byte verified.

This process (in the machine's own namespace) makes the namespaces ``<prefix>p`` and
``<prefix>d``, the veth pair between them (10.77.0.1 and 10.77.0.2 inside them) and, where the
kernel has them, the link's shaping: ``tc netem`` delay and loss (``--netem``, default
"delay 2ms loss 0.2%"), else a token bucket (``tc tbf``, ``--rate``, default 2gbit) with a small
queue, whose overflow drops packets too. It then runs this script again as the prefill process
inside ``<prefix>p`` (``ip netns exec``), which starts its decode child inside ``<prefix>d``
(``setns``) and runs engine_streaming.py's cases across the link (pipelined in every staging
mode, streamed by layer, requests in flight through a pool of two slots, protocol violations)
plus one large request; afterwards this process checks, from the veth counters, that the
requests' bytes crossed the link. The namespaces are removed whatever happens: on success, on
failure, on a timeout (SIGALRM after TOTAL_TIMEOUT), on SIGTERM/SIGINT; and tests/python.rs
removes any left under its prefix after the script ends, even if it was killed.

    python3 python/tests/engine_two_hosts.py mooncake|nixl [--prefix mtpX] [--netem ARGS]

Needs root, ``ip`` and ``tc`` (iproute2) and network namespaces; without them it exits 77 with
the reason (1 under MORI_TP_REQUIRE_TOOLS=1). Exit status: 0 passed, 1 failed, 77 skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

PREFILL_ADDRESS, DECODE_ADDRESS = "10.77.0.1", "10.77.0.2"
#: Seconds the prefill process may take (its own cases bound every step).
PREFILL_TIMEOUT = 240
#: Below the 300 s that tests/python.rs allows.
TOTAL_TIMEOUT = 280
#: What UCX may use: TCP only, so that NIXL's bytes cross the link (not shared memory or CMA).
UCX_ENV = (("UCX_TLS", "tcp"),)


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=check)


class Link:
    """Two namespaces and the veth pair between them; ``close`` removes them (idempotent)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.prefill, self.decode = f"{prefix}p", f"{prefix}d"
        self.veth = (f"{prefix}a", f"{prefix}b")
        self.made: List[str] = []
        self.shaping = ""

    def open(self, netem: str, rate: str) -> None:
        for name in (self.prefill, self.decode):
            run("ip", "netns", "add", name)
            self.made.append(name)
        a, b = self.veth
        run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        run("ip", "link", "set", a, "netns", self.prefill)
        run("ip", "link", "set", b, "netns", self.decode)
        for ns, dev, address in ((self.prefill, a, PREFILL_ADDRESS),
                                 (self.decode, b, DECODE_ADDRESS)):
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        self.shaping = self.shape(netem, rate)

    def shape(self, netem: str, rate: str) -> str:
        """netem on both ends where the kernel has it, else tbf; what was applied, in words."""
        ends = ((self.prefill, self.veth[0]), (self.decode, self.veth[1]))
        why = ""
        if netem:
            tried = run("ip", "netns", "exec", self.prefill, "tc", "qdisc", "add", "dev",
                        self.veth[0], "root", "netem", *netem.split(), check=False)
            if tried.returncode == 0:
                run("ip", "netns", "exec", self.decode, "tc", "qdisc", "add", "dev",
                    self.veth[1], "root", "netem", *netem.split())
                return f"netem {netem} on both ends"
            why = f"netem unavailable ({tried.stderr.strip()}: the kernel lacks sch_netem); "
        if not rate:
            return why + "no shaping"
        # A queue of a few packets: bursts past the rate overflow it and are dropped.
        for ns, dev in ends:
            run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", rate, "burst", "64kb", "limit", "96kb")
        return why + f"tbf rate {rate}, burst 64 KiB, queue 96 KiB on both ends"

    def counters(self) -> Dict[str, int]:
        """tx/rx bytes of the prefill end of the veth pair."""
        out = run("ip", "-n", self.prefill, "-s", "-j", "link", "show", self.veth[0]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"]}

    def drops(self) -> str:
        lines = []
        for ns, dev in ((self.prefill, self.veth[0]), (self.decode, self.veth[1])):
            shown = run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev,
                        check=False).stdout
            sent = [line.strip() for line in shown.splitlines() if "dropped" in line]
            lines.append(f"{dev}: {sent[0] if sent else shown.strip()[:80]}")
        return "; ".join(lines)

    def close(self) -> None:
        """Kills what still runs in the namespaces and deletes them (the veth pair goes with
        them)."""
        for name in list(self.made):
            pids = run("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", name, check=False)
            self.made.remove(name)


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian: apt-get install iproute2)"
    probe = f"mtpprobe{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


def orchestrate(args: argparse.Namespace) -> int:
    from engine_loopback import skip_or_arm
    from layouts import tools_required

    problem = unavailable()
    if problem:
        if tools_required():
            print(f"FAILED: {problem} (MORI_TP_REQUIRE_TOOLS=1: a missing tool fails)")
            return 1
        print(f"SKIPPED: {problem}")
        return 77
    link = Link(args.prefix)

    def stop(signum: int, _frame: Any) -> None:
        link.close()
        print(f"FAILED: {'timed out' if signum == signal.SIGALRM else 'stopped'} "
              f"(signal {signum}); namespaces removed", flush=True)
        os._exit(124 if signum == signal.SIGALRM else 1)

    status = skip_or_arm(args.engine, TOTAL_TIMEOUT)
    if status is not None:
        return status
    for signum in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        link.open(args.netem, args.rate)
        print(f"{args.engine}: namespaces {link.prefill} ({PREFILL_ADDRESS}) and {link.decode} "
              f"({DECODE_ADDRESS}) joined by veth {'/'.join(link.veth)}; {link.shaping}")
        before = link.counters()
        env = dict(os.environ)
        env.update(UCX_ENV)
        command = ["ip", "netns", "exec", link.prefill, sys.executable, os.path.abspath(__file__),
                   args.engine, "--prefill", "--decode-netns", link.decode]
        try:
            prefill = subprocess.run(command, capture_output=True, text=True, env=env,
                                     timeout=PREFILL_TIMEOUT)
        except subprocess.TimeoutExpired as expired:
            print(f"FAILED: the prefill process ran past {PREFILL_TIMEOUT} s:\n"
                  f"{_text(expired.stdout)}{_text(expired.stderr)[-3000:]}")
            return 1
        lines = [line for line in prefill.stdout.splitlines()]
        print("\n".join(line for line in lines if not line.startswith("{")))
        if prefill.returncode != 0:
            print(f"FAILED: the prefill process exited {prefill.returncode}:\n"
                  f"{prefill.stderr[-3000:]}")
            return 1
        moved = json.loads(next(line for line in lines if line.startswith("{")))
        after = link.counters()
        sent = after["tx_bytes"] - before["tx_bytes"]
        if sent < moved["bytes"]:
            print(f"FAILED: the prefill end of the link sent {sent} bytes, fewer than the "
                  f"{moved['bytes']} the requests moved: they did not cross it")
            return 1
        packets = after["tx_packets"] - before["tx_packets"]
        print(f"  the link carried {sent / 1e6:.1f} MB from prefill to decode ({packets} "
              f"packets) for {moved['bytes'] / 1e6:.1f} MB of requests; {link.drops()}")
        print(f"{args.engine}: two hosts passed")
        return 0
    finally:
        signal.alarm(0)
        link.close()
        left = [name for name in run("ip", "netns", "list", check=False).stdout.split()
                if name.startswith(args.prefix)]
        if left:
            print(f"FAILED: namespaces {left} were left behind")
            return 1


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def prefill_side(args: argparse.Namespace) -> int:
    """Inside the prefill namespace: engine_streaming.py's cases with the decode child in the
    other namespace, then one large request; prints a JSON line of the bytes moved."""
    from engine_loopback import skip_or_arm
    from engine_streaming import Failure, Run
    from mori_tp.engines.loopback import Placement, _die_with_parent

    _die_with_parent(os.getppid())
    status = skip_or_arm(args.engine, PREFILL_TIMEOUT - 10)
    if status is not None:
        return status
    placement = Placement(hostname=DECODE_ADDRESS, netns=args.decode_netns, env=UCX_ENV)
    start = time.monotonic()
    run_ = Run(args.engine, hostname=PREFILL_ADDRESS, placement=placement)
    try:
        moved = run_.pipelined()
        run_.streamed()
        run_.in_flight()
        run_.violations()
        large = large_request(run_)
    except Failure as failure:
        print(f"FAILED: {failure}")
        return 1
    finally:
        run_.close()
    print(f"  {moved} pipelined requests, the streamed, in-flight and violation cases and "
          f"{large['bytes'] >> 20} MiB in {large['seconds'] * 1000:.0f} ms across the link in "
          f"{time.monotonic() - start:.1f} s")
    print(json.dumps({"bytes": large["bytes"]}))
    return 0


def large_request(run_: Any) -> Dict[str, Any]:
    """One request of 6 buffers x 4 MiB, pipelined with BOTH staging, to one decode rank of its
    own child (the cases' child holds small buffers), checked byte for byte."""
    import numpy as np

    import mori_tp
    from engine_streaming import Failure
    from mori_tp import Staging
    from mori_tp.engines import KvMemory, Streamer, plan_request
    from mori_tp.engines.loopback import StreamPeer, digest, sentinel
    from layouts import Layout, fragmented_request

    layout = Layout(heads=4, p_tp=2, d_tp=2, page_size=16, bytes_per_head=512)
    request = fragmented_request(7, 120)
    config = layout.config(0, 0)
    src_capacity = request.src_capacity_pages * layout.src_item_len
    dst_capacity = request.dst_capacity_pages * layout.dst_item_len
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, src_capacity, dtype=np.uint8) for _ in range(6)]
    need = 6 * mori_tp.staging_len(config, len(request.src_pages))
    slot_bytes = -(-need // (1 << 16)) * (1 << 16)
    pool = mori_tp.StagingPool(slot_bytes)
    transport = run_.transport
    local = transport.register(KvMemory(tuple(int(b.ctypes.data) for b in src), src_capacity))
    transport.register(KvMemory((), 0, pool.address, pool.capacity))
    peer = StreamPeer(run_.engine, [(6, dst_capacity)], slot_bytes, 60.0,
                      placement=run_.peer_placement)
    try:
        remote_handle = run_.driver.connect(transport, peer.address, peer.epoch)
        peer.connect(run_.driver.sender(transport))
        slot_address, token = peer.expect("large", 0, config, request.dst_pages,
                                          int(Staging.BOTH), need)
        slot = pool.alloc(need)
        plan = plan_request(config, request.src_pages, request.dst_pages,
                            local=KvMemory(local.buffers, src_capacity, slot.address, slot.size,
                                           local.epoch),
                            remote=KvMemory(peer.memories[0].buffers, dst_capacity,
                                            slot_address, need, peer.epoch),
                            staging=Staging.BOTH)
        with Streamer(transport, timeout=60.0) as streamer:
            start = time.monotonic()
            streamer.send(remote_handle, plan, "large", release=lambda: pool.free(slot),
                          token=token)
            report = peer.ended("large")
        seconds = report.finished_at - start
        if report.error:
            raise Failure(f"the large request failed on the decode side: {report.error}")
        want = [sentinel(0, b, dst_capacity) for b in range(6)]
        mori_tp.send_kvcache(config, [int(b.ctypes.data) for b in src],
                             [int(w.ctypes.data) for w in want], src_capacity=src_capacity,
                             dst_capacity=dst_capacity, src_pages=request.src_pages,
                             dst_pages=request.dst_pages, backend="host")
        if peer.digests()[0] != [digest(w) for w in want]:
            raise Failure("the large request's decode buffers differ from send_kvcache's result")
    finally:
        peer.close()
    return {"bytes": plan.bytes, "seconds": seconds}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("mooncake", "nixl"))
    parser.add_argument("--prefix", default=f"mtp{os.getpid() % 100000}",
                        help="names of the namespaces and veth devices (at most 12 characters)")
    parser.add_argument("--netem", default="delay 2ms loss 0.2%",
                        help="tc netem arguments for both ends ('' for none)")
    parser.add_argument("--rate", default="2gbit",
                        help="tbf rate where netem is unavailable ('' for none)")
    parser.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-netns", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if len(args.prefix) > 12:
        parser.error(f"--prefix {args.prefix!r} is longer than 12 characters")
    return prefill_side(args) if args.prefill else orchestrate(args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mori_tp.engines.loopback import run_program

    run_program(lambda: main(sys.argv[1:]))
