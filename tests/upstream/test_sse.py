"""The SSE splitter hands on each event as soon as it is complete, however the bytes are cut."""

from __future__ import annotations

from gateway.upstream.sse import SSESplitter, event_data

STREAM = b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'


def test_any_cut_gives_the_same_events() -> None:
    whole = SSESplitter().feed(STREAM)
    assert [event_data(e) for e in whole] == [b'{"a": 1}', None, b'{"b": 2}', b"[DONE]"]
    for cut in range(1, len(STREAM)):
        splitter = SSESplitter()
        events = splitter.feed(STREAM[:cut]) + splitter.feed(STREAM[cut:])
        assert events == whole, cut
        assert splitter.pending == b""


def test_event_is_released_before_the_next_one_arrives() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b'data: {"a"') == []
    assert splitter.feed(b': 1}\n\ndata: {"b"') == [b'data: {"a": 1}\n\n']
    assert splitter.pending == b'data: {"b"'


def test_multiline_data_is_joined() -> None:
    assert event_data(b"event: x\ndata: line1\ndata:line2\n\n") == b"line1\nline2"
