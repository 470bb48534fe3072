"""Configuration: the model's (one slotted dataclass per concern, named presets, the
checkpoint reader) and the engine's (`EngineConfig`, options declared once).

The field names follow the S2 `config.json` (`fish_qwen3_omni`): `text_config` becomes the
slow AR, `audio_decoder_config` the fast AR, and the token ids sit at the top level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .options import option, validate

DECODE_ROPE_ROWS = 2  # decode_rope_rows' default: one speaking turn's buckets
ATTENTION_TRITON_ROWS = 16  # attention_triton_rows' default: the Triton attention from 16 rows


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


@dataclass(slots=True, frozen=True)
class TransformerConfig:
    """One decoder-only transformer stack (used for both the slow and the fast AR)."""

    n_layer: int
    dim: int
    n_head: int
    n_local_heads: int  # kv heads (GQA)
    head_dim: int
    intermediate_size: int  # SwiGLU hidden size
    vocab_size: int  # slow: text vocab (padded); fast: codebook size
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 32768
    qk_norm: bool = False

    def __post_init__(self) -> None:
        _positive(self, "n_layer", "dim", "n_head", "n_local_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_seq_len")
        if self.n_head % self.n_local_heads:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_base and norm_eps must be positive")

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_local_heads * self.head_dim

    def num_params(self, *, embeddings: bool = True) -> int:
        per_layer = (self.dim * (self.q_size + 2 * self.kv_size) + self.q_size * self.dim
                     + 3 * self.dim * self.intermediate_size + 2 * self.dim
                     + (2 * self.head_dim if self.qk_norm else 0))
        return self.n_layer * per_layer + self.dim + (self.vocab_size * self.dim if embeddings else 0)


@dataclass(slots=True, frozen=True)
class TokenIds:
    """The special ids the engine needs. Real S2-Pro values are the defaults."""

    im_end: int = 151645
    pad: int = 151669
    audio_pad: int = 151677
    semantic_start: int = 151678
    semantic_end: int = 155773  # inclusive

    def __post_init__(self) -> None:
        if self.semantic_end < self.semantic_start:
            raise ValueError("semantic_end must be >= semantic_start")
        if self.semantic_start <= self.im_end <= self.semantic_end:
            raise ValueError("<|im_end|> must lie outside the semantic range")

    @property
    def n_semantic(self) -> int:
        return self.semantic_end - self.semantic_start + 1


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The whole DualAR model: slow AR (text), fast AR (audio decoder), token ids."""

    slow: TransformerConfig
    fast: TransformerConfig
    ids: TokenIds = field(default_factory=TokenIds)
    num_codebooks: int = 10
    name: str = "custom"

    def __post_init__(self) -> None:
        _positive(self, "num_codebooks")
        if self.fast.vocab_size < self.ids.n_semantic:
            raise ValueError(
                f"fast vocab ({self.fast.vocab_size}) must cover the {self.ids.n_semantic} semantic codes")
        if self.ids.semantic_end >= self.slow.vocab_size or self.ids.im_end >= self.slow.vocab_size:
            raise ValueError("token ids exceed the slow AR vocabulary")
        if self.fast.dim != self.slow.dim:
            # S2-Pro has equal widths and no fast_project_in; we do not support the other case.
            raise ValueError(f"fast dim ({self.fast.dim}) must equal slow dim ({self.slow.dim})")
        if self.fast.max_seq_len < self.num_codebooks:
            raise ValueError("fast max_seq_len must cover num_codebooks positions")

    @property
    def codebook_size(self) -> int:
        return self.fast.vocab_size

    @property
    def frame_rows(self) -> int:
        """Rows of a prompt/frame column: the token id plus one row per codebook."""
        return 1 + self.num_codebooks

    def num_params(self) -> int:
        return (self.slow.num_params() + self.fast.num_params()
                + self.num_codebooks * self.codebook_size * self.slow.dim
                + self.fast.vocab_size * self.fast.dim)

    def with_max_seq_len(self, n: int) -> ModelConfig:
        return replace(self, slow=replace(self.slow, max_seq_len=n))

    # ----------------------------------------------------------------- checkpoint reader
    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelConfig:
        """Read an S2 `config.json` (`model_type: fish_qwen3_omni`) from a file or directory."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        raw = json.loads(p.read_text())
        return cls.from_dict(raw, name=p.parent.name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "checkpoint") -> ModelConfig:
        if raw.get("model_type") != "fish_qwen3_omni":
            raise ValueError(
                f"unsupported model_type {raw.get('model_type')!r}: expected 'fish_qwen3_omni' (Fish Audio S2)")
        try:
            tc, ac = raw["text_config"], raw["audio_decoder_config"]
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None

        def need(d: dict, key: str, where: str) -> Any:
            if key not in d:
                raise ValueError(f"config.json: {where}.{key} is missing")
            return d[key]

        slow = TransformerConfig(
            n_layer=need(tc, "n_layer", "text_config"), dim=need(tc, "dim", "text_config"),
            n_head=need(tc, "n_head", "text_config"),
            n_local_heads=tc.get("n_local_heads", tc["n_head"]),
            head_dim=tc.get("head_dim", tc["dim"] // tc["n_head"]),
            intermediate_size=need(tc, "intermediate_size", "text_config"),
            vocab_size=need(tc, "vocab_size", "text_config"),
            rope_base=float(tc.get("rope_base", 1e6)), norm_eps=float(tc.get("norm_eps", 1e-6)),
            max_seq_len=int(tc.get("max_seq_len", 32768)),
            qk_norm=bool(tc.get("attention_qk_norm", False)))
        for flag in ("attention_qkv_bias", "attention_o_bias"):
            if tc.get(flag) or ac.get(flag):
                raise ValueError(f"config.json sets {flag}: biases are not part of S2 and unsupported")
        if not tc.get("tie_word_embeddings", True):
            raise ValueError("config.json: untied slow-AR output is not part of S2 and unsupported")
        n_cb = int(need(ac, "num_codebooks", "audio_decoder_config"))
        # The reference reader takes the fast AR's rope_base / norm_eps from the slow side.
        fast = TransformerConfig(
            n_layer=need(ac, "n_layer", "audio_decoder_config"),
            dim=need(ac, "dim", "audio_decoder_config"),
            n_head=need(ac, "n_head", "audio_decoder_config"),
            n_local_heads=ac.get("n_local_heads", ac["n_head"]),
            head_dim=ac.get("head_dim", ac["dim"] // ac["n_head"]),
            intermediate_size=need(ac, "intermediate_size", "audio_decoder_config"),
            vocab_size=need(ac, "vocab_size", "audio_decoder_config"),
            rope_base=slow.rope_base, norm_eps=slow.norm_eps, max_seq_len=max(n_cb, 11),
            qk_norm=bool(ac.get("attention_qk_norm", False)))
        if ac.get("text_dim", slow.dim) != slow.dim:
            raise ValueError("config.json: audio_decoder_config.text_dim differs from text_config.dim")
        ids = TokenIds(
            im_end=int(raw.get("eos_token_id", 151645)), pad=int(raw.get("pad_token_id", 151669)),
            audio_pad=int(raw.get("audio_pad_token_id", 151677)),
            semantic_start=int(need(raw, "semantic_start_token_id", "")),
            semantic_end=int(need(raw, "semantic_end_token_id", "")))
        return cls(slow=slow, fast=fast, ids=ids, num_codebooks=n_cb, name=name)

    def to_dict(self) -> dict[str, Any]:
        """The S2 `config.json` layout (the keys the reference reader uses)."""

        def tdict(t: TransformerConfig) -> dict[str, Any]:
            return {"n_layer": t.n_layer, "dim": t.dim, "n_head": t.n_head,
                    "n_local_heads": t.n_local_heads, "head_dim": t.head_dim,
                    "intermediate_size": t.intermediate_size, "vocab_size": t.vocab_size,
                    "rope_base": t.rope_base, "norm_eps": t.norm_eps, "max_seq_len": t.max_seq_len,
                    "attention_qk_norm": t.qk_norm, "attention_qkv_bias": False,
                    "attention_o_bias": False}

        tc = tdict(self.slow) | {"tie_word_embeddings": True, "model_type": "fish_qwen3"}
        ac = tdict(self.fast) | {"num_codebooks": self.num_codebooks, "text_dim": self.slow.dim,
                                 "model_type": "fish_qwen3_audio_decoder"}
        return {"model_type": "fish_qwen3_omni", "text_config": tc, "audio_decoder_config": ac,
                "eos_token_id": self.ids.im_end, "pad_token_id": self.ids.pad,
                "audio_pad_token_id": self.ids.audio_pad,
                "semantic_start_token_id": self.ids.semantic_start,
                "semantic_end_token_id": self.ids.semantic_end, "dtype": "bfloat16"}


# ----------------------------------------------------------------------------- presets
# The built-in tokenizer for `tiny` is byte-level: ids 0..255 are bytes, the 35 Qwen3/fish
# special tokens follow at 256.., then the 4096 semantic tokens (see engine/tokenizer.py).
TINY_SPECIAL_BASE = 256
TINY_IDS = TokenIds(im_end=TINY_SPECIAL_BASE + 2, pad=TINY_SPECIAL_BASE + 26,
                    audio_pad=TINY_SPECIAL_BASE + 34, semantic_start=TINY_SPECIAL_BASE + 35,
                    semantic_end=TINY_SPECIAL_BASE + 35 + 4095)


def _tiny() -> ModelConfig:
    vocab = ((TINY_IDS.semantic_end + 1 + 127) // 128) * 128  # padded like the real table
    return ModelConfig(
        slow=TransformerConfig(n_layer=2, dim=128, n_head=4, n_local_heads=2, head_dim=48,
                               intermediate_size=384, vocab_size=vocab, max_seq_len=4096,
                               qk_norm=True),
        fast=TransformerConfig(n_layer=2, dim=128, n_head=4, n_local_heads=1, head_dim=40,
                               intermediate_size=256, vocab_size=4096, max_seq_len=11),
        ids=TINY_IDS, name="tiny")


def _s2_pro() -> ModelConfig:
    return ModelConfig(
        slow=TransformerConfig(n_layer=36, dim=2560, n_head=32, n_local_heads=8, head_dim=128,
                               intermediate_size=9728, vocab_size=155776, max_seq_len=32768,
                               qk_norm=True),
        fast=TransformerConfig(n_layer=4, dim=2560, n_head=32, n_local_heads=8, head_dim=128,
                               intermediate_size=9728, vocab_size=4096, max_seq_len=11),
        ids=TokenIds(), name="s2-pro")


PRESETS = {"tiny": _tiny, "s2-pro": _s2_pro}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


# ----------------------------------------------------------------------------- the engine
DTYPE_NAMES = ("bf16", "bfloat16", "fp32", "float32", "fp16", "float16")  # engine.loader.DTYPES
# the model dtypes a service may ask for: the float ones, or FP8 linears (engine/quant.py)
PRECISION_NAMES = (*DTYPE_NAMES, "fp8")

@dataclass(slots=True)
class EngineConfig:
    """How an engine batches, schedules, chunks audio and which speed-ups it applies. Each
    field is declared once here (engine/options.py); the service's `--flags` and
    `RTVOICE_*` variables are derived from these declarations."""

    max_running: int | None = option(
        None, "decode rows = turns speaking at once. A session holds a row only while a turn "
        "speaks; idle sessions hold KV blocks (kv_blocks) but no row, and a turn that finds "
        "every row taken waits for one. Default: 8 on a CPU, 64 on a GPU", ge=1)
    max_len: int | None = option(
        None, "KV positions per session (voice prompt + turns); default min(4096, the "
        "model's context). A session's chunk_length is capped so that a segment always fits",
        ge=128)
    max_waiting: int = option(64, "sessions that may wait for KV blocks for their voice prompt "
                              "before new ones get 'overloaded'", ge=0)
    kv_block_size: int = option(64, "positions per block of the paged KV pool", ge=1, le=4096)
    kv_blocks: int | None = option(
        None, "blocks in the KV pool, shared by every session (a 10 s voice prompt is ~6 "
        "blocks of 64). Default: what fits in GPU memory after kv_reserve_gib, at most 32 "
        "full contexts (max_len) per decode row; on a CPU, 2 per decode row", ge=1)
    kv_host_gib: float = option(
        16.0, "host memory (GiB) for the KV of idle sessions evicted when the pool runs low, "
        "least recently used first; restored with their next turn. 0: never evict (sessions "
        "beyond the pool wait for blocks)", ge=0)
    prefix_cache: int = option(
        256, "voice prompts kept in the pool for sharing: sessions with the same voice (a "
        "stored voice, or identical inline references) share one copy of its KV, copy-on-"
        "write, and open without prefilling it; 0: every session prefills its own", ge=0)
    prefill_ahead: bool = option(
        True, "while an idle session's next sentence is still streaming in, prefill the part "
        "of its prompt the text so far fixes (up to its last word), so that when the sentence "
        "is complete only the rest is prefilled before it speaks; speculative (free blocks "
        "only, after every other prefill; a turn that begins otherwise rolls it back)")
    prefill_chunk: int = option(256, "prompt columns per prefill round and sequence, so one "
                                "long prompt cannot hold up the others", ge=1)
    prefill_batch: int = option(16, "sequences prefilled together in one forward", ge=1)
    first_chunk_frames: int = option(
        1, "codec frames in a turn's first audio chunk: one frame is first audio one decode "
        "step sooner (H200, c=64 burst: submit->audio 161 -> 104 ms p50)", ge=1)
    slow_start_x: float = option(
        2.0, "while streams generate slower than this many times realtime, a turn's first "
        "chunk is twice first_chunk_frames: chunks grow from the first one, and a one-frame "
        "start leaves too thin a buffer when the first full-size chunk is due at a slow rate "
        "(2-core CPU, c=8 at 1.7x realtime: 5 and 9 of 24 turns starved with one frame, 0 "
        "with two); 0: never", ge=0)
    chunk_frames: int = option(8, "codec frames in later audio chunks", ge=1)
    codec_hold_s: float = option(
        1.0, "a stream more than this many seconds of audio ahead of realtime playback lets "
        "its chunk wait (up to 2 x chunk_frames) for a fuller batched codec tick (never one "
        "carrying a turn's first chunk, which it would lengthen); keep it well "
        "above the clients' jitter buffer; 0: every chunk is decoded as soon as it is ready",
        ge=0)
    prefill_first_lead_s: float = option(
        0.5, "prefill first: while prompts are prefilling, decode steps pause if every running "
        "turn's audio is at least this many seconds ahead of realtime playback (a burst of new "
        "turns gets the GPU to itself: lower TTFA); keep it above a chunk's duration (the "
        "codec lags generation by up to a chunk); 0: prefill and decode always share the GPU",
        ge=0)
    prefill_first_wait_s: float = option(
        0.05, "longest a turn whose prompt is in waits for its first frames while other "
        "prompts prefill (seconds)", ge=0)
    max_turn_frames: int = option(2048, "hard cap of one turn (segment) in frames; 21.5 "
                                  "frames = 1 s of audio", ge=1)
    seed: int = option(0, "seed of the random-weight presets and of sessions that send none",
                       ge=0)
    pingpong: bool = option(True, "prefill, decode and codec on their own threads and CUDA "
                            "streams; off: one thread runs them in turn (the naive loop)")
    cuda_graphs: bool = option(True, "the decode step as CUDA graphs, one per (batch, span) "
                               "bucket (CUDA only)")
    prefill_graphs: bool = option(True, "prefill chunks as CUDA graphs per (rows, columns, "
                                  "span) bucket (CUDA only)")
    codec_graphs: bool = option(True, "codec ticks as CUDA graphs per (streams, frames) "
                                "bucket (CUDA only)")
    ready_rows: int = option(
        1, "fast start: before the engine is ready it captures the decode, prefill and codec "
        "graphs of at most this many rows / sequences / streams per replay (prefill: over "
        "spans short of the whole context); the bigger buckets are captured while it serves "
        "(prefill and codec on a background thread, the decode step on the decode thread "
        "between two steps while no turn needs it; /ready lists them under 'warming'), their work "
        "meanwhile split over the captured ones or run eagerly; 0: capture everything "
        "before ready", ge=0)
    codec_call_frames: int | None = option(
        None, "most streams x frames the codec decodes in one pass without graphs: bounds "
        "its working memory (a CPU's heap keeps what its biggest pass once took: 56 sessions "
        "on the tiny model, RSS 1.5 GB unbounded, see docs/RELIABILITY.md); 0: a tick in one "
        "pass. Default: 64 on a CPU, 0 on a GPU", ge=0)
    one_row_bucket: bool = option(
        False, "with compiled ops, a decode-step bucket of one row too (a lone turn then runs "
        "the one-row step, ~2 % faster than the two-row one on the H200, at the cost of one "
        "more trace of every compiled op before ready); reference ops always have it")
    span_step: int = option(256, "attention-span bucket of the decode step's torch attention "
                            "(with csrc's attention one span is captured)", ge=1)
    fused_ops: str = option("auto", "the model's elementwise ops: compile (torch.compile'd, "
                            "and one GEMM over W1|W3), reference, or auto (compile on CUDA)",
                            choices=("auto", "compile", "reference"))
    cuda_kernels: bool = option(True, "csrc's CUDA kernels where the extension builds (false: "
                                "the torch fallbacks everywhere)")
    sampler_kernel: bool = option(True, "the sampler's draw as csrc's sample_topk instead of "
                                  "the compiled torch version (with fused ops; H200 top-k per "
                                  "step 0.57 -> 0.47 ms at batch 1, 0.80 -> 0.62 at 64)")
    codec_kernels: bool = option(True, "the codec's Snake activations and the residual units' "
                                 "conv biases as csrc's one-pass kernels, written straight "
                                 "into the next conv's input (64x8 tick 32.6 -> 27.6 ms)")
    codec_conv_kernel: bool = option(
        True, "the codec's residual-unit convs as a Triton implicit-GEMM conv over "
        "channels-last activations with the Snake or the residual sum in its epilogue, where "
        "the recorded table (engine/kernels/codec_conv_table.json) measured it faster than "
        "cuDNN's conv + csrc's pass (CUDA; H200 64x8 tick 17.43 -> 16.62 ms)")
    linear_kernels: bool = option(True, "decode-step linears through csrc's small-M kernel "
                                  "(bf16 and FP8 weights) where the recorded per-shape table "
                                  "(engine/kernels/linear_table.json, written by `python -m "
                                  "bench_latency.linear_bench`) measured it fastest; false: "
                                  "cuBLAS for bf16 and the Triton kernel for FP8 everywhere")
    norm_fusion: bool = option(
        True, "where csrc's small-M kernel runs a block's projections, the residual add goes "
        "into wo / w2's epilogue and (at most 2 rows: where it measured faster) the RMSNorm "
        "after it into the next projection's prologue: two launches fewer per layer (H200, "
        "S2-Pro frame step at batch 1: 729 -> 568 launches, 6.38 -> 6.30 ms)")
    pdl: str = option(
        "auto", "csrc's decode-step kernels (linears, attention, sampling) launched with "
        "programmatic dependent launch (compute capability 9.0+; elsewhere a plain launch): "
        "each starts while the kernel before it ends (same results). on, off, or auto: on for "
        "FP8 weights only, where it measured faster (H200 frame step at batch 1/2: FP8 "
        "5.18/5.22 -> 4.93/5.05 ms; bf16 6.34/6.41 -> 6.15/6.48)",
        choices=("auto", "on", "off"))
    fp8_dense_copy: bool = option(
        True, "with FP8 weights on CUDA: keep a bf16 copy of each FP8 linear's dequantised "
        "weight (the same values; S2-Pro: +8.1 GB, taken from the KV pool) and run it through "
        "the dense kernels at the batch sizes where the linear table measured them faster "
        "than the FP8 ones (H200: wqkv from 17 rows, the other projections from 33); false: "
        "FP8 kernels at every batch size")
    fp8_activations: bool = option(False, "with FP8 weights: decode-step linears may also "
                                   "quantise their activations to e4m3 (per 1x128 block: "
                                   "csrc's small-M kernel in variant 7, with its epilogues, or "
                                   "the W8A8 Triton GEMM; per row: the rowwise-scaled FP8 GEMM on "
                                   "rowwise copies of the weights, made at start for the "
                                   "shapes that take it) where the linear table measured that "
                                   "faster; where that is the prequantised Triton GEMM, the "
                                   "norm before wqkv / w13 and the gate before w2 (or w13's "
                                   "GEMM) quantise in their own launch and w2 / wo add the "
                                   "residual in its epilogue; "
                                   "not the weight-only numerics (the FP8 gate checks these "
                                   "with --w8a8 table)")
    split_kv: bool = option(False, "decode attention splits a row's positions over more "
                            "blocks when the batch is too small to fill the GPU (measured: "
                            "no gain on the H200)")
    decode_rope_rows: int = option(
        DECODE_ROPE_ROWS, "the most rows of a decode step whose q/k norm + RoPE decode attention folds into "
        "its own launch (csrc's kernel, or the Triton one from attention_triton_rows); above "
        "it they take a launch of their own per layer (2: one speaking turn's buckets, "
        "where it measured faster; slower at 64 rows with csrc's kernel, docs/PERF.md)",
        ge=0, le=4096)
    fast_decode_rope_rows: int | None = option(
        None, "the same for the fast AR's attention (csrc's kernel over its <= 11 positions), "
        "apart so that the slow AR's can fold at many rows where the fast AR's measured "
        "slower; default: decode_rope_rows", ge=0, le=4096)
    attention_triton_rows: int = option(
        ATTENTION_TRITON_ROWS, "decode steps of at least this many rows run the slow AR's attention as the "
        "Triton tile kernel (its keys and values through the tensor cores, tiles in flight, "
        "automatic splits) instead of csrc's CUDA-core kernel (CUDA only): on the H200 the "
        "64-row step 8.07 -> 7.59 ms, engine c=64 7,553 -> 7,825 frames/s (docs/PERF.md); "
        "below 16 rows csrc's kernel (with its folded q/k norm + RoPE at 1-2 rows); 0: never",
        ge=0, le=4096)
    attention_shared_prefix: bool = option(
        False, "with attention_triton_rows, speaking rows whose sessions share a voice "
        "prompt's KV (one stored voice, or identical inline references) read it once per "
        "tile of 16 rows instead of once per row (cascade attention); off: it measured slower "
        "than reading it per row on the H200 (docs/PERF.md)")
    stall_s: float = option(10.0, "a device wait, or one pass of a worker thread's loop (a "
                            "step, codec tick or prefill round), longer than this marks the "
                            "engine stalled (/ready 503)", gt=0)
    kv_reserve_gib: float = option(
        32.0, "GPU memory (GiB) kept out of the KV pool for activations, CUDA graphs and the "
        "codec (128 decode rows and their codec graphs need more than 8); the pool takes the "
        "rest, within kv_blocks", ge=0)
    high_priority_streams: tuple[str, ...] = option(
        (), "CUDA streams whose kernels the block scheduler starts first (measured at c=64: "
        "any choice within 4 % frames/s; none had the lowest latency)",
        choices=("decode", "prefill", "codec"))

    def __post_init__(self) -> None:
        if isinstance(self.high_priority_streams, list):
            self.high_priority_streams = tuple(self.high_priority_streams)
        validate(self)

    def resolved(self, *, cuda: bool, model_len: int) -> EngineConfig:
        """A copy with the device-dependent defaults filled in."""
        call = self.codec_call_frames
        fast_rope = self.fast_decode_rope_rows
        return replace(self, max_running=self.max_running or (64 if cuda else 8),
                       fast_decode_rope_rows=(self.decode_rope_rows if fast_rope is None
                                              else fast_rope),
                       max_len=min(self.max_len or 4096, model_len),
                       codec_call_frames=(0 if cuda else 64) if call is None else call)
