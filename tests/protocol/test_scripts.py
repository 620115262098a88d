"""Every Lua script lives in streamvqa/protocol/scripts.py, once."""

from pathlib import Path

from streamvqa.protocol import scripts

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_outside_the_protocol_holds_a_script():
    holders = [
        str(path.relative_to(ROOT))
        for package in ("app", "worker", "streamvqa", "engine")
        for path in (ROOT / package).rglob("*.py")
        if "redis.call(" in path.read_text() and path.parent.name != "protocol"
    ]
    assert holders == []


def test_each_script_is_defined_once():
    texts = [value for name, value in vars(scripts).items() if name.endswith("_LUA")]
    assert len(set(texts)) == len(texts)
