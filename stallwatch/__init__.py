"""stallwatch: a watchdog for long GPU pipelines."""

__version__ = "0.1.0"
