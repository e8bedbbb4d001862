"""Zero-config discovery never invents a server (issue 14).

A live torchrun job (3 ranks, gloo on CPU: each rank listens on ports and holds connections to
its siblings) is seen through an injected NVML view in which every rank holds GPU memory, as on
a GPU host. Discovery must make it one job — the torchrun agent — and name no server. A process
that listens with a client connected becomes a server only on positive evidence: a JSON answer
from /model_info or /get_model_info.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]' installs it)")
pytest.importorskip("tqdm", reason="needs tqdm (a test dependency)")

from stallwatch.probes.discover import _answers_model_info, find_pipeline
from stallwatch.probes.gpu import GpuDeviceObs, GpuObs, GpuProcessObs
from stallwatch.probes.targets import Target
from rigs import wait_until
from torchrunkit import children, kill_tree, torchrun

pytestmark = pytest.mark.slow


class FakeGpu:
    """An NVML view: one H200 whose memory the given pids hold."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def collect(self) -> GpuObs:
        procs = [GpuProcessObs(pid=p, gpu_index=0, kind="compute", used_bytes=5 << 30)
                 for p in self.pids]
        return GpuObs(status="ok", device_count=1, devices=[GpuDeviceObs(
            index=0, name="NVIDIA H200", mem_total_bytes=141 << 30, mem_used_bytes=15 << 30,
            util_gpu_pct=0, processes=procs)], collected_at=time.time())


def test_torchrun_ranks_holding_gpu_memory_are_one_job_not_a_server(tmp_path: Path) -> None:
    out, log = tmp_path / "hs", tmp_path / "job.log"
    job = torchrun(out, log, "--fault", "deadlock", "--fault-rank", "1", "--fault-batch", "2")
    kids: list[int] = []
    try:
        kids = wait_until(lambda: (k := children(job.pid)) and len(k) >= 3 and k, 120, "3 workers")
        wait_until(lambda: list(out.glob(".specforge_job_fault_*")), 120, "the fault")
        d = find_pipeline(Target(), FakeGpu(kids))
    finally:
        kill_tree(job, kids)
    notes = "\n".join(d.notes)
    assert d.server_url is None and d.target.server is None, notes
    assert d.target.pids == (job.pid,), notes
    assert f"torchrun job: agent pid {job.pid}" in notes
    for rank, pid in enumerate(kids):
        assert f"rank {rank} pid {pid}" in notes
    assert d.target.log == log and d.target.outputs == out, notes


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a) -> None:
        pass


@pytest.mark.parametrize("body,server", [
    (json.dumps({"model_path": "Qwen/Qwen3-8B", "is_generation": True}).encode(), True),
    (b"<html>not sglang</html>", False),
    (b"[1, 2, 3]", False),
])
def test_a_port_is_a_server_only_when_model_info_answers_json(body: bytes, server: bool) -> None:
    handler = type("H", (_Handler,), {"body": body})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        assert _answers_model_info(f"http://127.0.0.1:{httpd.server_port}", 2.0) is server
    finally:
        httpd.shutdown()
    # nothing listening: no answer, no server
    assert not _answers_model_info(f"http://127.0.0.1:{httpd.server_port}", 0.5)
    # never beyond loopback
    assert not _answers_model_info("http://10.0.0.1:30000", 0.5)
