"""A request's KV moved between two processes on 127.0.0.1 through MoriTpConnector's
worker-side methods and a real engine, byte for byte: this process is the prefill engine (one
connector per TP rank, made by vLLM's factory, KV caches allocated by vLLM's
``allocate_kv_cache``), a child process the decode engine. Each step is what vLLM's model
runner does: ``bind_connector_metadata``, ``start_load_kv``, ``save_kv_layer`` per layer,
``wait_for_save``, ``clear_connector_metadata``, then ``get_transfer_results``.

Every byte of every decode rank is checked: each moved (token, head) holds the prefill's bytes
of that global head (replicas of a head hold the same bytes, as a model's replicated heads do),
every other byte its sentinel. Cases: TP 2 -> 4 (prefill token-major LBNHC, decode head-major
LBHNC), TP 4 -> 2, TP 4 -> 2 with 2 KV heads (prefill ranks 1 and 3 are replicas: they send
nothing and report the request done), TP 2 -> 2 with 16- and 32-token blocks, and TP 1 -> 1
where the decode engine asks only after the prefill's forward pass (the request is sent whole
later).

    <venv>/bin/python python/tests/vllm/vllm_transfer.py mooncake|nixl

Exit status: 0 passed, 1 failed, 77 skipped (no vLLM or no engine here).
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_common import SKIPPED, kv_cache_config, model_dir, require_vllm, vllm_config  # noqa

STEP_TIMEOUT = 60.0
#: Below the 600 s tests/vllm.rs gives the script, so that a hang is reported here.
TOTAL_TIMEOUT = 540
SENTINEL = 0xEE

#: (name, heads, P, D, prefill layout, decode layout, prefill block, decode block, deferred)
CASES = [
    ("tp2to4", 4, 2, 4, "LBNHC", "LBHNC", 16, 16, False),
    ("tp4to2", 4, 4, 2, "LBHNC", "LBNHC", 16, 16, False),
    ("replicas-h2-tp4to2", 2, 4, 2, "LBNHC", "LBNHC", 16, 16, False),
    ("blocks16to32-tp2", 4, 2, 2, "LBNHC", "LBNHC", 16, 32, False),
    ("deferred-tp1", 4, 1, 1, "LBHNC", "LBHNC", 16, 16, True),
]
NUM_TOKENS = 40
#: Connectors of finished cases, kept alive until the process exits.
RETIRED: List[Any] = []


def owned(heads: int, tp: int, rank: int) -> List[int]:
    """Global KV heads of a rank: vLLM's split (``max(1, H // T)`` per rank, replicated when
    T > H)."""
    if tp <= heads:
        per = heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * heads // tp]


def pattern(layer: int, head: int, token: int, nbytes: int) -> Any:
    import numpy as np

    c = np.arange(nbytes, dtype=np.uint32)
    return ((c * 3 + token * 7 + head * 17 + layer * 131 + 1) % 251).astype(np.uint8)


def byte_view(view: Any) -> Any:
    """A layer's [B, H, N, C] view as bytes [B, H, N, C * element size] (numpy, shared)."""
    import torch

    return view.view(torch.uint8).numpy()


def blocks_of(tokens: int, block: int, first: int, step: int, total: int) -> List[int]:
    """A request's block table: scattered, not in order."""
    count = -(-tokens // block)
    return [(first + i * step) % total for i in range(count)]


# --- the decode child ---------------------------------------------------------------------


def decode_main(parent: int) -> None:
    """The decode engine of one case (``setup`` makes its connectors)."""
    from mori_tp.engines.loopback import _die_with_parent
    from mori_tp.vllm.connector import MoriTpMetadata, RecvSpec
    from vllm_common import worker

    _die_with_parent(parent)
    signal.alarm(TOTAL_TIMEOUT)
    # A hang shows its threads' stacks in the parent's report before the parent gives up.
    faulthandler.dump_traceback_later(STEP_TIMEOUT - 5, repeat=True)
    workers: List[Tuple[Any, Dict[str, Any]]] = []
    retired: List[Tuple[Any, Dict[str, Any]]] = []
    args: Dict[str, Any] = {}
    say({"started": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "setup":
            for connector, _ in workers:
                connector.shutdown()
            # Kept until the process exits: a Mooncake engine destroyed by the garbage
            # collector while another starts can hang the new one.
            retired.extend(workers)
            workers = []
            args = command["args"]
            model = model_dir(num_kv_heads=args["heads"])
            for rank in range(args["D"]):
                config = vllm_config("kv_consumer", engine=args["engine"], tp_size=args["D"],
                                     tp_rank=rank, block_size=args["block"],
                                     layout=args["layout"], model=model,
                                     engine_id=f"decode-{args['case']}", timeout=STEP_TIMEOUT)
                kv_config = kv_cache_config(config, args["num_blocks"])
                connector, caches = worker(config, kv_config)
                for view in caches.values():
                    byte_view(view)[...] = SENTINEL
                workers.append((connector, caches))
            say({"ready": True})
        elif command["do"] == "expect":
            spec = RecvSpec(command["transfer_id"], command["blocks"], NUM_TOKENS, 0,
                            "127.0.0.1", command["port"], args["P"])
            for connector, _ in workers:
                connector.bind_connector_metadata(MoriTpMetadata(reqs_to_recv={"r": spec}))
                connector.start_load_kv(None)
                connector.wait_for_save()
                connector.clear_connector_metadata()
            say({"expecting": True})
        elif command["do"] == "finish":
            results = []
            for rank, (connector, caches) in enumerate(workers):
                deadline = time.monotonic() + STEP_TIMEOUT
                done, failed = False, False
                while time.monotonic() < deadline and not done:
                    result = connector.get_transfer_results(set())
                    done = "r" in result.finished_recving
                    failed = failed or "r" in result.failed_recving
                    time.sleep(0.005)
                results.append({"rank": rank, "done": done, "failed": failed,
                                "wrong": check_decode(args, rank, caches, command["blocks"])})
            say({"results": results})
        elif command["do"] == "stop":
            for connector, _ in workers:
                connector.shutdown()
            say({"stopped": True})
            return


def check_decode(args: Dict[str, Any], rank: int, caches: Dict[str, Any],
                 blocks: List[int]) -> List[str]:
    """What is wrong on decode rank ``rank``: moved bytes that differ from the pattern, other
    bytes that changed (at most a few, in words)."""
    import numpy as np

    wrong: List[str] = []
    heads = owned(args["heads"], args["D"], rank)
    block = args["block"]
    for layer, view in enumerate(caches.values()):
        data = byte_view(view)
        expected = np.full(data.shape, SENTINEL, dtype=np.uint8)
        for token in range(NUM_TOKENS):
            b, slot = blocks[token // block], token % block
            for j, head in enumerate(heads):
                expected[b, j, slot, :] = pattern(layer, head, token, data.shape[3])
        diff = np.argwhere(data != expected)
        if len(diff):
            b, j, slot, c = (int(x) for x in diff[0])
            wrong.append(f"layer {layer}: {len(diff)} bytes differ, first at block {b} head "
                         f"{j} slot {slot} byte {c}: {data[b, j, slot, c]} != "
                         f"{expected[b, j, slot, c]}")
    return wrong


def say(message: Dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(message) + "\n")
    sys.stdout.flush()


# --- the prefill parent ------------------------------------------------------------------------


class Child:
    def __init__(self, engine: str) -> None:
        env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "decode", engine, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            text=True)
        self.log: List[str] = []

    def read(self, key: str, timeout: float = STEP_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if not ready:
                continue
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the decode child exited ({self.process.poll()}) waiting "
                                     f"for {key}:\n" + "".join(self.log[-60:]))
            if line.startswith("@@"):
                message = json.loads(line[2:])
                if key in message:
                    return message[key]
            else:
                self.log.append(line)
        raise AssertionError(f"the decode child sent no {key} in time:\n"
                             + "".join(self.log[-60:]))

    def send(self, message: Dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        try:
            self.send({"do": "stop"})
            self.read("stopped")
        except Exception:  # noqa: BLE001 - killed below if it does not stop
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def free_port_base(count: int) -> int:
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65536:
            continue
        try:
            sockets = []
            for port in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            for s in sockets:
                s.close()
            return base
        except OSError:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


def run_case(engine: str, case: Tuple[Any, ...]) -> None:
    from mori_tp import Action
    from mori_tp.vllm.connector import MoriTpMetadata, SendSpec
    from vllm_common import worker

    name, heads, P, D, p_layout, d_layout, p_block, d_block, deferred = case
    num_blocks = 12
    base = free_port_base(P)
    model = model_dir(num_kv_heads=heads)
    src_blocks = blocks_of(NUM_TOKENS, p_block, 5, 5, num_blocks)
    dst_blocks = blocks_of(NUM_TOKENS, d_block, 7, 3, num_blocks)
    prefill = []
    for rank in range(P):
        config = vllm_config("kv_producer", engine=engine, tp_size=P, tp_rank=rank,
                             block_size=p_block, layout=p_layout, model=model, side_port=base,
                             engine_id="prefill", timeout=STEP_TIMEOUT)
        kv_config = kv_cache_config(config, num_blocks)
        connector, caches = worker(config, kv_config)
        import numpy as np

        rng = np.random.default_rng(rank)
        for layer, view in enumerate(caches.values()):
            data = byte_view(view)
            data[...] = rng.integers(0, 256, data.shape, dtype=np.uint8)
            for token in range(NUM_TOKENS):
                b, slot = src_blocks[token // p_block], token % p_block
                for j, head in enumerate(owned(heads, P, rank)):
                    data[b, j, slot, :] = pattern(layer, head, token, data.shape[3])
        prefill.append((connector, caches))
    # A decode process per case: one that made Mooncake engines for an earlier case hung,
    # now and then, making the next case's (faulthandler then shows where).
    child = Child(engine)
    try:
        # Importing vLLM and torch takes a while on a busy host.
        child.read("started", timeout=STEP_TIMEOUT * 3)
        child.send({"do": "setup", "args": {"engine": engine, "heads": heads, "P": P, "D": D,
                                            "layout": d_layout, "block": d_block,
                                            "num_blocks": num_blocks, "case": name}})
        child.read("ready")
        expect = {"do": "expect", "transfer_id": f"{name}-1", "blocks": dst_blocks, "port": base}
        if not deferred:
            child.send(expect)
            child.read("expecting")
        spec = SendSpec(f"{name}-1", src_blocks, NUM_TOKENS)
        for connector, caches in prefill:
            connector.bind_connector_metadata(MoriTpMetadata(reqs_to_send={"r": spec}))
            connector.start_load_kv(None)
            for layer, view in caches.items():
                connector.save_kv_layer(layer, view, None)
            connector.wait_for_save()
            connector.clear_connector_metadata()
        if deferred:
            # The decode side asks after the forward pass: nothing could be written yet.
            for connector, _ in prefill:
                result = connector.get_transfer_results(set())
                assert "r" not in result.finished_sending, "finished before the decode asked"
            child.send(expect)
            child.read("expecting")
        for rank, (connector, _) in enumerate(prefill):
            deadline = time.monotonic() + STEP_TIMEOUT
            while True:
                if "r" in connector.get_transfer_results(set()).finished_sending:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name}: prefill rank {rank} never finished sending")
                time.sleep(0.005)
        child.send({"do": "finish", "blocks": dst_blocks})
        results = child.read("results")
        for result in results:
            assert result["done"] and not result["failed"], f"{name}: decode {result}"
            assert not result["wrong"], f"{name}: decode rank {result['rank']}: {result['wrong']}"
        # Who sent: a rank with no SEND pair (a replica) moved nothing.
        import mori_tp

        for rank, (connector, _) in enumerate(prefill):
            w = connector.worker
            # The decode ranks' layouts as their handshakes described them.
            peers = [w._peers[(f"decode-{name}", d)].layout for d in range(D)]
            actions = [mori_tp.pair_config(w.layout, layout).action for layout in peers]
            sends = actions.count(Action.SEND)
            assert w.sent_streams == sends, f"{name}: rank {rank} opened {w.sent_streams} " \
                f"streams, {sends} pairs send ({[a.name for a in actions]})"
            assert (w.sent_bytes > 0) == (sends > 0), f"{name}: rank {rank} sent {w.sent_bytes}"
        replicas = [r for r in range(P) if prefill[r][0].worker.sent_streams == 0]
        print(f"ok: {engine} {name}: every byte of {D} decode ranks right; sent by prefill "
              f"ranks {[r for r in range(P) if r not in replicas]}"
              + (f", replicas {replicas} sent nothing" if replicas else ""))
    finally:
        child.close()
        for connector, _ in prefill:
            connector.shutdown()
        # Kept until the process exits: a Mooncake engine destroyed by the garbage collector
        # while another starts could hang the new one.
        RETIRED.extend(prefill)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "decode":
        require_vllm()
        decode_main(int(sys.argv[3]))
        return finish(sys.argv[2], 0)
    if len(sys.argv) != 2 or sys.argv[1] not in ("mooncake", "nixl"):
        print(__doc__)
        return 2
    engine = sys.argv[1]
    require_vllm()
    from mori_tp.engines.loopback import engine_available

    missing = engine_available(engine)
    if missing:
        print(f"skipped: {missing}")
        return SKIPPED
    signal.alarm(TOTAL_TIMEOUT)
    failed = 0
    for case in CASES:
        try:
            run_case(engine, case)
        except Exception:  # noqa: BLE001 - reported, the next case runs
            failed += 1
            print(f"FAIL: {engine} {case[0]}")
            traceback.print_exc()
    print(f"{len(CASES) - failed} passed, {failed} failed")
    return finish(engine, 1 if failed else 0)


def finish(engine: str, status: int) -> int:
    """NIXL's agents can crash a process at exit (REFERENCE.md, NIXL): leave through
    mori_tp.engines.nixl.exit_process, which keeps the status."""
    sys.stdout.flush()
    if engine == "nixl":
        from mori_tp.engines.nixl import exit_process

        exit_process(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
