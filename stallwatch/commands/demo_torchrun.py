"""`stallwatch demo --pipeline torchrun`: SpecForge's shape, beside the HTTP pipeline.

SpecForge's `prepare_hidden_states.py` runs SGLang inside each torchrun rank (docs/specforge.md);
here `python -m torch.distributed.run --nproc_per_node 3 stallwatch/commands/specforge_job.py` stands in
for it on the CPU (gloo), as a supervised job of the real daemon with the default rules and no
server. Faults: `hang` (rank 1's writer deadlocks half-way through a file; ranks 0 and 2 finish
their bars and wait at the barrier) and `crash` (rank 2 raises; torchrun stops the others). The
daemon names the rank, kills the whole tree, quarantines the half-written file and restarts the
command, which skips every file that exists and completes. Needs torch and tqdm (the `test`
extra); without them the demo says so and exits 3.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from stallwatch.commands import demo as base

NPROC = 3
BATCH = 4
FAULT_BATCH = 2  # rank 1's third batch: 8 of its samples are out, the 9th half-written
FAULT_RANK = {"hang": 1, "crash": 2}
HOOK = {"hang": "deadlock", "crash": "crash"}


class TorchrunDemo(base.Demo):
    JOB_WORDS = f"torchrun with {NPROC} ranks (gloo, CPU), SpecForge's shape"
    WHO = "the torchrun agent"
    RESUME_WORDS = ("the same command: like SpecForge it skips every sample whose file exists "
                    "(the half-written one was moved aside) and carries on")

    def __init__(self, fault: str = "hang", **kw: Any) -> None:
        if fault not in HOOK:
            from stallwatch.errors import UsageError

            raise UsageError(f"--pipeline torchrun --fault {fault}: expected hang or crash")
        kw.setdefault("num_samples", 60)
        super().__init__(fault, **kw)

    def _start_server(self) -> None:
        missing = [m for m in ("torch", "tqdm") if importlib.util.find_spec(m) is None]
        if missing:
            raise base.DemoUnavailable(f"--pipeline torchrun needs {' and '.join(missing)} "
                                       "(pip install 'stallwatch[test]')")
        self.say("server", "no server: each torchrun rank runs the model itself, as SpecForge's "
                           "prepare_hidden_states.py runs SGLang in-process")

    def _client_argv(self) -> list[str]:
        job = Path(__file__).with_name("specforge_job.py")
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NPROC),
                str(job), "--output-path", str(self.out), "--num-samples", str(self.n),
                "--batch-size", str(BATCH), "--batch-s", "0.4", "--fault", HOOK[self.fault],
                "--fault-rank", str(FAULT_RANK[self.fault]), "--fault-batch", str(FAULT_BATCH)]

    def _fault_words(self) -> str:
        r = FAULT_RANK[self.fault]
        if self.fault == "hang":
            return (f"rank {r}'s writer deadlocks half-way through a file at its batch "
                    f"{FAULT_BATCH + 1} (the job's --fault deadlock hook)")
        return f"rank {r} raises at its batch {FAULT_BATCH + 1} (--fault crash)"

    def _read_progress(self) -> tuple[int, int] | None:
        done = sum(1 for _ in self.out.glob("rows_*/data_*.ckpt")) if self.out.exists() else 0
        return done, self.n

    def _fault_marker(self) -> Path:
        return self.out / f".specforge_job_fault_{HOOK[self.fault]}_rank{FAULT_RANK[self.fault]}"

    def _expected_outputs(self) -> set[Path]:
        group = 2000
        return {self.out / f"rows_{i // group * group}-{i // group * group + group}" / f"data_{i}.ckpt"
                for i in range(self.n)}

    def _hook_fault_marker(self) -> None:
        if self.fault_wall is not None:
            return
        try:
            st = self._fault_marker().stat()
        except OSError:
            return
        self.fault_wall = st.st_mtime
        r = FAULT_RANK[self.fault]
        self.fault_how = f"--fault {HOOK[self.fault]} --fault-rank {r} --fault-batch {FAULT_BATCH}"
        if self.fault == "hang":
            self.say("fault", f"rank {r}'s writer deadlocks half-way through a file: half of it is "
                              "on disk at its final path; the rank's main thread and its writer wait "
                              "on each other's lock, forever. The other ranks finish their bars and "
                              "wait for it at the final barrier (for --dist-timeout: 2000 minutes "
                              "in SpecForge)")
        else:
            self.say("fault", f"rank {r} raises RuntimeError and exits 1; torchrun stops the "
                              "other ranks and exits 1 with its failure summary")
