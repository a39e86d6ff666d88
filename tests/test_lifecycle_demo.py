"""`python -m lifecycle demo` keys illegal events as every report does."""

from lifecycle import demo
from lifecycle.kv import Event
from lifecycle.trace import pair_key


def test_demo_keys_illegal_events_like_every_report(capsys):
    assert demo.walk() == 0
    out = capsys.readouterr().out
    assert pair_key(None, Event.FINISH) == "unknown/finish"
    assert "illegal: {'unknown/finish': 1}" in out
