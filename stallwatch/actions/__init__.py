"""Actions: the only code in stallwatch with side effects (signals, moved files, bundles).

- `KillOperation`: SIGTERM -> grace -> SIGKILL of a job's processes and process group, an
  explicit state machine the daemon steps every tick; never blocks, verifies every identity.
- `validate_outputs` / `validate_file`: check the outputs written around a failure before a
  resume, and move broken ones to a quarantine folder (never delete, never overwrite).
- `capture_evidence`: an evidence bundle for an incident (thread states, kernel stacks, py-spy
  dumps, log tail, GPU and disk tables), bounded in time and size, never raising.

See docs/actions.md.
"""

from stallwatch.actions.evidence import capture_evidence, find_py_spy
from stallwatch.actions.filecheck import FileCheck, validate_file
from stallwatch.actions.kill import (KillOperation, KillReport, KillState, KillTransition,
                                     Refusal, SignalRecord, Survivor)
from stallwatch.actions.quarantine import quarantine_file
from stallwatch.actions.validate import (DEFAULT_PATTERNS, Quarantined, Skipped, ValidationReport,
                                         validate_outputs)

__all__ = [
    "DEFAULT_PATTERNS", "FileCheck", "KillOperation", "KillReport", "KillState", "KillTransition",
    "Quarantined", "Refusal", "SignalRecord", "Skipped", "Survivor", "ValidationReport",
    "capture_evidence", "find_py_spy", "quarantine_file", "validate_file", "validate_outputs",
]
