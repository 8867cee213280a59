"""Errors that end the node with a one-line message instead of a traceback."""


class FatalError(Exception):
    """Stops the node with a one-line message and a non-zero exit code (no traceback)."""


class SettingError(FatalError):
    """A FatalError whose fix is another setting, not another try (a port another process took after
    the CLI's check): ``lowcomm-node join`` exits with the usage code 2, as for a config mistake."""
