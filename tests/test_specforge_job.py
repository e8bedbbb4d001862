"""The SpecForge-shaped test job itself (tests/jobs/specforge_job.py): run under real torchrun
with gloo on CPU, its outputs, log lines and resume are upstream's (docs/upstream.md §2)."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stallwatch.actions.filecheck import validate_file

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]' installs it)")
pytest.importorskip("tqdm", reason="needs tqdm (a test dependency)")

JOB = Path(__file__).parent / "jobs" / "specforge_job.py"


def torchrun(out: Path, log: Path, *extra: str, nproc: int = 3) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           str(JOB), "--output-path", str(out), "--num-samples", "30", "--batch-size", "4",
           "--batch-s", "0.01", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "ab") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=180).returncode


def load(path: Path) -> dict:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.mark.slow
def test_job_writes_upstream_layout_skips_nan_and_resumes(tmp_path: Path) -> None:
    # --compress (data_N.ckpt.gz); plain .ckpt outputs are checked by test_specforge_supervise
    compress = True
    out, log = tmp_path / "hs", tmp_path / "job.log"
    extra = ("--compress",) if compress else ()
    assert torchrun(out, log, "--nan-at", "5", *extra) == 0
    ext = ".ckpt.gz" if compress else ".ckpt"
    files = sorted(out.glob(f"rows_0-2000/data_*{ext}"))
    assert len(files) == 29 and not (out / f"rows_0-2000/data_5{ext}").exists()
    rec = load(files[0])
    check = validate_file(files[0])
    assert check.ok, check.reason
    if compress:  # --compress: gunzip whole, then the zip and CRC checks on what it held
        data = files[0].read_bytes()
        cut, bad = tmp_path / "data_cut.ckpt.gz", tmp_path / "data_bad.ckpt.gz"
        cut.write_bytes(data[: len(data) // 2])
        bad.write_bytes(data[:-12] + bytes(b ^ 0xFF for b in data[-12:-8]) + data[-8:])
        assert "gzip" in check.reason and "zip archive whole" in check.reason
        assert not validate_file(cut).ok and not validate_file(bad).ok
    assert set(rec) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    assert rec["hidden_state"].shape[:2] == (1, rec["input_ids"].shape[0])
    text = log.read_text(errors="replace")
    assert text.count("Generation loop finished. Processed: 10, Skipped: 0") == 3
    assert "Warning: NaN found in hidden_state for" in text and "Skipping save." in text
    assert text.count("All hidden states generated or job finished.") == 3
    assert "\x1b[A" in text and "pending_io=" in text  # bars at positions 1 and 2
    assert (out / "vocab_mapping" / "vocab_mapping.pt").exists()
    # resume: every existing sample skipped, only the NaN one tried again
    log.write_text("")
    assert torchrun(out, log, *extra) == 0
    text = log.read_text(errors="replace")
    assert "Processed: 1, Skipped: 9" in text and text.count("Skipped: 10") == 2
    assert (out / f"rows_0-2000/data_5{ext}").exists()
