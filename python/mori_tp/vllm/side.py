"""The connector's side channel: one JSON object per line over TCP, request and reply, every call
bounded in time. vLLM's own P/D connectors keep such a channel beside the transfer engine for
their handshake and per-request messages (MoRIIO: a ZMQ socket at ``handshake_port`` and
``notify_port``; NIXL: ``VLLM_NIXL_SIDE_CHANNEL_PORT``); this one needs only the standard
library.

The side channel carries no KV bytes, only addresses, layouts and page lists, and it does not
authenticate its peers: run it on the network that joins the two engines' hosts, as those
connectors' channels are (REFERENCE.md section 21).
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from typing import Any, Callable, Dict, Optional

from mori_tp import InvalidArgumentError

#: The longest line either side reads (a request's page list of 100,000 blocks fits).
MAX_LINE = 4 << 20


class SideServer:
    """Answers each line with ``handler(message)`` (a dict, sent back as one line) on a thread
    per connection, until :meth:`close`. A handler that raises answers
    ``{"ok": false, "error": "..."}``."""

    def __init__(self, host: str, port: int,
                 handler: Callable[[Dict[str, Any]], Dict[str, Any]]) -> None:
        outer = self

        class _Handler(socketserver.StreamRequestHandler):
            timeout = 30.0

            def handle(self) -> None:
                while not outer._closed.is_set():
                    try:
                        line = self.rfile.readline(MAX_LINE + 1)
                    except OSError:
                        return
                    if not line:
                        return
                    try:
                        if len(line) > MAX_LINE:
                            raise InvalidArgumentError(f"a line of more than {MAX_LINE} bytes")
                        reply = handler(json.loads(line))
                    except Exception as error:  # noqa: BLE001 - the peer is told, the server goes on
                        reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
                    try:
                        self.wfile.write(json.dumps(reply).encode() + b"\n")
                        self.wfile.flush()
                    except OSError:
                        return

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._closed = threading.Event()
        self._server = _Server((host, port), _Handler)
        #: The port actually bound (``port`` 0 picks a free one).
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name=f"mori-tp-side:{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


class SideClient:
    """One connection to a :class:`SideServer`, reopened after a failure; :meth:`call` sends one
    message and returns the reply, raising ``ConnectionError`` after ``timeout`` seconds or a
    reply with ``ok`` false."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._sock: Optional[socket.socket] = None
        self._file: Any = None
        self._lock = threading.Lock()

    def call(self, message: Dict[str, Any]) -> Dict[str, Any]:
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.create_connection((self.host, self.port), self.timeout)
                    self._sock.settimeout(self.timeout)
                    self._file = self._sock.makefile("rb")
                self._sock.sendall(json.dumps(message).encode() + b"\n")
                line = self._file.readline(MAX_LINE + 1)
            except OSError as error:
                self.close()
                raise ConnectionError(f"mori_tp.vllm side channel {self.host}:{self.port}: "
                                      f"{message.get('type')} failed: {error}") from error
            if not line:
                self.close()
                raise ConnectionError(f"mori_tp.vllm side channel {self.host}:{self.port}: "
                                      f"closed before answering {message.get('type')}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise ConnectionError(f"mori_tp.vllm side channel {self.host}:{self.port} refused "
                                  f"{message.get('type')}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._file = None
