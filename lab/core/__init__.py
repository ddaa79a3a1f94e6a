"""Contracts every notebook shares: parameters, set-up, progress bars, claim checks and records."""

from lab.core.params import DEVICES, SCALES, ParamError, Params, validate
from lab.core.records import MIMETYPE, ClaimFailed, check, read_records, record, sanity, verdict
from lab.core.results import seed_table
from lab.core.session import progress, seed_everything, setup

__all__ = [
    "DEVICES", "SCALES", "ParamError", "Params", "validate",
    "MIMETYPE", "ClaimFailed", "check", "read_records", "record", "sanity", "verdict", "seed_table",
    "progress", "seed_everything", "setup",
]
