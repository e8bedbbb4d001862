"""Parsers of the job's own text (progress lines, tqdm bars, timestamps) that the log probe uses.
Not probes: nothing here reads a file or registers itself as a probe."""
