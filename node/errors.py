"""Errors that end the node with a one-line message instead of a traceback."""


class FatalError(Exception):
    """Stops the node with a one-line message and a non-zero exit code (no traceback)."""
