"""lowcomm: peer-to-peer low-communication (DiLoCo) training.

The repository keeps the sync library in ``protocol/`` and the daemon in ``node/``; they are
installed as ``lowcomm.protocol`` and ``lowcomm.node``.
"""

__version__ = "0.1.0"
