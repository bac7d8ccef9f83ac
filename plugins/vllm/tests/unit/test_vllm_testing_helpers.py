"""The test helper that runs vLLM servers: a port taken before the server binds it is survived."""

from __future__ import annotations

import socket
import sys
import urllib.request
from pathlib import Path

from mooncake_vllm.testing import VLLMServer

# Stands in for the API server's last step only: bind --port and answer /health (a real
# vLLM takes a minute to get there; what is tested is the helper's restart, not vLLM).
_SERVE = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
try:
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
except OSError as exc:
    print(f"OSError: [Errno {exc.errno}] {exc.strerror}", flush=True)
    sys.exit(1)
srv.serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_gets_a_restart_on_a_new_port(
    tmp_path: Path,
) -> None:
    server = VLLMServer(tmp_path, log_path=tmp_path / "server.log")
    server.cmd = [sys.executable, "-c", _SERVE, "--port", str(server.port)]
    taken = socket.socket()
    taken.bind(("127.0.0.1", server.port))  # another process got there first
    taken.listen()
    first = server.port
    try:
        server.start().wait_ready(30)
        assert server.port != first and server.url.endswith(f":{server.port}")
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            assert r.read() == b"ok"
    finally:
        server.stop()
        taken.close()
