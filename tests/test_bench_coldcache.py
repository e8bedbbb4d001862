"""bench/coldcache.py: the host's cold-start factor recorded beside every bench run's ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import coldcache  # noqa: E402


def test_measure_reports_hot_and_cold_medians_and_their_ratio():
    got = coldcache.measure(samples=1)
    assert got["hot_us"] > 0 and got["after_1s_us"] > 0 and got["after_0.1s_us"] > 0
    assert got["factor_1s"] == round(got["after_1s_us"] / got["hot_us"], 1)
    assert got["page_hot_us"] > 0 and got["page_after_1s_us"] > 0 and got["pages"] == 256
    assert got["page_faults_after_1s"] >= 0


def test_pages_written_before_the_sleep_take_no_guest_fault_when_written_again():
    # the buffer is resident for the guest: a fault here would be Linux's, and the page cost
    # the report blames on the host would not be the host's
    buf = bytearray(b"\1" * (64 * 4096))
    coldcache._pages_after(0, buf)
    us, faults = coldcache._pages_after(0.05, buf)
    assert faults == 0 and us > 0


def test_command_prints_one_json_document():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "coldcache.py"), "--samples", "1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert set(json.loads(out)) >= {"hot_us", "after_1s_us", "factor_1s"}
