"""A wide job: RANKS processes, each with THREADS idle threads (a SpecForge node: 8 ranks, each with
a write pool of os.cpu_count() threads, 128 on a GPU node). Nothing happens: the cost of watching
it is the cost of its width.

    python bench/jobs/wide.py [--ranks 8] [--threads 128]
"""

import argparse
import subprocess
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("--ranks", type=int, default=8)
ap.add_argument("--threads", type=int, default=128)
ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
a = ap.parse_args()
if a.rank:
    idle = threading.Event()
    for _ in range(a.threads - 1):  # and the main thread
        threading.Thread(target=idle.wait, daemon=True).start()
    print("ready", flush=True)
    time.sleep(1e9)
ranks = [subprocess.Popen([sys.executable, __file__, "--rank", "--threads", str(a.threads)],
                          stdout=subprocess.PIPE) for _ in range(a.ranks)]
for r in ranks:
    r.stdout.readline()
print("ready", flush=True)
time.sleep(1e9)
