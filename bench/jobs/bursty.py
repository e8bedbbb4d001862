#!/usr/bin/env python3
"""A healthy job with an irregular rhythm, for the false-positive run (bench/detection.py).

Progress comes in bursts (a few to a few dozen items, 20-100 ms apart) separated by quiet gaps
(0.5-4 s, and one gap in ten 8-18 s), and every `--checkpoint-every` seconds it writes a
checkpoint for `--checkpoint-s` seconds: I/O moves, the progress bar does not (the contract's
"90 s of writing a checkpoint").
Each item writes an output file like tests/jobs/extract_like.py (whose bar and writer it uses).

    python bench/jobs/bursty.py --out DIR [--seed 1] [--checkpoint-every 120] [--checkpoint-s 90]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "jobs"))

from extract_like import Bar, output_path, save_checkpoint, save_sample


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--long-gap-max-s", type=float, default=18.0)
    ap.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds between checkpoints")
    ap.add_argument("--checkpoint-s", type=float, default=90.0)
    ap.add_argument("--sample-bytes", type=int, default=16 << 10)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    ckpt = os.path.join(os.path.dirname(os.path.abspath(a.out)), "checkpoints", "state.bin")
    bar = Bar(a.n, "Generating Hidden States")
    next_ckpt = time.monotonic() + a.checkpoint_every
    idx = 0
    while idx < a.n:
        for _ in range(rnd.randint(3, 40)):  # a burst
            time.sleep(rnd.uniform(0.02, 0.1))
            save_sample(output_path(a.out, idx), idx, [[0.0] * 8], a.sample_bytes)
            idx += 1
            bar.update(1, processed=idx)
        # a quiet gap between bursts, now and then a long one
        time.sleep(rnd.uniform(0.5, 4.0) if rnd.random() < 0.9 else rnd.uniform(8.0, a.long_gap_max_s))
        if a.checkpoint_every and time.monotonic() >= next_ckpt:
            save_checkpoint(ckpt, a.checkpoint_s, bar)
            next_ckpt = time.monotonic() + a.checkpoint_every
    bar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
