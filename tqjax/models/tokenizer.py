"""Tokenizers: HF `tokenizer.json` (tokenizers), `tokenizer.model` (sentencepiece), and the
byte-level BPE embedded in GGUF metadata, rebuilt with `tokenizers`. Chat templates use jinja2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tqjax.errors import TqjaxError

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (same as HF's tokenizer.json files).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS = {"qwen2": QWEN2_PATTERN, "llama-bpe": LLAMA3_PATTERN, "smaug-bpe": LLAMA3_PATTERN}
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4


@dataclasses.dataclass
class Tokenizer:
    """Text <-> token ids, plus the model's special ids and chat template."""

    backend: Any  # tokenizers.Tokenizer or sentencepiece.SentencePieceProcessor
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None
    special: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def is_sentencepiece(self) -> bool:
        return not hasattr(self.backend, "encode_batch")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; a BOS is prepended when the model asks for one."""
        if self.is_sentencepiece:
            ids = list(self.backend.encode(text))
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else add_bos
        if bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if self.is_sentencepiece:
            return self.backend.decode(list(ids))
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's own jinja2 chat template."""
        if not self.chat_template:
            raise TqjaxError("this model has no chat template; drop --chat")
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


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild the GPT-2-style byte-level BPE tokenizer stored in GGUF metadata."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TqjaxError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2'; "
                         "use the HF directory with tokenizer.json/tokenizer.model instead)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                 ignore_merges=meta.get("tokenizer.ggml.pre") == "llama-bpe"))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in
                                          SPLIT_PATTERNS)
    if pre in SPLIT_PATTERNS:
        split = pre_tokenizers.Split(Regex(SPLIT_PATTERNS[pre]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special_ids = [i for i, t in enumerate(types) if t in (GGUF_CONTROL, GGUF_USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in special_ids])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos is None else [int(eos)]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        backend=tok,
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(eos_ids),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
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
        add_bos_default = False
    elif (path / "tokenizer.model").is_file():
        import sentencepiece as spm

        backend = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
        special = {backend.id_to_piece(i): i for i in range(backend.get_piece_size())
                   if backend.is_control(i)}
        vocab_id = backend.piece_to_id
        add_bos_default = True
    else:
        raise TqjaxError(f"{path} has no tokenizer.json or tokenizer.model")
    bos_tok = _token_content(cfg.get("bos_token"))
    if bos_tok is not None:
        bos_id = vocab_id(bos_tok)
    eos_tok = _token_content(cfg.get("eos_token"))
    if eos_tok is not None and vocab_id(eos_tok) is not None:
        eos_ids = tuple(dict.fromkeys((*eos_ids, vocab_id(eos_tok))))
    return Tokenizer(backend=backend, bos_id=bos_id, eos_ids=eos_ids,
                     add_bos=bool(cfg.get("add_bos_token", add_bos_default)),
                     chat_template=template, special=special)
