"""Errors that end the node with a one-line message instead of a traceback."""


class FatalError(Exception):
    """Stops the node with a one-line message and a non-zero exit code (no traceback)."""


class SettingError(FatalError):
    """A FatalError whose fix is another setting, not another try (a port another process took after
    the CLI's check): ``lowcomm-node join`` exits with the usage code 2, as for a config mistake."""


def refused_by_the_swarm(why: str, me: str) -> FatalError:
    """The error that ends a node the swarm refused. A run config that differs is described with
    both sides named by peer id (the same words reach the other peer), so this says which side
    is this node, and what to change."""
    if "runs a different run config" in why:
        why += (f" (this node is {me}: start it with the swarm's run config, the same config file and "
                f"overrides as its peers)")
    return FatalError(f"refused by the swarm: {why}")
