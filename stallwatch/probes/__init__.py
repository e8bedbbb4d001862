"""Probes: each owns one source and returns frozen data. Expected absence is a value."""
