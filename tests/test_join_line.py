"""The join line a node prints (``node_ready``): a multiaddr that other machines can dial."""

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
