"""A session's turn bookkeeping without sockets, asyncio or an engine: `Turns` driven by
client events and engine turn ends, acting through a recording port."""

from __future__ import annotations

import time

import pytest

from engine.errors import TurnError
from engine.request import FinishReason, TurnResult
from protocol import ProtocolError
from rtvoice.settings import LimitSettings
from rtvoice.turns import Segment, Turns, Utterance, segment_chars


class Port:
    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def submit(self, seg: Segment) -> None:
        self.log.append(("submit", seg.text))

    def cancel_running(self) -> None:
        self.log.append(("cancel", None))

    def ended(self, seg: Segment) -> None:
        self.log.append(("ended", seg.text))

    def finish(self, utt: Utterance) -> None:
        self.log.append(("finish", utt.index))

    def drop(self, utt: Utterance) -> None:
        self.log.append(("drop", utt.index))

    def done(self, utt: Utterance) -> None:
        self.log.append(("done", utt.index))

    def acknowledge_cancel(self, context_id: str | None) -> None:
        self.log.append(("ack", context_id))

    def report(self, error: object) -> None:
        self.log.append(("report", error))

    def kinds(self) -> list[str]:
        """What was asked, but the (informational) ends of segments."""
        return [k for k, _ in self.log if k != "ended"]


def make(port: Port | None = None, **limits: object) -> tuple[Turns, Port]:
    port = port or Port()
    turns = Turns(port, session_id="s1", limits=LimitSettings(**limits),  # type: ignore[arg-type]
                  chunk_length=200, chunk_cap=None, default_context=None,
                  budget={"multiplier": 3.0, "min_frames": 8, "max_frames": 100,
                          "request_max": None},
                  frame_rate=44100 / 2048)
    return turns, port


def end(turns: Turns, reason: FinishReason = FinishReason.LENGTH, frames: int = 5,
        error_code: TurnError | None = None, seg: Segment | None = None) -> Segment | None:
    """The engine ends `seg` (default: the running segment)."""
    seg = seg or turns.running
    assert seg is not None
    now = time.perf_counter()
    return turns.segment_ended(TurnResult(seg.turn_id, reason, frames, 0.2, now, now, now, now,
                                          error="refused" if error_code else None,
                                          error_code=error_code))


def test_segments_wait_for_the_voice_then_go_one_at_a_time():
    turns, port = make()
    turns.text(None, "Hello there. How are ")
    assert [s.text for s in turns.fifo] == ["Hello there."] and not port.log  # not accepting
    turns.accepting = True
    turns.pump()
    assert port.log == [("submit", "Hello there.")] and turns.running.turn_id == "s1.0"
    turns.text(None, "you? Fine")
    turns.flush(None)
    assert [s.text for s in turns.fifo] == ["How are you?", "Fine"] and turns.busy
    end(turns)
    end(turns)
    assert port.kinds() == ["submit", "submit", "submit"]
    end(turns)
    utt = next(iter(turns.open_utterances))
    assert port.log[-1] == ("finish", utt.index)  # every segment in: flush the encoder
    assert (utt.segments_total, utt.segments_done, utt.frames) == (3, 3, 15)
    turns.utterance_finished(utt)
    assert turns.drained and not turns.busy
    assert utt.done_event(44100).reason == "length" and utt.done_event(44100).segments == 3


def test_segments_know_their_place_in_the_turns_text_and_end_before_the_turn():
    turns, port = make()
    turns.accepting = True
    pushed = ["  Hello", " there.\n", "How are", " you?  Fine, ", "thanks "]
    for piece in pushed:
        turns.text(None, piece)
    turns.flush(None)
    text = "".join(pushed)
    segs = []
    while turns.running is not None:
        segs.append(turns.running)
        end(turns)
    assert [s.text for s in segs] == ["Hello there.", "How are you?", "Fine, thanks"]
    assert all(text[s.char_start:s.char_end] == s.text for s in segs)
    # every segment's end is reported, the last one before its turn's finish
    assert [k for k, _ in port.log][-2:] == ["ended", "finish"]
    assert [v for k, v in port.log if k == "ended"] == [s.text for s in segs]
    # the next turn's ranges count from its own first character
    turns.text(None, "Again.")
    turns.flush(None)
    assert (turns.running.char_start, turns.running.char_end) == (0, 6)


def test_a_segment_refused_for_the_clients_reason_reports_and_goes_on():
    turns, port = make()
    turns.accepting = True
    turns.text(None, "Too long.")
    turns.flush(None)
    end(turns, FinishReason.ERROR, 0, TurnError.TOO_LARGE)
    kind, err = port.log[1]
    assert kind == "report" and err.code == "too_large" and not err.fatal
    assert port.log[-1][0] == "finish"
    turns.text(None, "Ours.")
    turns.flush(None)
    with pytest.raises(ProtocolError, match="generation failed") as e:
        end(turns, FinishReason.ERROR, 0, TurnError.INTERNAL)
    assert e.value.fatal


def test_cancel_drops_queued_text_and_stops_the_running_segment():
    turns, port = make()
    turns.accepting = True
    turns.text(None, "One. Two. Three. And more")
    first = turns.running
    targets = turns.cancel(None)
    assert len(targets) == 1 and first.utterance in targets
    assert port.kinds() == ["submit", "drop", "cancel"]  # done waits for the engine's word
    assert not turns.fifo and turns.contexts[None].segmenter.buffered == 0
    assert turns.running is None and not turns.drained  # the cancelled segment's end is due
    end(turns, FinishReason.CANCELLED, 2, seg=first)
    assert port.log[-1] == ("done", first.utterance.index)
    assert first.utterance.done_event(44100).reason == "cancelled"
    assert turns.drained
    turns.cancel(None)  # nothing left: still acknowledged
    assert port.log[-1] == ("ack", None)


def test_the_next_turn_goes_to_the_engine_without_waiting_for_the_cancels_end():
    """Barge-in: text after a cancel is submitted at once (the engine stops the cancelled
    segment first and queues the next behind it); the cancelled turn's done still follows
    the engine's word, after which the new turn's segments run as usual."""
    turns, port = make()
    turns.accepting = True
    turns.text(None, "A long first answer. With more.")
    first = turns.running
    turns.cancel(None)
    turns.text(None, "Sorry, go on. ")
    turns.flush(None)
    second = turns.running
    assert second is not None and second is not first
    assert port.kinds() == ["submit", "drop", "cancel", "submit"]  # no wait for the ack
    end(turns, FinishReason.CANCELLED, 2, seg=first)  # the cancel's end arrives later
    assert ("done", first.utterance.index) in port.log and turns.running is second
    end(turns, seg=second)
    assert port.log[-1] == ("finish", second.utterance.index) and turns.running is None
    assert first.utterance.done_event(44100).reason == "cancelled"


def test_cancel_of_one_context_leaves_the_others():
    turns, port = make()
    turns.accepting = True
    turns.text("a", "Alpha one. Alpha two.")
    turns.text("b", "Beta one. ")
    turns.flush("b")
    running = turns.running
    assert running.utterance.context.id == "a"
    turns.cancel("b")  # b's turn is queued, not running: done at once
    assert ("done", 1) in port.log and ("cancel", None) not in port.log
    assert all(s.utterance.context.id == "a" for s in turns.fifo)


def test_limits_on_text_and_contexts():
    turns, _ = make(max_text_chars=20, max_contexts=2)
    turns.text("a", "x" * 15)
    with pytest.raises(ProtocolError, match="unspoken characters") as e:
        turns.text("a", "y" * 10)
    assert e.value.code == "too_large"
    turns.text("b", "hello")
    with pytest.raises(ProtocolError, match="too many contexts") as e:
        turns.text("c", "hello")
    assert e.value.code == "bad_request" and "c" not in turns.contexts


def test_stop_flushes_every_context_and_idle_contexts_are_bounded():
    turns, _ = make(max_contexts=1)
    turns.accepting = True
    for i in range(6):  # a client cycling through context ids, one turn each
        turns.text(f"c{i}", f"Turn {i}.")
        turns.flush(f"c{i}")
        end(turns)
        utt = next(u for u in turns.open_utterances if u.context.id == f"c{i}")
        turns.utterance_finished(utt)
        turns.contexts[f"c{i}"].next_seq = 1  # its audio went out
    assert len(turns.contexts) <= 4  # 4 x max_contexts idle contexts remembered at most
    turns.text(None, "Unflushed")
    turns.stop()
    assert turns.running is not None and turns.running.text == "Unflushed"


def test_segment_chars_is_the_worst_case_of_the_tokens_left():
    assert segment_chars(400) == 100 and segment_chars(3) == 0 and segment_chars(-1) == -1


class AheadPort(Port):
    def ahead(self, text: str) -> None:
        self.log.append(("ahead", text))

    def aheads(self) -> list[object]:
        return [t for k, t in self.log if k == "ahead"]


def test_the_next_segments_start_goes_ahead_while_its_text_streams():
    turns, port = make(AheadPort())
    turns.accepting = True
    aheads = port.aheads
    turns.text(None, "Your table for two is booked")  # one event so far: maybe sent whole
    assert aheads() == []
    turns.text(None, " at eight")  # streaming: its start up to the last word goes ahead
    assert aheads() == ["Your table for two is booked at"]
    turns.text(None, " tonight, and")  # fewer than HEAD_STEP_CHARS more: not again
    assert len(aheads()) == 1
    turns.text(None, " the kitchen closes at eleven, so")
    assert aheads()[-1] == "Your table for two is booked at eight tonight, and the kitchen closes at eleven,"
    turns.text(None, " hurry. And")  # a segment cut and submitted: no head while it runs
    assert port.log[-1] == ("submit", "Your table for two is booked at eight tonight, and the "
                                      "kitchen closes at eleven, so hurry.")
    n = len(aheads())
    turns.text(None, " then some more words follow here")
    assert len(aheads()) == n
    end(turns)  # the next segment's text keeps streaming: its start goes ahead now
    turns.text(None, " after")
    assert aheads()[-1] == "And then some more words follow here"


def test_each_context_offers_its_own_head_and_a_cancel_forgets_it():
    turns, port = make(AheadPort())
    turns.accepting = True
    aheads = port.aheads
    for piece in ("One context streams", " its words"):
        turns.text("a", piece)
    for piece in ("Another context speaks", " too"):
        turns.text("b", piece)
    assert aheads() == ["One context streams its", "Another context speaks"]
    turns.text("a", " on")  # a's head barely grew: not offered again
    assert len(aheads()) == 2
    turns.cancel("a")
    for piece in ("One context streams", " again"):
        turns.text("a", piece)
    assert aheads()[-1] == "One context streams"  # offered afresh after the cancel


def test_a_sentence_continues_its_utterance_once_an_earlier_one_had_audio():
    """`Segment.continues` (the engine serves such a turn first) holds for a later sentence
    of an utterance whose audio the client already plays — not for an utterance's first
    sentence, nor after sentences that made no audio, nor for the next utterance."""
    turns, _ = make()
    turns.accepting = True
    turns.text(None, "Hello! How can I help? Bye.")
    turns.flush(None)
    first = turns.running
    assert first.text == "Hello!" and not first.continues
    end(turns, frames=0)  # no audio yet: nothing plays, the next sentence starts nothing late
    assert turns.running.text == "How can I help?" and not turns.running.continues
    assert turns.audio(turns.running.turn_id, 2048) is turns.running
    end(turns)
    assert turns.running.text == "Bye." and turns.running.continues
    end(turns)
    turns.utterance_finished(next(iter(turns.open_utterances)))
    turns.text(None, "A new turn.")
    turns.flush(None)
    assert turns.running.text == "A new turn." and not turns.running.continues
