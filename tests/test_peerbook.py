"""node/peerbook.py: the peers a node remembers beside its checkpoints, and the record field they
come from."""

from __future__ import annotations

import logging

from lowcomm.node.peerbook import KEEP, SAVE_EVERY_SECONDS, PeerBook, book_path, load, peer_id_of
from lowcomm.node.swarm import PeerRecord


def maddr(n: int) -> str:
    return f"/ip4/10.0.0.{n}/tcp/7700/p2p/Qm{n:044d}"


def test_peer_id_of_needs_a_p2p_part():
    assert peer_id_of(maddr(1)) == f"Qm{1:044d}"
    assert peer_id_of("/ip4/10.0.0.1/tcp/7700") == ""
    assert peer_id_of("/p2p/") == "" and peer_id_of("/ip4/1.2.3.4/tcp/1/p2p/a/b") == ""


def test_load_keeps_the_multiaddrs_and_skips_comments_garbage_and_repeats(tmp_path):
    path = book_path(tmp_path)
    assert load(path) == []  # no file: nothing remembered
    path.write_text(f"# header\n{maddr(1)}\n\n  {maddr(2)}  \nhello\n/ip4/1.2.3.4/tcp/5\n{maddr(1)}\n")
    assert load(path) == [maddr(1), maddr(2)]


def test_an_unreadable_file_is_said_once_and_remembers_nothing(tmp_path, caplog):
    path = book_path(tmp_path)
    path.write_bytes(b"\xff\xfe not text")
    with caplog.at_level(logging.WARNING, logger="lowcomm.node"):
        assert load(path) == []
    assert [r.getMessage() for r in caplog.records] == [
        f"cannot read {path} ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte); "
        f"starting without the peers it remembers"]


def test_remember_writes_the_live_peers_first_then_those_seen_before(tmp_path):
    path = book_path(tmp_path)
    path.write_text(f"{maddr(1)}\n{maddr(2)}\n")
    book = PeerBook(path, own_peer_id=peer_id_of(maddr(9)))
    assert book.remember([maddr(3), "", maddr(9), maddr(2)], now=0.0)  # "" (client mode) and ourselves left out
    assert load(path) == [maddr(3), maddr(2), maddr(1)]
    assert path.read_text().startswith("# ") and not list(tmp_path.glob(".*tmp"))


def test_remember_writes_at_most_once_a_minute_and_only_what_changed(tmp_path):
    path = book_path(tmp_path)
    book = PeerBook(path, own_peer_id="me")
    assert book.remember([maddr(1)], now=0.0)
    assert not book.remember([maddr(2)], now=SAVE_EVERY_SECONDS - 1)  # too soon
    assert load(path) == [maddr(1)]
    assert not book.remember([maddr(1)], now=SAVE_EVERY_SECONDS)  # nothing new: not written
    assert book.remember([maddr(2)], now=SAVE_EVERY_SECONDS + 1)
    assert load(path) == [maddr(2), maddr(1)]
    assert not book.remember([], now=10 * SAVE_EVERY_SECONDS)  # an empty view never erases the book
    assert load(path) == [maddr(2), maddr(1)]


def test_a_peer_that_said_goodbye_is_forgotten_and_the_book_stays_bounded(tmp_path):
    path = book_path(tmp_path)
    book = PeerBook(path, own_peer_id="me")
    book.remember([maddr(n) for n in range(1, KEEP + 1)], now=0.0)
    book.remember([maddr(100)], left=[peer_id_of(maddr(1))], now=SAVE_EVERY_SECONDS)
    kept = load(path)
    assert len(kept) == KEEP and kept[0] == maddr(100) and maddr(1) not in kept


def test_a_peer_with_a_new_address_replaces_its_old_one(tmp_path):
    path = book_path(tmp_path)
    book = PeerBook(path, own_peer_id="me")
    book.remember([maddr(1)], now=0.0)
    moved = maddr(1).replace("10.0.0.1", "10.0.0.77")
    book.remember([moved], now=SAVE_EVERY_SECONDS)
    assert load(path) == [moved]


def test_a_book_that_cannot_be_written_warns_once_and_never_raises(tmp_path, caplog, monkeypatch):
    path = book_path(tmp_path / "gone")  # its folder does not exist
    book = PeerBook(path, own_peer_id="me")
    with caplog.at_level(logging.WARNING, logger="lowcomm.node"):
        assert not book.remember([maddr(1)], now=0.0)
        assert not book.remember([maddr(2)], now=SAVE_EVERY_SECONDS)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(f"cannot write {path} (")


def test_the_record_carries_the_dht_address_and_ignores_a_strangers_bad_one():
    record = PeerRecord("p", "127.0.0.1:1", 3, "h", 1.0, 1.0, 1, "f", "training", dht_address=maddr(1))
    assert PeerRecord.parse("p", record.to_value()).dht_address == maddr(1)
    for bad in (7, ["x"], "x" * 600, None):
        value = record.to_value() | {"dht_address": bad}
        assert PeerRecord.parse("p", value).dht_address == ""
    old = {k: v for k, v in record.to_value().items() if k != "dht_address"}  # a peer of an earlier version
    assert PeerRecord.parse("p", old).dht_address == ""

