"""lowcomm: peer-to-peer low-communication (DiLoCo) training.

The repository keeps the sync library in ``protocol/`` and the daemon in ``node/``; they are
installed as ``lowcomm.protocol`` and ``lowcomm.node``. ``lowcomm.Swarm`` (lowcomm/api.py) puts
the node's sync into your own training loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Swarm", "SwarmError", "SwarmStopped", "__version__"]

if TYPE_CHECKING:
    from .api import Swarm, SwarmError, SwarmStopped


def __getattr__(name: str) -> Any:
    # Imported on first use: the CLI's `status` and `init-config` import this package for the
    # version only and must not pay for torch and hivemind.
    if name in ("Swarm", "SwarmError", "SwarmStopped"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'lowcomm' has no attribute {name!r}")
