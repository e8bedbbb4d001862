#!/usr/bin/env python3
"""The SpecForge-shaped torchrun test job: stallwatch/commands/specforge_job.py (shipped with stallwatch so
that `stallwatch demo --pipeline torchrun` can run it). Its docstring has the fault hooks:

    torchrun --nproc_per_node 3 tests/jobs/specforge_job.py --output-path /tmp/hs > job.log 2>&1
"""

import sys

from stallwatch.commands.specforge_job import main

if __name__ == "__main__":
    sys.exit(main())
