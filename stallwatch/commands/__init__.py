"""The commands: `stallwatch` (cli), diagnose's rendering, record/replay, run/watch in the
foreground, the one-liner and the demos. The top stage: they compose the others, nothing imports
them back."""
