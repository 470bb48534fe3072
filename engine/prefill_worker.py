"""The prefill thread's device side: one round writes the next chunk of each job's prompt
columns into its blocks (graph replays where a bucket fits, an eager batched forward
otherwise) on the prefill stream, and marks the jobs it finished with the CUDA event the
decode stream must wait for before their sequences join (a graph replay returns before the
GPU is done: without the event the next decode step could read a half-written prompt).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from .capture import buckets, on_stream
from .prefill_graphs import Key, PrefillGraphs
from .request import PrefillJob
from .runner import ModelRunner

log = logging.getLogger(__name__)

SPAN_LADDER = tuple(2**k for k in range(8, 20))


class PrefillWorker:
    def __init__(self, runner: ModelRunner, stream: torch.cuda.Stream | None, *, chunk: int,
                 batch: int, stats: dict[str, float]) -> None:
        self.runner = runner
        self.stream = stream
        self.chunk = chunk
        self.batch = batch
        self.stats = stats
        self.cuda = runner.device.type == "cuda"
        # keys over power-of-two spans: reading up to twice the keys needed costs little next
        # to the weights, and 4,096 positions need 5 span buckets, not 16
        self.graphs = PrefillGraphs(runner, chunk=chunk, batch=batch,
                                    spans=buckets(SPAN_LADDER, runner.max_len))

    def warm(self) -> None:
        """Run the prefill shapes once now (fused ops compile for them here, not in the
        first session's voice prefill: seen 6.6 s on the H200). Writes only the scratch block."""
        t0 = time.perf_counter()
        cols = torch.zeros(self.runner.cfg.frame_rows, 16, dtype=torch.long)
        scratch = (self.runner.scratch,)
        self.runner.prefill_batch([(scratch, cols, 0)])
        self.runner.prefill_batch([(scratch, cols, 0), (scratch, cols[:, :9], 0)])
        if self.cuda:
            torch.cuda.synchronize()
        log.info("prefill shapes warmed in %.1fs", time.perf_counter() - t0)

    def capture(self, keys: list[Key] | None = None) -> None:
        """Capture `keys` (default: all) on the prefill stream, before the thread runs."""
        assert self.stream is not None
        self.graphs.capture(self.stream, keys)

    def capture_later(self, keys: Sequence[Key], stop: Callable[[], bool],
                      captured: Callable[[Key], None]) -> None:
        """Capture `keys` while the prefill thread runs: on a stream of their own (a capture
        on the prefill stream would take in the thread's own work), each graph used once it
        is in."""
        self.graphs.capture(torch.cuda.Stream(self.runner.device), list(keys), stop=stop,
                            captured=captured)

    def round(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """One chunk of each of `jobs` (at most `batch` of them). Returns the jobs now done —
        complete, abandoned, or failed (`job.event` holds the exception) — each carrying the
        event to wait for on a GPU. Jobs go in `PrefillJob.rank` order: a later sentence of an
        utterance the client is playing first, prefill-ahead jobs (speculative) last unless a
        turn waits for one (`urgent`)."""
        jobs = sorted(jobs, key=lambda j: j.rank)[: self.batch]  # stable: FIFO within a rank
        with on_stream(self.stream):
            try:
                finished = self._round_safe(jobs)
                if finished and self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    for job in finished:
                        if job.event is None:
                            job.event = ev
            except Exception as e:  # outside the per-job handling (e.g. recording the event):
                log.exception("prefill round failed")  # fail this batch, keep the thread
                for job in jobs:
                    job.event = e
                finished = jobs
        return finished

    def _round_safe(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """`_round`, but a failure fails only the job that causes it: a failed batch is
        retried one job at a time; a job that fails alone gets the exception as its `event`
        (its sequence is then closed with an error) and counts as finished."""
        try:
            return self._round(jobs)
        except Exception as e:
            if len(jobs) == 1:
                log.exception("prefill failed for sequence %d", jobs[0].seq.seq_id)
                jobs[0].event = e
                return jobs
            log.warning("batched prefill of %d sequences failed (%s); retrying one by one",
                        len(jobs), e)
            done: list[PrefillJob] = []
            for job in jobs:
                done += self._round_safe([job])
            return done

    def _round(self, jobs: list[PrefillJob]) -> list[PrefillJob]:
        """One chunk of each job, all in one batched forward; returns the jobs now complete
        (or abandoned: closed sequence, cancelled turn)."""
        n = self.chunk
        done, items, work = [], [], []
        for job in jobs:
            if not job.prepared:  # even for an abandoned job: the sequence's KV depends on it
                self._prepare(job)
            if job.abandoned:
                done.append(job)
                continue
            chunk = job.cols[:, job.done: job.done + n]
            if not chunk.shape[1]:
                done.append(job)
                continue
            items.append((job.blocks, chunk, job.start + job.done))
            work.append((job, chunk.shape[1]))
        if items:
            t0 = time.perf_counter()
            replays, eager = self.graphs.plan(items)  # graphs where a bucket fits
            for key, chunks in replays:
                self.graphs.replay(key, chunks)
            if eager:
                self.runner.prefill_batch(eager)
            dt = time.perf_counter() - t0
            self.stats["prefill_s"] += dt
            self.stats["prefill_calls"] += 1
            for job, cols in work:
                job.done += cols
                job.seq.prefill_s += dt
                self.stats["prefill_cols"] += cols
                if job.done >= job.cols.shape[1]:
                    done.append(job)
        return done

    def _prepare(self, job: PrefillJob) -> None:
        """The block work a job's sequence needs before its columns go in, on this stream:
        its KV back from host memory (an evicted session's next turn), then copies of the
        shared blocks it writes into (copy-on-write of a voice prefix's last block). Done
        even when the turn was cancelled meanwhile: the scheduler already dropped the host
        copy and gave the sequence its new blocks, which must hold its context."""
        t0 = time.perf_counter()
        if job.restore is not None:
            saved, blocks = job.restore
            self.runner.restore(saved, list(blocks))  # type: ignore[arg-type]
            self.stats["kv_restore_s"] += time.perf_counter() - t0
        for src, dst in job.copies:
            self.runner.copy_block(src, dst)
        job.prepared = True
