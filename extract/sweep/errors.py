"""The one exception of the sweep: a user-side problem (bad grid, unknown name, no manifest), shown as one line."""

from __future__ import annotations


class SweepError(ValueError):
    """A user-side problem with a sweep (bad grid, unknown name, no manifest). One clear line."""
