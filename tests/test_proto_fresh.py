"""The checked-in protocol/_pb is what gen_proto generates, and every proto field is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lowcomm.protocol import gen_proto

PROTO_DIR = gen_proto.PROTO_ROOT / "lowcomm" / "v1"
PROTOS = sorted(PROTO_DIR.glob("*.proto"))


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the code")
    generated = gen_proto.generate(tmp_path)
    assert generated, "no .proto file was compiled"
    fresh_dir, checked_in_dir = tmp_path / "lowcomm" / "v1", gen_proto.OUT / "lowcomm" / "v1"
    fresh = {p.name for p in fresh_dir.iterdir() if p.is_file()}
    checked_in = {p.name for p in checked_in_dir.iterdir() if p.is_file()}
    assert fresh == checked_in, "stale or missing files in protocol/_pb: run `python -m lowcomm.protocol.gen_proto`"
    stale = [name for name in sorted(fresh) if (fresh_dir / name).read_bytes() != (checked_in_dir / name).read_bytes()]
    assert not stale, f"protocol/_pb is stale ({', '.join(stale)}): run `python -m lowcomm.protocol.gen_proto`"
    assert (tmp_path / "lowcomm" / "__init__.py").read_bytes() == (gen_proto.OUT / "lowcomm" / "__init__.py").read_bytes()


# A field (`type name = N;`, with optional `repeated`/`optional`, map<> types) or an enum value (`NAME = N;`).
_FIELD = re.compile(r"^\s*(?:(?:repeated|optional)\s+)?(?:map\s*<[^>]+>|[\w.]+)\s+\w+\s*=\s*\d+\s*(?:\[[^\]]*\])?\s*;")
_ENUM_VALUE = re.compile(r"^\s*[A-Z][A-Z0-9_]*\s*=\s*-?\d+\s*(?:\[[^\]]*\])?\s*;")


def undocumented(text: str) -> list[str]:
    """Fields and enum values whose line directly above is not a // comment."""
    lines = text.splitlines()
    missing = []
    for number, line in enumerate(lines):
        if line.strip().startswith("//") or not (_FIELD.match(line) or _ENUM_VALUE.match(line)):
            continue
        if line.strip().startswith(("option ", "syntax ", "package ", "import ")):
            continue
        above = lines[number - 1].strip() if number else ""
        if not above.startswith("//"):
            missing.append(f"line {number + 1}: {line.strip()}")
    return missing


def test_the_comment_checker_can_fail():
    text = "message A {\n  // documented\n  int32 a = 1;\n  int32 b = 2;\n  repeated Foo c = 3;\n}\nenum E {\n  E_X = 0;\n}\n"
    assert undocumented(text) == ["line 4: int32 b = 2;", "line 5: repeated Foo c = 3;", "line 8: E_X = 0;"]
    assert undocumented("// x\nsyntax = \"proto3\";\n") == []


def test_protos_exist():
    assert {p.name for p in PROTOS} >= {"averaging.proto", "handshake.proto", "node.proto", "state.proto", "tensor.proto"}


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_field_and_enum_value_is_commented(proto: Path):
    missing = undocumented(proto.read_text())
    assert not missing, f"{proto.name}: fields without a comment directly above:\n  " + "\n  ".join(missing)
