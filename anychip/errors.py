"""Errors that users see: each message names the file, layer or flag and says how to fix it."""


class AnychipError(Exception):
    """Base class: the CLI prints the message and exits 2 instead of a traceback."""
