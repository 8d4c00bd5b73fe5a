"""The evaluation rooms' error, in a module of its own so that every eval module can raise it without importing
another (tasks.py selects tasks and imports datasets.py, which builds them)."""

from __future__ import annotations

from anychip.errors import AnychipError


class EvalDataError(AnychipError, ValueError):
    """Missing or malformed evaluation data; the message names the file (and line) and the fix."""
