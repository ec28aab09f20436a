"""The one exception of the sweep: a user-side problem (bad grid, unknown name, no manifest), shown as one line."""

from __future__ import annotations


class SweepError(ValueError):
    """A user-side problem with a sweep (bad grid, unknown name, no manifest). One clear line."""


class NotSubmitted(SweepError):
    """The scheduler refused a submission (or its setup cannot work); the manifest records the runs as failed with
    this line (`locked_manifest` saves it), so `retry` with corrected options resubmits them."""
