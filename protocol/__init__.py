"""The sync library: codecs, outer step, matchmaking, all-reduce, state transfer, RPC adapters.

Nothing here parses command lines, touches Prometheus or keeps global state; the daemon in
``lowcomm.node`` wires these pieces to a model, a DHT and metrics.
"""

PROTOCOL_VERSION = 6
"""Bumped on any incompatible change of the wire protocol or of the DHT records."""
