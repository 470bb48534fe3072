"""The codec thread's device side: the new frames of every stream with a chunk due, decoded
in one batched call of the streaming decoder (a CUDA graph replay per bucket on a GPU) on
the codec stream, copied to the host in one transfer and cut per stream."""

from __future__ import annotations

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


class CodecWorker:
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

    def capture(self, keys: list[tuple[int, int]] | None = None) -> float:
        """Capture `keys` (default: every bucket) on the codec stream, before the thread
        runs; returns the seconds."""
        return self.decoder.capture(self.stream, keys)

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
        self.stats["codec_s"] += time.perf_counter() - t0
        self.stats["codec_ticks"] += 1
        return pcm

    def release(self, turns: list[Turn]) -> None:
        """Close the codec streams of turns whose audio is over."""
        for turn in turns:
            if turn.codec_stream is not None:
                self.decoder.close(turn.codec_stream)
                turn.codec_stream = None
