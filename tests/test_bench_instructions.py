"""bench/instructions.py: instructions per tick under callgrind, and its skip without valgrind."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import instructions  # noqa: E402


def test_without_valgrind_the_section_says_why_and_measures_nothing(monkeypatch):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    got = instructions.run(window_s=1, warmup_ticks=1)
    assert got == {"skipped": "valgrind (callgrind) is not installed: instructions not counted"}


def test_the_dump_read_is_the_one_written_after_the_window(tmp_path):
    # callgrind names dumps PREFIX.PID (at exit) and PREFIX.PID.N (each callgrind_control -d);
    # the window's count is in the file that was not there before the dump was asked for
    prefix = tmp_path / "cg-x"
    old = tmp_path / "cg-x.41"
    old.write_bytes(b"version: 1\ncreator: callgrind\nevents: Ir\nsummary: 999\n")
    new = tmp_path / "cg-x.41.1"
    new.write_bytes(b"version: 1\ncreator: callgrind\nevents: Ir\npart: 1\n\nfn=x\n3 5\ntotals: 7296614\n")
    assert instructions._ir_dumped(prefix, {old}) == 7296614
    assert instructions._ir_dumped(prefix, {old, new}) is None
