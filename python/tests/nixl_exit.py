"""Processes that hold a NIXL agent where the system's rdma-core is installed, for the exit-status
tests in tests/python.rs. nixl-cu12 1.5.1's UCX EFA module loads the system libefa.so.1, and
with it the system libnl, whose destructors then crash at exit (see mori_tp.engines.nixl)::

    python3 python/tests/nixl_exit.py probe
        0 when NIXL imports and the system has libefa.so.1; 77 and why not otherwise.
    python3 python/tests/nixl_exit.py adapter
        creates an agent with NixlTransport.start and returns normally: status 0, or 139
        (SIGSEGV) if the exit crash is back.
    python3 python/tests/nixl_exit.py unprotected [STATUS]
        creates an agent with nixl_agent itself (no preload: the crash is armed) and ends with
        exit_process(STATUS), or returns normally without STATUS.

Each prints the rdma-core libraries loaded in the process.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import List

from mori_tp.engines import nixl
from mori_tp.engines.loopback import engine_available

SKIPPED = 77
SYSTEM_LIBEFA = "libefa.so.1"


def rdma_libraries() -> List[str]:
    """The libefa, libibverbs and libnl files mapped in this process, each once."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/" in line}
    keys = ("libefa", "libibverbs", "libnl-")
    return sorted(p for p in paths if os.path.basename(p).startswith(keys))


def report(what: str) -> None:
    print(f"{what}; loaded:", *rdma_libraries(), sep="\n  ", flush=True)


def probe() -> int:
    problem = engine_available("nixl")
    if problem:
        print(problem)
        return SKIPPED
    try:
        ctypes.CDLL(SYSTEM_LIBEFA)
    except OSError as error:
        print(f"the system has no {SYSTEM_LIBEFA} ({error}; Debian: apt-get install "
              "ibverbs-providers), so NIXL's UCX does not load the libraries that crash at exit")
        return SKIPPED
    return 0


def main(args: List[str]) -> int:
    mode = args[0] if args else ""
    if mode == "probe" and len(args) == 1:
        return probe()
    if mode == "adapter" and len(args) == 1:
        nixl.NixlTransport.start(f"exit-adapter-{os.getpid()}")
        report("NixlTransport.start made an agent")
        if not any(os.path.basename(p).startswith(SYSTEM_LIBEFA) for p in rdma_libraries()):
            print(f"FAILED: NIXL's UCX did not load the system {SYSTEM_LIBEFA}: this process "
                  "does not have the libraries whose exit crashes")
            return 3
        return 0
    if mode == "unprotected" and len(args) in (1, 2):
        nixl_agent, nixl_agent_config = nixl._import_agent()
        agent = nixl_agent(f"exit-unprotected-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        report(f"nixl_agent made {agent.name!r} without preload_system_libnl")
        if len(args) == 2:
            nixl.exit_process(int(args[1]))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    # A plain exit on purpose: the exit status is what these tests check.
    sys.exit(main(sys.argv[1:]))
