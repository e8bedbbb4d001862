"""Base for frozen records: snapshots and everything inside them are immutable data."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    # extra="ignore" lets a newer trace replay on an older stallwatch: unknown fields are dropped.
    model_config = ConfigDict(frozen=True, extra="ignore")
