"""Tokenizers: HF `tokenizer.json` (tokenizers), `tokenizer.model` (sentencepiece), and the
tokenizers embedded in GGUF metadata (byte-level BPE `gpt2` and SentencePiece BPE `llama`), rebuilt
with `tokenizers` the way HF transformers' GGUF loader does. Chat templates use jinja2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

from tqjax.errors import TqjaxError

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (same as HF's tokenizer.json files).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class PreTokenizer(NamedTuple):
    """How a byte-level BPE vocabulary splits text before merging."""

    split: str | None  # regex applied first (None: GPT-2's own byte-level regex)
    digits: bool  # every digit its own piece first (then the GPT-2 regex)
    ignore_merges: bool  # a piece that is already a token is not merged further


_GPT2 = PreTokenizer(None, False, False)
_DIGITS = PreTokenizer(None, True, False)
_QWEN2 = PreTokenizer(QWEN2_PATTERN, False, False)
_LLAMA3 = PreTokenizer(LLAMA3_PATTERN, False, True)
_LLAMA3_MERGING = PreTokenizer(LLAMA3_PATTERN, False, False)
# The `tokenizer.ggml.pre` values this module rebuilds, grouped as llama.cpp's src/llama-vocab.cpp
# groups them (same split regex, same ignore_merges); any other value is an error. One exception:
# llama.cpp splits "default" (also its choice when the key is missing) with an extra punctuation and
# 3-digit rule, while HF transformers' GGUF loader, our reference, uses GPT-2's split; we follow HF.
# "smollm" is the other way round: HF's GGUF loader omits the digit split that SmolLM2's own
# tokenizer.json (Digits, then ByteLevel) and llama.cpp apply, so whitespace runs before a digit
# ("a  1") tokenize differently there; we follow the model's own tokenizer and llama.cpp.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0",
                     "mellum", "exaone4", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), _DIGITS),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open"), _QWEN2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3),
    **dict.fromkeys(("smaug-bpe", "dbrx"), _LLAMA3_MERGING),
}
# GGUF token types (llama.cpp's llama_token_type, the same numbers as sentencepiece's piece types).
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
# Architectures whose SentencePiece GGUF vocabulary HF rebuilds with a different normalizer or
# merge order (transformers' GGUF_SENTENCEPIECE_BUILDERS); not supported here.
_SENTENCEPIECE_OTHER_ARCHS = ("gemma", "gemma2", "gemma3", "phi3")
SPIECE_UNDERLINE = "\u2581"


@dataclasses.dataclass
class Tokenizer:
    """Text <-> token ids, plus the model's special ids and chat template."""

    backend: Any  # tokenizers.Tokenizer or sentencepiece.SentencePieceProcessor
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool  # the default encoding starts with the BOS
    chat_template: str | None
    special: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def is_sentencepiece(self) -> bool:
        return not hasattr(self.backend, "encode_batch")

    def encode(self, text: str, add_bos: bool | None = None, release_gil: bool = False
               ) -> list[int]:
        """Token ids of `text`. By default the tokenizer's own configuration decides the special
        tokens (a `tokenizers` post-processor: exactly HF's `tokenizer(text).input_ids`; for a
        sentencepiece model, `add_bos`); add_bos=False adds none, add_bos=True only a BOS.
        `release_gil`: the same ids, through `tokenizers`' batch call, which lets other Python
        threads run meanwhile (the server tokenizes in a worker thread: a 1 MB prompt takes
        ~1.5 s, which held every stream still)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (bad bytes in argv, "\ud800" in JSON)
            raise TqjaxError(f"text is not valid Unicode: {e.reason} at character "
                             f"{e.start}") from None
        if self.is_sentencepiece:
            ids = list(self.backend.encode(text))
        elif release_gil:
            ids = self.backend.encode_batch([text], add_special_tokens=add_bos is None)[0].ids
            if add_bos is None:
                return ids
        elif add_bos is None:
            return self.backend.encode(text, add_special_tokens=True).ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else add_bos
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` stands for, a part of a character included (where decoding
        it alone gives U+FFFD): byte-level BPE maps its symbols back to bytes, SentencePiece's
        byte pieces (<0xE2>) are that byte and its "▁" a space; special tokens their text."""
        if self.is_sentencepiece:
            piece = self.backend.id_to_piece(tid)
            if self.backend.is_byte(tid):
                return bytes([int(piece[3:5], 16)])
            if self.backend.is_control(tid) or self.backend.is_unknown(tid):
                return self.backend.decode([tid]).encode("utf-8")
            return piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")
        piece = self.backend.id_to_token(tid)
        if piece is None or tid in self._added_ids:
            return self.backend.decode([tid], skip_special_tokens=False).encode("utf-8")
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if _is_byte_form(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")

    def is_byte_piece(self, tid: int) -> bool:
        """Whether token `tid` is a byte-fallback piece (<0xE2>) of a SentencePiece-style
        vocabulary, whose decoder reads a run of them as a whole: a run that is not valid
        UTF-8 comes out as one U+FFFD per byte, characters already whole in it included."""
        if self.is_sentencepiece:
            return bool(self.backend.is_byte(tid))
        return self.byte_fallback and _is_byte_form(self.backend.id_to_token(tid))

    @property
    def byte_fallback(self) -> bool:
        """Whether the vocabulary may spell bytes as <0xNN> pieces (not byte-level BPE)."""
        return self.is_sentencepiece or not self._byte_level

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the HF tokenizer's decoder maps byte-level symbols back to bytes."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [
            decoder]
        return any(d.get("type") == "ByteLevel" for d in parts)

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self.is_sentencepiece:
            return self.backend.decode(list(ids))
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's own jinja2 chat template."""
        if not self.chat_template:
            raise TqjaxError("this model has no chat template; drop --chat")
        if not messages:  # (as HF: templates index messages[0], or render a bare reply)
            raise TqjaxError("empty conversation: give at least one message")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TqjaxError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent,
                                                                  ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        names = {i: t for t, i in self.special.items()}
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=names.get(self.bos_id, ""),
                eos_token=names.get(self.eos_ids[0], "") if self.eos_ids else "")
        except TemplateError as e:
            raise TqjaxError(f"chat template error: {e}") from None


def _is_byte_form(piece: str | None) -> bool:
    """Whether a vocabulary piece is a byte-fallback piece, "<0xE2>"."""
    return piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable stand-in of each byte -> the byte
    (the `bytes_to_unicode` table that byte-level BPE vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _bos_eos_template(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> Any:
    """HF's post-processor for add_bos_token/add_eos_token (`update_post_processor` of
    transformers' TokenizersBackend): `[bos] $A [eos]` with whichever (token, id) is given."""
    from tokenizers import processors

    def one(seq: str, part: str) -> str:
        return " ".join([f"{t[0]}:{seq}" for t in (bos,) if t] + [f"${part}:{seq}"]
                        + [f"{t[0]}:{seq}" for t in (eos,) if t])

    return processors.TemplateProcessing(single=one("0", "A"),
                                         pair=f"{one('0', 'A')} {one('1', 'B')}",
                                         special_tokens=[t for t in (bos, eos) if t])


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Any:
    """GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with its GGUF pre-tokenizer."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    name = meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        raise TqjaxError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={name!r}; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                 ignore_merges=pre.ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None)
    if pre.split is not None:
        split = pre_tokenizers.Split(Regex(pre.split), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre.digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces,
    ranked by the piece's score (best first), ties by longer left then right part, then by the
    parts' ids -- transformers' `generate_merges`, so the merge order is HF's exactly."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> Any:
    """SentencePiece BPE (`tokenizer.ggml.model == "llama"`) as HF's GGUF loader rebuilds it
    (transformers LlamaTokenizer): BPE on the pieces with merges from the scores and byte fallback
    to the `<0xNN>` pieces, spaces written as U+2581 with one prepended to the text
    (`add_space_prefix`, default on)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    arch = meta.get("general.architecture")
    if arch in _SENTENCEPIECE_OTHER_ARCHS:
        raise TqjaxError(f"unsupported GGUF tokenizer: the SentencePiece vocabulary of {arch!r}")
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = sentencepiece_merges(tokens, list(meta["tokenizer.ggml.scores"]))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_UNDERLINE, prepend_scheme="first" if prefix else "never", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse(),
         *([decoders.Strip(content=" ", left=1)] if prefix else [])])
    return tok


# llama.cpp's end-of-generation tokens by their text (llama-vocab.cpp, `special_eog_ids`):
# GGUF files name one eos (Qwen2.5: <|im_end|>), but a model also ends with the others (Qwen2.5
# emits <|endoftext|> too, and HF lists both in generation_config.json)
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                           "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                           "<end_of_utterance>")
# ... and the fill-in-the-middle pad, repository and file-separator tokens (Qwen2.5-Coder's
# <|fim_pad|>, <|repo_name|>, <|file_sep|>): the first of each kind, as llama.cpp finds them
FIM_END_TEXTS = (("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")),
                 ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                              "<reponame>")),
                 ("fim_sep", ("<|file_sep|>",)))


def end_of_generation_ids(meta: dict[str, Any], tokens: list[str]) -> tuple[int, ...]:
    """The token ids that end generation for a GGUF vocabulary, as llama.cpp's set: the named
    eos, eot and eom ids (eos first: it is the template's `eos_token`), the FIM pad, repo and
    file-separator tokens (named in the metadata, else found by text), and every token whose
    text is in `END_OF_GENERATION_TEXTS`."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        named = meta.get(f"tokenizer.ggml.{key}_token_id")
        if named is not None:
            ids.append(int(named))
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}  # (a text's first id)
    for key, texts in FIM_END_TEXTS:
        named = meta.get(f"tokenizer.ggml.{key}_token_id")
        found = [index[t] for t in texts if t in index]
        if named is not None or found:
            ids.append(int(named) if named is not None else min(found))
    ids += sorted(index[t] for t in END_OF_GENERATION_TEXTS if t in index)
    return tuple(i for i in dict.fromkeys(ids) if 0 <= i < len(tokens))


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer | None:
    """Rebuild the tokenizer stored in GGUF metadata: byte-level BPE (`gpt2`, with a known
    `tokenizer.ggml.pre`) or SentencePiece BPE (`llama`), as HF transformers' GGUF loader does.
    None for a weights-only GGUF (no `tokenizer.ggml.tokens`)."""
    from tokenizers import AddedToken

    if "tokenizer.ggml.tokens" not in meta:
        return None
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    bos = None if bos is None else int(bos)
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
        special_ids = [i for i, t in enumerate(types) if t in (GGUF_CONTROL, GGUF_USER_DEFINED)]
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in special_ids])
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens)
        # HF: control pieces and the named bos/eos/unk/pad ids are special, user-defined pieces
        # are added (matched whole in the text) but not special.
        named = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in
                 ("bos", "eos", "unknown", "padding")]
        special_ids = sorted({i for i, t in enumerate(types) if t == GGUF_CONTROL}
                             | {int(i) for i in named if i is not None})
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in special_ids])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == GGUF_USER_DEFINED])
        # llama.cpp's and HF's default for SentencePiece: add a BOS
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise TqjaxError(f"unsupported GGUF tokenizer model {kind!r} (byte-level BPE 'gpt2' or "
                         "SentencePiece 'llama'; use the HF directory with tokenizer.json instead)")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = add_bos and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    # HF builds the post-processor from these flags (and llama.cpp adds the same tokens)
    tok.post_processor = _bos_eos_template((tokens[bos], bos) if add_bos else None,
                                           (tokens[int(eos)], int(eos)) if add_eos else None)
    return Tokenizer(
        backend=tok,
        bos_id=bos,
        eos_ids=end_of_generation_ids(meta, tokens),
        add_bos=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        special={tokens[i]: i for i in special_ids},
    )


def _token_content(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def tokenizer_from_hf_dir(path: Path, eos_ids: tuple[int, ...],
                          bos_id: int | None) -> Tokenizer:
    """Tokenizer of an HF directory: tokenizer.json preferred, else tokenizer.model."""
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        special = {t.content: i for i, t in backend.get_added_tokens_decoder().items()
                   if t.special}
        vocab_id = backend.token_to_id
    elif (path / "tokenizer.model").is_file():
        import sentencepiece as spm

        backend = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
        special = {backend.id_to_piece(i): i for i in range(backend.get_piece_size())
                   if backend.is_control(i)}
        vocab_id = backend.piece_to_id
    else:
        raise TqjaxError(f"{path} has no tokenizer.json or tokenizer.model")
    bos_tok = _token_content(cfg.get("bos_token"))
    if bos_tok is not None:
        bos_id = vocab_id(bos_tok)
    eos_tok = _token_content(cfg.get("eos_token"))
    if eos_tok is not None and vocab_id(eos_tok) is not None:
        eos_ids = tuple(dict.fromkeys((*eos_ids, vocab_id(eos_tok))))
    if not hasattr(backend, "encode_batch"):  # sentencepiece
        add_bos = bool(cfg.get("add_bos_token", True))  # llama.cpp's default for SentencePiece
    else:
        # As HF transformers 5 does, tokenizer.json's post-processor alone decides the special
        # tokens of the default encoding (e.g. Llama 3's TemplateProcessing that prepends
        # <|begin_of_text|>); HF drops add_bos_token/add_eos_token from tokenizer_config.json
        # whenever a tokenizer.json is present, and so do we.
        add_bos = (bos_id is not None
                   and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id])
    return Tokenizer(backend=backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
                     chat_template=template, special=special)
