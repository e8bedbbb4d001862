"""SGLang templates: a small server speaking SGLang's HTTP protocol and a reference extraction
client, plus torch.save files without torch. See docs/sglang-templates.md.

- `stallwatch.sglang.protocol_server`: `python -m stallwatch.sglang.protocol_server --port P ...`;
  `launch_server(...)` starts one as a subprocess and returns a `ServerProcess` handle.
- `stallwatch.sglang.extract_client`: `python -m stallwatch.sglang.extract_client --server URL
  --out DIR --num-samples N ...`; `sample_path(out, idx)` is where sample idx goes.
- `stallwatch.sglang.model`: the tiny model (torch when installed, pure Python otherwise).
- `stallwatch.sglang.ptfile`: `save`, `load`, `check`, `Tensor` — torch.save's zip format.

Importing this package imports neither torch nor prometheus_client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallwatch.sglang.ptfile import PtFileError, Tensor, check, load, save

__all__ = ["PtFileError", "Tensor", "check", "load", "save", "launch_server", "ServerProcess",
           "child_processes", "sample_path"]


def __getattr__(name: str):  # lazy: the server module is only needed by those who start one
    if name in ("PtFileError", "Tensor", "check", "load", "save"):
        # lazy too: the daemon imports this package for serverlog and titles, never ptfile
        # (issue 17's RSS)
        from stallwatch.sglang import ptfile

        return getattr(ptfile, name)
    if name in ("launch_server", "ServerProcess", "child_processes"):
        from stallwatch.sglang import protocol_server

        return getattr(protocol_server, name)
    if name == "sample_path":
        from stallwatch.sglang.extract_client import sample_path

        return sample_path
    raise AttributeError(name)
