"""Segment timestamps: the ``segment`` events (text, character range, audio span, estimated
word times) against a live server, and the client library's "text heard so far"."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from _live import Client, is_finish, request

from clients import connect
from protocol import Audio, Done, Flush, Ready, Segment, Start, Stop, Text
from rtvoice.testing import running_server
from rtvoice.timestamps import segment_event, split_words

pytestmark = pytest.mark.timeout(180)

FRAMES = 8
HOP, RATE = 2048, 44100
SEG_S = FRAMES * HOP / RATE  # every segment is exactly FRAMES long (random weights)


@pytest.fixture(scope="module")
def server():
    with running_server(max_turn_frames=FRAMES, budget_multiplier=1.0,
                        min_turn_frames=FRAMES) as url:
        yield url


# ------------------------------------------------------------------------------ the estimates


def test_words_cover_the_segment_in_order_with_their_characters():
    text = "Hello there, my friend. 你好世界。」 ok"
    words = split_words(text)
    assert [w for w, _, _ in words] == ["Hello", "there,", "my", "friend.", "你", "好", "世",
                                        "界。」", "ok"]
    assert all(text[s:e] == w for w, s, e in words)
    est = segment_event(context_id="c", index=3, text=text, char_start=10, start_s=2.0,
                        end_s=None)
    assert not est.final and est.end is None and est.timing == "estimated"
    assert (est.char_start, est.char_end) == (10, 10 + len(text))
    final = segment_event(context_id="c", index=3, text=text, char_start=10, start_s=2.0,
                          end_s=5.0)
    assert final.final and final.end == 5.0
    for ev in (est, final):
        ws = ev.words
        assert ws[0].start == 2.0 and all(a.end == b.start for a, b in itertools.pairwise(ws))
        assert all(w.end > w.start for w in ws)
        assert [(w.char_start - 10, w.char_end - 10) for w in ws] == [(s, e) for _, s, e in words]
    assert final.words[-1].end == pytest.approx(5.0, abs=1e-3)
    # longer words take longer
    by_text = {w.text: w.end - w.start for w in final.words}
    assert by_text["friend."] > by_text["my"]


# ------------------------------------------------------------------------------ live


async def _turn(url: str, pieces: list[str], **req: Any) -> list[Any]:
    c = await Client.connect(url.ws_url)
    c.keep_segments = True
    await c.send(Start(request=request(max_new_tokens=FRAMES, **req)))
    assert isinstance(await c.recv(), Ready)
    for piece in pieces:
        await c.send(Text(text=piece))
    await c.send(Flush())
    await c.send(Stop())
    return await c.until(is_finish)


async def test_segment_events_bracket_each_segments_audio(server):
    pieces = ["  First", " sentence here. Second", " one!\n", "Third and last"]
    text = "".join(pieces)  # the turn's text, from its first piece that is not blank
    events = await _turn(server, pieces)
    segs = [e for e in events if isinstance(e, Segment)]
    audio = [e for e in events if isinstance(e, Audio)]
    done = next(e for e in events if isinstance(e, Done))
    assert done.segments == 3
    first = [s for s in segs if not s.final]
    final = [s for s in segs if s.final]
    assert [s.index for s in first] == [s.index for s in final] == [0, 1, 2]
    assert [s.text for s in final] == ["First sentence here.", "Second one!", "Third and last"]
    for s in final:
        assert text[s.char_start:s.char_end] == s.text
    # the estimate comes right before the segment's first audio, the final one after its last
    for s in first:
        i = events.index(s)
        nxt = events[i + 1]
        assert isinstance(nxt, Audio) and nxt.offset_s <= s.start + 1e-3
        assert all(a.offset_s + a.duration_s <= s.start + 1e-3
                   for a in audio if events.index(a) < i)
    for s in final:
        assert events.index(s) > max(events.index(a) for a in audio
                                     if a.offset_s < s.end - 1e-3)
    # the spans tile the turn's audio: each segment is FRAMES long
    total = sum(a.duration_s for a in audio)
    assert total == pytest.approx(3 * SEG_S, abs=1e-3)
    for k, s in enumerate(final):
        assert s.start == pytest.approx(k * SEG_S, abs=1e-3)
        assert s.end == pytest.approx((k + 1) * SEG_S, abs=1e-3)
        assert s.words[0].start == s.start and s.words[-1].end == pytest.approx(s.end, abs=1e-3)
        assert all(text[w.char_start:w.char_end] == w.text for w in s.words)


async def test_a_second_turn_continues_the_timeline_and_restarts_the_characters(server):
    c = await Client.connect(server.ws_url)
    c.keep_segments = True
    await c.send(Start(request=request(max_new_tokens=FRAMES, context_id="agent")))
    assert isinstance(await c.recv(), Ready)
    for text in ("One.", "Two."):
        await c.send(Text(text=text, context_id="agent"))
        await c.send(Flush(context_id="agent"))
    await c.send(Stop())
    events = await c.until(is_finish)
    final = [e for e in events if isinstance(e, Segment) and e.final]
    assert [(s.index, s.text, s.char_start, s.context_id) for s in final] == [
        (0, "One.", 0, "agent"), (1, "Two.", 0, "agent")]
    assert final[1].start == pytest.approx(SEG_S, abs=1e-3)


async def test_timestamps_can_be_turned_off(server):
    events = await _turn(server, ["No timestamps, please."], timestamps=False)
    assert not any(isinstance(e, Segment) for e in events)
    assert any(isinstance(e, Audio) for e in events)


async def test_the_client_knows_the_text_heard_so_far(server):
    async with connect(server, format="pcm", max_new_tokens=FRAMES, seed=1) as session:
        await session.wait_ready()
        turn = await session.feed(["  Hello there, ", "how are you? ", "I am fine."])
        await turn
        assert turn.text == "  Hello there, how are you? I am fine."
        assert [s.final for s in turn.segments] == [True, True]
        assert turn.heard(0.0) == ""
        assert turn.heard(SEG_S) == "  Hello there, how are you?"
        assert turn.heard(2 * SEG_S) == turn.text
        # inside a segment: whole words only, in order, a prefix of the text
        heard = [turn.heard(SEG_S * k / 10) for k in range(11)]
        assert all(turn.text.startswith(h) for h in heard)
        assert all(len(a) <= len(b) for a, b in itertools.pairwise(heard))
        assert heard[3] in ("  Hello", "  Hello there,") and heard[9] == "  Hello there, how are"


async def test_barge_in_keeps_what_was_heard(server):
    """A cancel mid-turn: the segments already announced say what the listener heard up to
    the cut."""
    async with connect(server, format="pcm", max_new_tokens=FRAMES, seed=2) as session:
        await session.wait_ready()
        turn = session.open_turn()
        await session.send_text("A first sentence to hear. A second that is cut. A third. ")
        await session.flush()
        async for _chunk in turn:
            if len(turn.segments) >= 1 and turn.chunks:
                break
        await session.cancel()
        result = await turn
        assert result.cancelled
        played = sum(ch.duration_s for ch in turn.chunks)
        heard = turn.heard(played)
        assert turn.text.startswith(heard)
        assert len(heard) <= len("A first sentence to hear. A second that is cut.")
        await asyncio.sleep(0)
