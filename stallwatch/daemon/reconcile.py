"""Start-up: finish the intents a killed daemon left pending (stallwatch.daemon.state)."""

from __future__ import annotations

import json
import logging
from typing import Any

from stallwatch.daemon.supervise import find_wrapper, proc_state, read_status, status_authentic

log = logging.getLogger("stallwatch.daemon")


def reconcile_intents(db, job: str, *, settle_s: float = 5.0, clock=None) -> list[str]:
    """Finish the intents a killed daemon left `pending`, from what exists now. Returns notes.

    start/restart: the spawn happened if its status file exists or a wrapper naming that file
    is alive — then the run is recorded and (for a restart) counted, once, here; otherwise it
    never happened and nothing is counted (the recovery, resumed, will do it). A spawn younger
    than `settle_s` is given that long to show itself first (a wrapper between fork and exec
    does not yet carry its command line). Other intents (kill, validate, evidence) are marked
    interrupted: the resumed recovery redoes them, identity-checked.
    """
    import time as _time

    clock = clock or _time
    notes: list[str] = []
    for a in db.pending_actions(job):
        if a["what"] in ("start", "restart"):
            try:
                d = json.loads(a["detail"] or "{}")
            except ValueError:
                d = {}
            sf = d.get("status_file")
            doc = read_status(sf)
            if doc is not None and status_authentic(doc, sf):
                doc = None  # forged or not provably the wrapper's: as if absent
            wrapper = find_wrapper(sf) if (doc is None and sf) else None
            if doc is None and wrapper is None and sf:
                age = clock.time() - a["at"]
                if age < settle_s:
                    _time.sleep(settle_s - age)
                    doc = read_status(sf)
                    if doc is not None and status_authentic(doc, sf):
                        doc = None
                    wrapper = find_wrapper(sf) if doc is None else None
            if doc is not None or wrapper is not None:
                with db.tx():
                    fields: dict[str, Any] = {"status_file": sf, "started_at": a["at"]}
                    if doc is not None:
                        fields.update(pid=doc.get("pid"), start_ticks=doc.get("start_ticks"),
                                      pgid=doc.get("pgid"), wrapper_pid=doc.get("wrapper_pid"),
                                      wrapper_start_ticks=doc.get("wrapper_start_ticks"))
                    elif wrapper is not None:
                        st = proc_state(wrapper)
                        fields.update(wrapper_pid=wrapper,
                                      wrapper_start_ticks=st[1] if st else None)
                    db.add_run(job, int(d.get("seq") or 0), d.get("how") or "setsid", **fields)
                    db.complete_action(a["id"], f"started run {d.get('seq')} (completed on "
                                                "daemon start-up: the spawn had happened)")
                    upd: dict[str, Any] = {"phase": "starting", "recovery_incident": None}
                    if a["what"] == "restart" and a["attempt"] is not None:
                        row = db.job(job)
                        upd["restarts"] = max(int(row["restarts"]), int(a["attempt"]))
                    db.update_job(job, **upd)
                notes.append(f"{a['what']} {a['id']}: had happened")
                log.info("job %s: a %s the previous daemon began did happen: recorded once",
                         job, a["what"])
            else:
                db.complete_action(a["id"], "not started: the daemon stopped before the spawn "
                                            "(reconciled on start-up; not counted)")
                notes.append(f"{a['what']} {a['id']}: had not happened")
                log.info("job %s: a %s the previous daemon intended never happened: not counted",
                         job, a["what"])
        else:
            db.complete_action(a["id"], "interrupted by a daemon restart")
            notes.append(f"{a['what']} {a['id']}: interrupted")
    return notes
