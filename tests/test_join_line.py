"""The join line a node prints (``node_ready``): a multiaddr that other machines can dial."""

from lowcomm.node.announce import DEFAULT_ROUTE_PROBE, Choice, choose_announce_host, source_address_towards
from lowcomm.node.daemon import join_multiaddr

ID = "QmPVxc3bK8t"
LOOPBACK, LAN, V6_LOOPBACK = (f"/ip4/127.0.0.1/tcp/7700/p2p/{ID}", f"/ip4/192.0.2.2/tcp/7700/p2p/{ID}",
                              f"/ip6/::1/tcp/7700/p2p/{ID}")


def test_a_node_on_every_interface_shows_the_address_it_announces_not_loopback():
    assert join_multiaddr([LOOPBACK, LAN], "192.0.2.2") == LAN
    assert join_multiaddr([V6_LOOPBACK, LOOPBACK, LAN], "gpu-box.example.org") == LAN  # a name: the first not on loopback


def test_a_node_on_loopback_alone_shows_loopback():
    assert join_multiaddr([LOOPBACK, LAN], "127.0.0.1") == LOOPBACK  # --host 127.0.0.1: only this machine joins
    assert join_multiaddr([LOOPBACK], "127.0.0.1") == LOOPBACK
    assert join_multiaddr([V6_LOOPBACK, LOOPBACK], "gpu-box.example.org") == V6_LOOPBACK


# A machine with a Docker bridge and a LAN address: the DHT lists both, the bridge's first.
BRIDGE_HOST, LAN_HOST = "172.17.0.1", "192.168.1.20"
TWO = [f"/ip4/127.0.0.1/tcp/7700/p2p/{ID}", f"/ip4/{BRIDGE_HOST}/tcp/7700/p2p/{ID}",
       f"/ip4/{LAN_HOST}/tcp/7700/p2p/{ID}"]


def routes(table: dict[str, str]):
    """A route lookup that sends from table[destination]; no route for any other destination."""
    return lambda destination: table.get(destination)


def test_on_several_interfaces_the_address_routed_towards_the_peers_is_announced():
    # Found by a two-namespace audit: the bridge's address was told, peers never reached the
    # node, and its rounds took 70 s while its log said nothing.
    peer = f"/ip4/192.168.1.7/tcp/7700/p2p/{ID}"
    choice = choose_announce_host(TWO, [peer], routes({"192.168.1.7": LAN_HOST, DEFAULT_ROUTE_PROBE: BRIDGE_HOST}))
    assert (choice.host, choice.ambiguous) == (LAN_HOST, False)
    assert "192.168.1.7" in choice.why
    assert join_multiaddr(TWO, choice.host) == TWO[2]


def test_the_first_peer_of_a_swarm_announces_the_address_on_the_default_route():
    choice = choose_announce_host(TWO, [], routes({DEFAULT_ROUTE_PROBE: LAN_HOST}))
    assert (choice.host, choice.why, choice.ambiguous) == (LAN_HOST, "the address on the default route", False)
    # A peer given by a name, or routed from an address the DHT does not list: the default route.
    named = "/dns4/seed.example.org/tcp/7700/p2p/QmX"
    assert choose_announce_host(TWO, [named], routes({DEFAULT_ROUTE_PROBE: LAN_HOST})).host == LAN_HOST
    loopback_peer = f"/ip4/127.0.0.1/tcp/7700/p2p/{ID}"
    assert choose_announce_host(TWO, [loopback_peer], routes({"127.0.0.1": "127.0.0.1",
                                                              DEFAULT_ROUTE_PROBE: LAN_HOST})).host == LAN_HOST


def test_without_a_route_that_decides_the_first_address_is_announced_and_flagged():
    choice = choose_announce_host(TWO, [], routes({}))
    assert (choice.host, choice.ambiguous) == (BRIDGE_HOST, True)


def test_one_address_needs_no_route_and_none_but_loopback_gives_loopback():
    def no_lookup(destination):
        raise AssertionError(f"looked up a route to {destination}")

    assert choose_announce_host(TWO[:2], [], no_lookup) == Choice(BRIDGE_HOST, "the only address not on loopback",
                                                                   ambiguous=False)
    assert choose_announce_host(TWO[:1], [], no_lookup).host == "127.0.0.1"


def test_the_route_lookup_is_the_kernels_and_sends_nothing():
    assert source_address_towards("127.0.0.1") == "127.0.0.1"  # UDP connect: no packet leaves
    assert source_address_towards("gpu-box.example.org") is None  # not an IPv4 address: no lookup
    assert source_address_towards("::1") is None
