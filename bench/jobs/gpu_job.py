#!/usr/bin/env python3
"""A healthy GPU job for the overhead figures on a GPU host: the extraction pipeline's shape.

Each step runs bf16 matmuls on every visible GPU for about --step-s seconds (utilisation near
100 %, a few GiB held), copies a slice of the result to the host, writes it as one output file
(`OUT/data_{step}.pt`, torch.save) and prints a `step N/M` progress line.

    python bench/jobs/gpu_job.py --out DIR --log LOG [--step-s 0.2] [--n 100000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--step-s", type=float, default=0.2)
    ap.add_argument("--size", type=int, default=8192)
    a = ap.parse_args()
    import torch

    os.makedirs(a.out, exist_ok=True)
    devs = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    if not devs:
        print("no CUDA device", file=sys.stderr)
        return 2
    mats = [(torch.randn(a.size, a.size, device=d, dtype=torch.bfloat16),
             torch.randn(a.size, a.size, device=d, dtype=torch.bfloat16)) for d in devs]
    log = open(a.log, "a", buffering=1)  # noqa: SIM115 - the job's log, open for the job's life
    for step in range(1, a.n + 1):
        t_end = time.monotonic() + a.step_s
        while time.monotonic() < t_end:
            outs = [x @ y for x, y in mats]
            for d in devs:
                torch.cuda.synchronize(d)
        torch.save(outs[0][:4, :64].float().cpu(), os.path.join(a.out, f"data_{step}.pt"))
        log.write(f"step {step}/{a.n}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
