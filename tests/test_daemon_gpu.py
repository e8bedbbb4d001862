"""The resume waits for the GPU memory of the killed job: a real GPU, a job holding 1 GiB that
deadlocks. Skipped (with the reason) without a GPU, NVML or torch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from daemonkit import Harness, fast_rules

JOB = r"""
import os, sys, threading, time
import torch
marker, n = sys.argv[1], int(sys.argv[2])
hold = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print(f"holding 1 GiB on the GPU as pid {os.getpid()}", file=sys.stderr, flush=True)
for i in range(n):
    time.sleep(0.1)
    print(f"step {i + 1}/{n}", file=sys.stderr, flush=True)
    if i == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        a, b = threading.Lock(), threading.Lock()
        met = threading.Barrier(2)
        def grab(x, y):
            with x:
                met.wait()
                with y:
                    pass
        ts = [threading.Thread(target=grab, args=p) for p in ((a, b), (b, a))]
        [t.start() for t in ts]
        [t.join() for t in ts]
"""


def gpu_or_skip() -> None:
    try:
        import torch  # noqa: F401 - whether it imports is the question
    except ImportError:
        pytest.skip("torch is not installed")
    from stallwatch.probes.gpu import GpuProbe

    obs = GpuProbe().collect()
    if obs.status != "ok" or not obs.devices:
        pytest.skip(f"no GPU through NVML ({obs.status}: {obs.error})")


@pytest.mark.slow
def test_resume_waits_for_the_gpu_memory_of_the_killed_job(tmp_path: Path) -> None:
    gpu_or_skip()
    h = Harness(tmp_path)
    script = tmp_path / "gpu_job.py"
    script.write_text(JOB)
    try:
        cmd = [sys.executable, str(script), str(tmp_path / "fault-fired"), "20"]
        h.write_config([], command=cmd, rules=fast_rules(tmp_path / "rules"),
                       job="max_restarts = 1\nstartup_grace_s = 15")
        h.cfg.write_text(h.cfg.read_text().replace(f'outputs = "{h.out}"\n', ""))  # it writes none
        t0 = time.monotonic()
        daemon = h.start()
        h.wait_phase("finished", 180)
        took = time.monotonic() - t0
        assert h.job()["restarts"] == 1
        inc, = h.incidents()
        assert inc["kind"] == "hang"
        gpu = h.actions("wait_gpu")
        assert gpu and "released" in gpu[-1]["outcome"], gpu
        kill = h.actions("kill")[-1]
        restart = h.actions("restart")[-1]
        assert kill["done_at"] <= gpu[-1]["at"] <= restart["at"]
        print(json.dumps({"took_s": round(took, 1), "kill_done": kill["done_at"],
                          "gpu_released_recorded": gpu[-1]["at"],
                          "gpu_wait_s": round(gpu[-1]["at"] - kill["done_at"], 3),
                          "wait_gpu": gpu[-1]["outcome"]}))
        assert h.stop(daemon) == 0
    finally:
        h.cleanup()
