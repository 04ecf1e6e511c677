"""Each RPC is declared once (protocol/rpc), and PROTOCOL.md lists exactly those."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

import protocol
from protocol.rpc import Schema, all_rpcs, files

SPEC = Path(protocol.__file__).parent / "PROTOCOL.md"
WIRE_NAMES = {type(None): "nil", bytes: "bin"}


def spec_index() -> dict[str, tuple[str, str, str]]:
    """Section 17's table: method -> (schema module, params, result)."""
    text = SPEC.read_text()
    section = text[text.index("## 17.") : text.index("## 18.")]
    rows = re.findall(
        r"^\| `([a-z_]+\.[a-z0-9_]+)` \| `protocol/rpc/(\w+)\.py` \| `(\w+)` \| `?(\w+)`? \|$",
        section,
        re.M,
    )
    return {name: (module, params, result) for name, module, params, result in rows}


def declared() -> dict[str, tuple[str, str, str]]:
    return {
        rpc.name: (
            rpc.params.__module__.rsplit(".", 1)[1],
            rpc.params.__name__,
            WIRE_NAMES.get(rpc.result) or rpc.result.__name__,
        )
        for rpc in all_rpcs()
    }


def test_the_spec_index_is_the_declarations() -> None:
    assert spec_index() == declared()


def test_every_method_has_its_section() -> None:
    text = SPEC.read_text()
    for rpc in all_rpcs():
        assert f"**`{rpc.name}`**" in text, rpc.name


def test_names_are_unique_and_follow_the_module() -> None:
    names = [rpc.name for rpc in all_rpcs()]
    assert len(names) == len(set(names))
    for rpc in all_rpcs():
        module = rpc.params.__module__.rsplit(".", 1)[1]
        prefix = rpc.name.split(".")[0]
        assert module in ("core", prefix), rpc


def test_every_schema_has_the_one_configuration() -> None:
    for rpc in all_rpcs():
        for kind in (rpc.params, rpc.result):
            if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
                continue
            assert issubclass(kind, Schema), kind
            config = kind.__struct_config__
            assert config.omit_defaults and not config.forbid_unknown_fields


def test_params_from_takes_the_fields_among_the_arguments() -> None:
    def stat(path: str, *, follow_symlinks: bool = False, unrelated: int = 3) -> files.StatParams:
        return files.STAT.params_from(locals())

    assert stat("/w/a") == files.StatParams(path="/w/a", follow_symlinks=False)
    write = files.WRITE.params_from({"path": "/w/b", "data": b"x", "size": 9}, atomic=False)
    # Fields not among the arguments keep their defaults; given ones set or override.
    assert write == files.WriteParams(path="/w/b", data=b"x", atomic=False)
