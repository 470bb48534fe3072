"""The codec thread's device side: the new frames of every stream with a chunk due, decoded
in one batched call of the streaming decoder (a CUDA graph replay per bucket on a GPU) on
the codec stream, copied to the host in one transfer and cut per stream."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
import torch
from torch import Tensor

from .capture import on_stream
from .codec import Codec, StreamingDecoder
from .codec.layers import CodecOps
from .request import Sequence, Turn

log = logging.getLogger(__name__)


class CodecWorker:
    # a tick slower than the audio it makes (and longer than this) lets every stream fall
    # behind realtime: counted, and logged at most once per SLOW_LOG_S
    SLOW_TICK_MIN_S = 0.1
    SLOW_LOG_S = 30.0

    def __init__(self, codec: Codec, ops: CodecOps, stream: torch.cuda.Stream | None, *,
                 n_rows: int, graphed: bool, max_frames: int, call_frames: int = 0,
                 stats: dict[str, float]) -> None:
        self.stream = stream
        self.stats = stats
        self.graphed = graphed
        self.cuda = codec.device.type == "cuda"
        # twice the decode rows: turns whose audio still drains while others speak; graphs
        # up to the rows only (the biggest buckets cost the most to capture)
        self.decoder = StreamingDecoder(codec, max_streams=max(2, 2 * n_rows), buckets=graphed,
                                        graph_streams=n_rows, max_frames=max_frames, ops=ops,
                                        call_frames=call_frames)
        self.waiting_since: float | None = None  # a tick waiting on the device (watchdog)
        self.frame_s = codec.frame_length / codec.sample_rate  # audio seconds per frame
        self._slow_logged_at = -float("inf")

    def capture(self, keys: list[tuple[int, int]] | None = None) -> float:
        """Capture `keys` (default: every bucket) on the codec stream, before the thread
        runs; returns the seconds."""
        return self.decoder.capture(self.stream, keys)

    def warm(self) -> float:
        """Compile the codec's compiled ops for every shape class its passes take
        (`StreamingDecoder.warm`), before the thread runs; returns the seconds."""
        return self.decoder.warm()

    def capture_later(self, keys: Seq[tuple[int, int]], stop: Callable[[], bool],
                      captured: Callable[[tuple[int, int]], None]) -> None:
        """Capture `keys` while the codec thread runs: on a stream of their own (a capture
        on the codec stream would take in the thread's own work), each graph used once it
        is in."""
        self.decoder.capture(torch.cuda.Stream(self.decoder.device), list(keys), stop=stop,
                             captured=captured)

    def decode(self, work: list[tuple[Sequence, Turn, Tensor]]) -> list[np.ndarray]:
        """codes [K, n] per (sequence, turn) -> float32 host samples [n * frame] per item. All
        of it on the codec stream: opening a stream zeroes its state rows, and the copy to
        the host must follow the tick's replay on the same stream."""
        t0 = time.perf_counter()
        if self.cuda:  # on a CPU the codec's wait is its own compute, not a stall
            self.waiting_since = t0
        try:
            with on_stream(self.stream):
                chunks: dict[int, Tensor] = {}
                for _, turn, codes in work:
                    if turn.codec_stream is None:
                        turn.codec_stream = self.decoder.open()
                    chunks[turn.codec_stream] = codes
                out = self.decoder.decode(chunks)
                # one device->host copy for the whole tick, then split per stream
                flat = torch.cat([out[sid] for sid in chunks]).cpu().numpy()  # float32
        finally:
            self.waiting_since = None
        pcm, at = [], 0
        for _, turn, _ in work:
            n = out[turn.codec_stream].shape[0]  # type: ignore[index]
            pcm.append(flat[at: at + n])
            at += n
        took = time.perf_counter() - t0
        self.stats["codec_s"] += took
        self.stats["codec_ticks"] += 1
        self._check_pace(took, len(work), max((codes.shape[1] for _, _, codes in work), default=0))
        return pcm

    def _check_pace(self, took: float, streams: int, frames: int) -> None:
        """Count (and now and then log) a tick that took longer than the audio its longest
        stream gained (`frames`): at that pace every stream's audio falls behind realtime."""
        audio_s = frames * self.frame_s
        if not streams or took <= max(audio_s, self.SLOW_TICK_MIN_S):
            return
        self.stats["codec_slow_ticks"] += 1
        now = time.monotonic()
        if now - self._slow_logged_at < self.SLOW_LOG_S:
            return
        self._slow_logged_at = now
        log.warning(
            "codec tick of %d streams (up to %d frames each) took %.0f ms for %.0f ms of audio "
            "per stream: audio is falling behind realtime and listeners will hear gaps (%d "
            "such ticks so far, /metrics rtvoice_engine_codec_slow_ticks_total). Usual causes: "
            "on a GPU, codec buckets still warming or a conv plan chosen without cuDNN's "
            "autotuner (StreamingDecoder.AUTOTUNE_MIN_WORK), or other work on the device; on a "
            "CPU, more speaking sessions than its cores decode in realtime (lower "
            "--max-running)", streams, frames, took * 1e3, audio_s * 1e3,
            self.stats["codec_slow_ticks"])

    def release(self, turns: list[Turn]) -> None:
        """Close the codec streams of turns whose audio is over."""
        for turn in turns:
            if turn.codec_stream is not None:
                self.decoder.close(turn.codec_stream)
                turn.codec_stream = None
