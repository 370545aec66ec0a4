"""Tokenizer edge cases against HF transformers (golden/tokenizers, made by
scripts/make_tokenizer_golden.py) and against sentencepiece itself: SentencePiece GGUFs, unknown
GGUF pre-tokenizers, and the BOS a tokenizer.json's own configuration adds."""

import json

import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from tqjax.errors import TqjaxError
from tqjax.models.loading import read_gguf
from tqjax.models.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

from .conftest import GOLDEN
from .test_gguf_file import reader_header

TOK = GOLDEN / "tokenizers"
SPM_MODEL = TOK / "spm" / "tokenizer.model"
# Texts on which sentencepiece and HF agree: no leading whitespace or user-defined piece (HF's
# Metaspace adds no U+2581 then) and no "<s>"-style control literals (HF matches them whole).
PLAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "x1y22z333 4444 -5.5e-3 0x1F",
    "multi   space\t\ttabs\r\nCRLF and trailing  ",
    "Ωμέγα Привет مرحبا नमस्ते 한국어 ありがとう",
    "emoji 🦀🧪🏳️‍🌈 and combining é vs é",
    "ends with newline\n",
    "a<|user|><|user|>glued<|user|>",
    "Hamlet: To be, or not to be, that is the question:\nWhether 'tis nobler in the mind",
]


def _proto():
    proto = pb.ModelProto()
    proto.ParseFromString(SPM_MODEL.read_bytes())
    return proto


def _write_spm_gguf(path, proto, **extra):
    """A GGUF with `proto`'s pieces as tokenizer.ggml.* metadata, written by gguf's GGUFWriter."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([p.piece for p in proto.pieces])
    w.add_token_scores([p.score for p in proto.pieces])
    w.add_token_types([p.type for p in proto.pieces])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(proto.pieces), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reader_header(path)[0]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tiny.gguf"
    return tokenizer_from_gguf(_write_spm_gguf(path, _proto(), add_space_prefix=True))


def test_text_that_is_not_unicode_is_a_user_error(spm_gguf):
    """A lone surrogate (undecodable bytes in argv, "\\ud800" in a JSON body) is a one-line
    TqjaxError naming where it is (the `tokenizers` backend raised a TypeError)."""
    for text, at in (("ab\ud800", 2), ("\udcff rest", 0)):
        with pytest.raises(TqjaxError, match=f"not valid Unicode: surrogates not allowed at "
                                             f"character {at}$"):
            spm_gguf.encode(text)
    assert spm_gguf.encode("ab", add_bos=False) == spm_gguf.encode("ab")[1:]


def test_read_gguf_metadata_is_the_readers(tmp_path):
    """read_gguf's metadata has the same keys, values and Python types as gguf.GGUFReader's
    own, scores (floats) bit for bit."""
    path = tmp_path / "tiny.gguf"
    direct = _write_spm_gguf(path, _proto(), add_space_prefix=True)
    meta, tensors = read_gguf(path)
    assert meta == direct and list(meta) == list(direct)
    for key, value in direct.items():
        again = meta[key]
        assert type(again) is type(value), key
        if isinstance(value, list):
            assert [type(x) for x in again] == [type(x) for x in value], key
    scores = np.asarray(meta["tokenizer.ggml.scores"], np.float32)
    assert np.array_equal(scores.view(np.uint32),
                          np.asarray(direct["tokenizer.ggml.scores"], np.float32).view(np.uint32))
    assert list(tensors) == ["model.embed_tokens.weight"]


# ------------------------------------------------------------------------- SentencePiece GGUFs
def test_sentencepiece_gguf_matches_hf(spm_gguf):
    golden = json.loads((TOK / "spm.json").read_text())
    assert golden["hf_add_bos_token"] and spm_gguf.add_bos and spm_gguf.bos_id == 1
    for item in golden["items"]:
        text = item["text"]
        assert spm_gguf.encode(text) == item["hf_ids"], text
        assert spm_gguf.encode(text, add_bos=False) == item["hf_ids_no_special"], text
        assert spm_gguf.encode(text, add_bos=True) == [1, *item["hf_ids_no_special"]], text
        assert spm_gguf.decode(item["hf_ids_no_special"]) == item["hf_decoded"], text
        assert (spm_gguf.decode(item["hf_ids"], skip_special=False)
                == item["hf_decoded_with_special"]), text
    # where HF itself departs from sentencepiece (leading spaces, "<s>" typed in the text)
    differ = [i["text"] for i in golden["items"]
              if i["hf_ids_no_special"] != i["sentencepiece_ids"]]
    assert differ == ["<s>literal</s> and <unk> markers", " leading space", "  two leading spaces",
                      " "]


def test_sentencepiece_token_bytes_make_up_the_text(spm_gguf):
    """Each token's bytes (byte pieces <0xNN> for what the vocabulary lacks, "▁" as a
    space) joined are the text, with the space SentencePiece adds in front."""
    golden = json.loads((TOK / "spm.json").read_text())
    for item in golden["items"]:
        ids = item["hf_ids_no_special"]
        joined = b"".join(map(spm_gguf.token_bytes, ids)).decode("utf-8")
        assert joined.removeprefix(" ") == spm_gguf.decode(ids, skip_special=False), item["text"]


def test_sentencepiece_gguf_matches_sentencepiece(spm_gguf):
    sp = spm.SentencePieceProcessor(model_file=str(SPM_MODEL))
    golden = json.loads((TOK / "spm.json").read_text())
    texts = PLAIN_TEXTS + [i["text"] for i in golden["items"]
                           if i["hf_ids_no_special"] == i["sentencepiece_ids"]]
    for text in texts:
        ids = sp.encode(text)
        assert spm_gguf.encode(text, add_bos=False) == ids, text
        assert spm_gguf.decode(ids) == sp.decode(ids) == text, text
    # the byte fallback is really exercised: characters never seen in training become <0xNN>
    ids = spm_gguf.encode("🦀🧪", add_bos=False)
    assert [sp.id_to_piece(i) for i in ids] == ["\u2581"] + [
        f"<0x{b:02X}>" for b in "🦀🧪".encode()]


def test_sentencepiece_gguf_without_space_prefix(tmp_path):
    proto = _proto()
    tok = tokenizer_from_gguf(_write_spm_gguf(tmp_path / "t.gguf", proto, add_space_prefix=False,
                                              add_bos_token=False))
    proto.normalizer_spec.add_dummy_prefix = False
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    for text in PLAIN_TEXTS:
        assert tok.encode(text) == sp.encode(text), text  # no BOS: add_bos_token false
        assert tok.decode(sp.encode(text)) == text
    assert tok.encode("Hello")[0] != tokenizer_from_gguf(
        _write_spm_gguf(tmp_path / "u.gguf", _proto())).encode("Hello", add_bos=False)[0]


def test_sentencepiece_gguf_add_eos(tmp_path):
    tok = tokenizer_from_gguf(_write_spm_gguf(tmp_path / "t.gguf", _proto(), add_eos_token=True))
    sp = spm.SentencePieceProcessor(model_file=str(SPM_MODEL))
    for text in PLAIN_TEXTS:
        assert tok.encode(text) == [1, *sp.encode(text), 2], text
        assert tok.encode(text, add_bos=False) == sp.encode(text), text


def test_sentencepiece_gguf_saved_as_tokenizer_json(spm_gguf, tmp_path):
    spm_gguf.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    again = tokenizer_from_hf_dir(tmp_path, (), None)
    assert (again.bos_id, again.add_bos) == (1, True)
    for text in PLAIN_TEXTS:
        assert again.encode(text) == spm_gguf.encode(text)
        assert again.decode(again.encode(text)) == text


def test_gguf_tokenizer_errors():
    proto = _proto()
    meta = {"tokenizer.ggml.model": "llama", "general.architecture": "gemma",
            "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
            "tokenizer.ggml.scores": [p.score for p in proto.pieces]}
    with pytest.raises(TqjaxError, match="'gemma'"):
        tokenizer_from_gguf(meta)
    with pytest.raises(TqjaxError, match="'bert'"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.model": "bert"})
    # a weights-only GGUF has no vocabulary: no tokenizer, not a KeyError
    assert tokenizer_from_gguf({"general.architecture": "llama"}) is None


def test_end_of_generation_ids_are_llama_cpps():
    """A GGUF names one eos, but generation ends on llama.cpp's whole set: the named eos, eot
    and eom ids (eos first), the FIM pad, repo and file-separator tokens (named, else the first
    by text) and every token whose text is an end-of-turn or end-of-text (Qwen2.5 emits
    <|endoftext|>, which was not an end: generation ran on into a new reply)."""
    from tqjax.models.tokenizer import end_of_generation_ids

    tokens = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<|fim_repo|>", "a", "<|eot_id|>", "b"]
    assert end_of_generation_ids({"tokenizer.ggml.eos_token_id": 3}, tokens) == (
        3, 4, 5, 6, 1, 9)
    named = {"tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.eot_token_id": 10,
             "tokenizer.ggml.fim_pad_token_id": 8}
    assert end_of_generation_ids(named, tokens) == (3, 10, 8, 5, 6, 1, 9)
    assert end_of_generation_ids({}, ["a", "b"]) == ()
    # an id outside the vocabulary is dropped, not kept to be compared with forever
    assert end_of_generation_ids({"tokenizer.ggml.eos_token_id": 99}, ["a"]) == ()


# ------------------------------------------------------------------------ GGUF pre-tokenizers
def _bpe_meta(pre):
    alphabet = [chr(c) for c in range(33, 127)] + ["Ġ"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": alphabet,
            "tokenizer.ggml.merges": []}
    return meta if pre is None else {**meta, "tokenizer.ggml.pre": pre}


def test_unknown_pretokenizer_is_an_error():
    with pytest.raises(TqjaxError) as err:
        tokenizer_from_gguf(_bpe_meta("made-up-bpe"))
    msg = str(err.value)
    assert "\n" not in msg and "'made-up-bpe'" in msg
    assert all(name in msg for name in ("qwen2", "llama-bpe", "smaug-bpe", "smollm", "gpt-2"))


# Pieces of "I'm 12345 ok!!\n\n  x" under each split, written out from the regexes in llama.cpp's
# src/llama-vocab.cpp (GPT-2: ` ?\p{N}+`; Qwen2: `\p{N}`; Llama 3: `\p{N}{1,3}` and
# ` ?[^\s\p{L}\p{N}]+[\r\n]*`; SmolLM: digits one by one, then GPT-2).
TEXT = "I'm 12345 ok!!\n\n  x"
GPT2_PIECES = ["I", "'m", " 12345", " ok", "!!", "\n\n ", " x"]
QWEN2_PIECES = ["I", "'m", " ", "1", "2", "3", "4", "5", " ok", "!!\n\n", " ", " x"]
LLAMA3_PIECES = ["I", "'m", " ", "123", "45", " ok", "!!\n\n", " ", " x"]
SMOLLM_PIECES = ["I", "'m", " ", "1", "2", "3", "4", "5", " ok", "!!", "\n\n ", " x"]


@pytest.mark.parametrize("pre,pieces", [
    (None, GPT2_PIECES), ("default", GPT2_PIECES), ("gpt-2", GPT2_PIECES),
    ("qwen2", QWEN2_PIECES), ("deepseek-r1-qwen", QWEN2_PIECES),
    ("llama-bpe", LLAMA3_PIECES), ("llama3", LLAMA3_PIECES), ("smaug-bpe", LLAMA3_PIECES),
    ("smollm", SMOLLM_PIECES), ("starcoder", SMOLLM_PIECES)])
def test_known_pretokenizers_split_as_llama_cpp(pre, pieces):
    tok = tokenizer_from_gguf(_bpe_meta(pre))
    got = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(TEXT)]
    byte_level = {" ": "Ġ", "\n": "Ċ"}
    assert got == ["".join(byte_level.get(c, c) for c in p) for p in pieces]


# ------------------------------------------------------------ BOS from the tokenizer's own config
@pytest.mark.parametrize("case", json.loads((TOK / "llama3.json").read_text())["cases"])
def test_llama3_tokenizer_json_bos_matches_hf(case, tmp_path):
    golden = json.loads((TOK / "llama3.json").read_text())
    spec = golden["cases"][case]
    tj = json.loads((TOK / "llama3" / "tokenizer.json").read_text())
    if not spec["post_processor"]:
        tj["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": golden["bos_token"], "eos_token": golden["eos_token"],
         "tokenizer_class": "PreTrainedTokenizerFast", **spec["config"]}))
    tok = tokenizer_from_hf_dir(tmp_path, (), None)
    bos = tok.backend.token_to_id(golden["bos_token"])
    assert tok.bos_id == bos and tok.add_bos == spec["post_processor"]
    for item in spec["items"]:
        text = item["text"]
        assert tok.encode(text) == item["hf_ids"], text
        assert tok.encode(text, add_bos=False) == item["hf_ids_no_special"], text
        assert tok.encode(text, add_bos=True) == [bos, *item["hf_ids_no_special"]], text
        ids = tok.encode(text, add_bos=False)  # each token's bytes make up the text
        assert b"".join(map(tok.token_bytes, ids)) == text.encode(), text
        for add_bos in (None, False, True):  # the server's call (in a worker thread)
            assert (tok.encode(text, add_bos, release_gil=True)
                    == tok.encode(text, add_bos)), text
    # Llama 3: the BOS is there by default, from the post-processor
    assert (tok.encode("Hello")[0] == bos) == spec["post_processor"]


# ------------------------------------------------------------------- incremental detokenizing
class _CountingDecodes:
    """A tokenizer that counts the ids it decodes."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, skip_special=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _stream(tok, ids, stop):
    """api._TextStream fed one more token at a time, as generation does: (pieces, tokens fed,
    whether it stopped)."""
    from tqjax.api import _TextStream

    stream, pieces = _TextStream(tok, stop), []
    for n in range(1, len(ids) + 1):
        if stream.stopped(ids[:n]):
            break
        pieces.append(stream.piece(ids[:n], False))
    pieces.append(stream.piece(ids[:n], True))
    return pieces, n


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_streamed_text_is_the_whole_decode_and_each_step_decodes_only_its_tokens(
        kind, spm_gguf):
    """Streamed pieces join to the tokenizer's decode of all the ids (multi-byte characters
    split over byte tokens, SentencePiece's leading space), and the stream stops where the
    whole decode first holds a stop string; each step decodes a few tokens, not all of them
    again (was quadratic)."""
    tok = spm_gguf if kind == "sentencepiece" else tokenizer_from_hf_dir(TOK / "llama3", (),
                                                                          None)
    ids = [i for t in PLAIN_TEXTS for i in tok.encode(t)]
    whole = tok.decode(ids)
    for stop in ([], ["नमस्ते"], ["🧪🏳", "lazy"], ["\nWhether 'tis"]):
        counting = _CountingDecodes(tok)
        pieces, n = _stream(counting, ids, stop)
        cut = min((whole.find(s) for s in stop if s in whole), default=len(whole))
        assert "".join(pieces) == whole[:cut] and (cut < len(whole)) == bool(stop)
        assert all(s not in tok.decode(ids[:n - 1]) for s in stop)  # it stopped at once
        # linear, but for runs of byte pieces, each decoded again until it closes
        runs = "".join("b" if tok.is_byte_piece(i) else " " for i in ids[:n]).split()
        bound = 8 * n + 2 * sum((len(r) + 2) ** 2 for r in runs)
        assert counting.decoded <= bound, (counting.decoded, bound, n)
        assert stop or bound < n * n / 8  # (the whole text: far below decoding all per step)


def test_streaming_holds_back_only_what_may_begin_a_stop_string():
    """Not the stop string's length minus one at every step (a 32-character stop made the
    stream come in lumps): only the end of the text that is the start of a stop string."""
    from tqjax.api import _TextStream

    tok = tokenizer_from_hf_dir(TOK / "llama3", (), None)
    for text, held in (("hello there", ""), ("hello wor", "wor"), ("hello world", "world"),
                       ("hello x", "x"), ("hello xy", "xy")):
        ids = tok.encode(text, add_bos=False)
        stream = _TextStream(tok, ["world peace", "xyz"])
        streamed = "".join(stream.piece(ids[:n], False) for n in range(1, len(ids) + 1))
        assert streamed + held == text and not stream.stopped(ids), (text, streamed)
        assert stream.piece(ids, True) == held


def test_streamed_text_of_byte_pieces_that_are_not_utf8(spm_gguf):
    """A SentencePiece decoder reads a run of byte pieces (<0xE4>) whole: a run that is not
    valid UTF-8 is one U+FFFD per byte, its whole characters included, so the stream holds a
    run back until a token ends it ("中" was streamed, then the text came back as "����")."""
    tok = spm_gguf
    ids = tok.encode("中文 x", add_bos=False)
    assert sum(map(tok.is_byte_piece, ids)) == 6 and not tok.is_byte_piece(ids[-1])
    rng = np.random.default_rng(0)
    for drop in [None, 5, 6] + list(rng.integers(1, len(ids), 8)):
        cut = ids if drop is None else ids[:drop] + ids[drop + 1:]
        for n in range(1, len(cut) + 1):
            pieces, _ = _stream(tok, cut[:n], [])
            assert "".join(pieces) == tok.decode(cut[:n]), (cut[:n], pieces)


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_first_tokens_of_a_long_text_are_its_whole_encodings_without_reading_it_all(
        kind, spm_gguf):
    """perplexity --max-tokens N encodes a growing prefix of the text, not the whole file (a
    19 MB file took 18 s and 3.4 GB for 128 tokens): the ids are the whole text's first N,
    cut inside words, digits, whitespace runs and multi-byte characters alike."""
    from tqjax.commands.perplexity import first_tokens

    tok = spm_gguf if kind == "sentencepiece" else tokenizer_from_hf_dir(TOK / "llama3", (),
                                                                          None)
    rng = np.random.default_rng(1)
    words = [w for t in PLAIN_TEXTS for w in t.split(" ")] + ["x" * 300, "1" * 50, "\n\n\n"]
    text = " ".join(rng.choice(words, 40_000))
    whole = tok.encode(text, add_bos=False)
    asked = []

    def read(chars):
        asked.append(chars)
        return (text, True) if chars is None else (text[:chars], chars >= len(text))

    for n in (1, 700, 9000, len(whole) - 5, len(whole) + 10):
        asked.clear()
        assert first_tokens(tok, read, n) == whole[:n], n
        if n <= 700:
            assert asked == [1 << 16]  # one read of a prefix, not the text
    assert first_tokens(tok, read, 0) == whole and asked[-1] is None


@pytest.mark.parametrize("template,rendered", [
    # SmolLM2's shape: a system turn added when messages[0] is not one (renders a bare reply
    # prompt for no messages), and Qwen2.5's: messages[0] read directly (a jinja2 error)
    ("{% if messages[0]['role'] != 'system' %}<s>sys</s>{% endif %}{% for m in messages %}"
     "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}",
     "<s>sys</s>hi<a>"),
    ("{{ messages[0]['content'] }}", "hi")])
def test_an_empty_conversation_is_refused(template, rendered):
    """HF refuses an empty conversation; templates otherwise render a reply to nothing, or fail
    with a jinja2 message about list indices."""
    tok = tokenizer_from_gguf({**_bpe_meta("gpt-2"), "tokenizer.chat_template": template})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], True) == rendered
    with pytest.raises(TqjaxError, match="^empty conversation"):
        tok.apply_chat_template([])
