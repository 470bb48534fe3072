"""Tokenizers (built-in byte-level and the checkpoint's BPE) and the S2 prompt layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.prompt import PromptBuilder, Reference
from engine.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError

TEXTS = {
    "en": "Hello world. How are you today?",
    "ar": "مرحبا بالعالم. كيف حالك اليوم؟",
    "zh": "你好，世界。今天天气很好。",
    "ja": "こんにちは、世界。今日はいい天気ですね。",
}


@pytest.mark.parametrize("lang", TEXTS)
def test_byte_tokenizer_roundtrip(lang):
    tok = ByteTokenizer()
    ids = tok.encode(TEXTS[lang])
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == TEXTS[lang]


@pytest.mark.parametrize("lang", TEXTS)
def test_checkpoint_tokenizer_roundtrip(lang, fixture_dir):
    tok = HFTokenizer(fixture_dir)
    assert tok.decode(tok.encode(TEXTS[lang])) == TEXTS[lang]


def test_special_tokens_match_whole(fixture_dir):
    for tok in (ByteTokenizer(), HFTokenizer(fixture_dir)):
        ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
        assert ids[0] == tok.token_to_id("<|im_start|>")
        assert ids[-1] == tok.ids.im_end
        # speaker tags are plain text, not tokens
        assert len(tok.encode("<|speaker:0|>")) > 1
    with pytest.raises(TokenizerError):
        ByteTokenizer().token_to_id("<|nope|>")


def test_byte_tokenizer_ids_layout():
    tok = ByteTokenizer()
    assert tok.ids.semantic_end - tok.ids.semantic_start == 4095
    assert tok.token_to_id("<|semantic:7|>") == tok.ids.semantic_start + 7
    s2 = ByteTokenizer(special_base=151643)
    assert (s2.ids.im_end, s2.ids.semantic_start, s2.ids.pad) == (151645, 151678, 151669)


@pytest.mark.parametrize("name", ["a_text_en", "b_ref_zh", "c_multispeaker", "d_two_turns"])
def test_prompt_layout_every_case(name, fixture_dir):
    tok = HFTokenizer(fixture_dir)
    pb = PromptBuilder(tok)
    case = json.loads((fixture_dir / "cases" / f"{name}.json").read_text())
    t = load_file(str(fixture_dir / "cases" / f"{name}.safetensors"))
    refs = [Reference(r["text"], t[r["tensor"]]) for r in case["references"]]
    hist = []
    for k, b in enumerate(case["batches"]):
        p = pb.build(b["batch_text"], refs, hist)
        assert torch.equal(p, t[f"b{k}.prompt"])
        assert tok.decode(p[0].tolist()) == b["prompt_decoded"]
        hist.append((b["batch_text"], t[f"b{k}.codes"]))


def test_incremental_prompt_equals_whole(fixture_dir):
    """system + user_turn + assistant_close + user_turn == build(history) (KV-kept turns)."""
    pb = PromptBuilder(HFTokenizer(fixture_dir))
    codes = torch.randint(0, 1024, (10, 6))
    refs = [Reference("A voice.", torch.randint(0, 1024, (10, 4))),
            Reference("<|speaker:3|>Tagged.", torch.randint(0, 1024, (10, 3)))]
    whole = pb.build("second", refs, [("first", codes)])
    parts = torch.cat([pb.system(refs), pb.user_turn("first"), pb.assistant_close(codes),
                       pb.user_turn("second")], dim=1)
    assert torch.equal(whole, parts)
    text = pb.tok.decode(pb.system(refs)[0].tolist())
    assert "<|speaker:0|>A voice.\n<|speaker:3|>Tagged." in text
    assert "<|speaker:1|>" not in text


def test_prompt_rejects_bad_codes():
    pb = PromptBuilder(ByteTokenizer())
    with pytest.raises(ValueError, match="codes must be"):
        pb.vq(torch.zeros(9, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        pb.vq(torch.full((10, 3), 5000))
    with pytest.raises(ValueError):
        Reference("x", torch.zeros(10, 3))  # float codes


@pytest.mark.parametrize("name", ["a_text_en", "b_ref_zh", "c_multispeaker", "d_two_turns"])
def test_case_text_is_split_into_the_reference_batches(name, fixture_dir):
    """A case's whole text becomes the turns the reference generated: speaker turns split at
    each tag, stripped, joined with a newline, grouped by chunk_length (d_two_turns: 30
    bytes, two batches); text without a tag is one batch as it is."""
    from engine.prompt import speaker_batches

    case = json.loads((fixture_dir / "cases" / f"{name}.json").read_text())
    want = [b["batch_text"] for b in case["batches"]]
    assert speaker_batches(case["text"], case["chunk_length"]) == want


def test_two_speaker_turn_token_ids_match_the_reference(fixture_dir):
    """The raw two-speaker text, given as one turn, is prepared like the reference's and
    tokenizes to the reference prompt's ids exactly (c_multispeaker: its prompt was built from
    '<|speaker:0|>Hi.\\n<|speaker:1|>Hello.')."""
    tok = HFTokenizer(fixture_dir)
    pb = PromptBuilder(tok)
    case = json.loads((fixture_dir / "cases" / "c_multispeaker.json").read_text())
    t = load_file(str(fixture_dir / "cases" / "c_multispeaker.safetensors"))
    refs = [Reference(r["text"], t[r["tensor"]]) for r in case["references"]]
    assert "\n" not in case["text"]  # the joining newline is ours to add, as upstream does
    prompt = pb.build(case["text"], refs)
    assert torch.equal(prompt, t["b0.prompt"])
    # spaces around the tags are stripped too; the same ids
    assert torch.equal(pb.user_turn("  <|speaker:0|>Hi. \n <|speaker:1|>Hello.  "),
                       pb.user_turn(case["text"]))


def test_speaker_turns_edge_cases():
    from engine.prompt import speaker_batches, speaker_turns, turn_text

    assert speaker_turns("Plain text.") == [] and turn_text(" Plain ") == " Plain "
    # text before the first tag is kept (the reference would drop it)
    assert speaker_turns("Intro. <|speaker:1|> Hi <|speaker:0|>") == [
        "Intro.", "<|speaker:1|> Hi", "<|speaker:0|>"]
    six = "".join(f"<|speaker:{i % 2}|>Line {i}." for i in range(6))
    assert [b.count("<|speaker") for b in speaker_batches(six, 10_000)] == [5, 1]  # 5 a batch
    long = "<|speaker:0|>" + "x" * 40 + "<|speaker:1|>short"
    assert speaker_batches(long, 30) == ["<|speaker:0|>" + "x" * 40, "<|speaker:1|>short"]


def test_pair_format_merges_load(tmp_path):
    """tokenizer.json with merges stored as [left, right] pairs (the fixtures' format, and the
    one newer `tokenizers` writes) loads and encodes: needs tokenizers >= 0.20."""
    vocab = {c: i for i, c in enumerate("abcdehlo ")}
    vocab.update({"he": 9, "ll": 10, "hell": 11})
    doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 12 + i, "content": name, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, name in enumerate(("<|im_start|>", "<|im_end|>"))],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [["h", "e"], ["l", "l"], ["he", "ll"]]},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    from tokenizers import Tokenizer as HF

    tok = HF.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("hello", add_special_tokens=False).ids == [vocab["hell"], vocab["o"]]


def test_piece_tokenizer_has_bpe_like_counts_and_is_the_same_everywhere():
    """The random-weight s2-pro preset's tokenizer: ~4 characters per token of English, one
    per CJK character, the real special and semantic ids, the same ids in every instance,
    and a decode that refuses to guess."""
    from engine.loader import preset_tokenizer
    from engine.tokenizer import ByteTokenizer, PieceTokenizer, TokenizerError

    a, b = PieceTokenizer(151643), PieceTokenizer(151643)
    english = ("Your table for two is booked at eight. Thanks for calling, and have a "
               "wonderful evening with your family!")
    ids = a.encode(english)
    assert 3.0 <= len(english) / len(ids) <= 5.0
    assert ids == b.encode(english)  # a hash, not an encounter order
    assert len(a.encode("你好，今天有什么可以帮你？")) == 13
    assert a.pieces("internationalization") == ["inter", "natio", "naliz", "ation"]
    s = "<|im_start|>user\nHello world.<|im_end|><|semantic:7|>"
    ids = a.encode(s)
    assert ids[0] == 151644 and ids[-2] == a.ids.im_end and ids[-1] == a.ids.semantic_start + 7
    assert a.decode(ids) == s
    assert max(i for i in ids if i < 151643) < 151643
    with pytest.raises(TokenizerError, match="no piece"):
        PieceTokenizer(151643).decode([ids[2]])
    c = PieceTokenizer(300)  # a tiny id space: pieces must collide
    c.encode(" ".join(f"w{i}" for i in range(400)))
    shared = next(i for i, p in c._seen.items() if p is None)
    with pytest.raises(TokenizerError, match="several pieces"):
        c.decode([shared])
    assert isinstance(preset_tokenizer("s2-pro", 151643), PieceTokenizer)
    assert isinstance(preset_tokenizer("tiny", 512), ByteTokenizer)
