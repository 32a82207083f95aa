"""Per-token texts of recorded output ids, for the viewer (`retention view`): only from a tokenizer at hand.

`local_tokenizer(name)` loads the tokenizer of a run's model without downloading or converting
anything: built in code (`tiny-*`), from the converted cache folder of a GGUF model when it exists,
from a local folder, or from the hub cache. Anything else gives None (the viewer then splits the text
approximately). `piece_decoder(tokenizer)` decodes ids into one text per token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from retention.errors import RetentionError
from retention.models.aliases import SPLIT_GGUFS, resolve_model
from retention.models.tiny import build_tiny_tokenizer
from retention.models.weights_cache import cache_root, smollm2_cache_dir

#: A UTF-8 character split across byte-level tokens decodes to U+FFFD until its last byte arrives.
_REPLACEMENT = "\ufffd"
#: Most tokens one group may span. A group cannot close while its text ends in U+FFFD (a later byte
#: may still complete a character), and stray bytes (a lone continuation byte, a lead byte cut short)
#: can chain several incomplete sequences, so the bound is not 4 (one character's bytes) but a
#: safety cap: a group that reaches it is closed as decoded, and where its pieces then no longer
#: spell the text the viewer falls back to its approximate split.
_MAX_GROUP = 64


def local_tokenizer(name: str) -> Any | None:
    """The tokenizer of model `name` when it loads from this machine alone, else None."""
    try:
        ref = resolve_model(name)
    except RetentionError:
        return None
    if ref.kind in ("random", "arch"):
        return build_tiny_tokenizer()
    folder: Path | None = None
    if ref.kind == "gguf":
        folder = smollm2_cache_dir()
    elif ref.kind == "parts":
        folder = cache_root() / "models" / SPLIT_GGUFS[ref.source].alias
    elif ref.kind == "local":
        folder = Path(ref.source)
    source = str(folder) if folder is not None else ref.source if ref.kind == "hub" else None
    if source is None or (folder is not None and not (folder / "tokenizer_config.json").is_file()):
        return None
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        return None


def piece_decoder(tokenizer: Any) -> Callable[[list[int]], list[str]]:
    """ids -> the text of each token (special tokens skipped), joining to the decoded text.

    Each id is decoded once and cached; a character split over several byte-level tokens is given
    to its last token (the earlier ones get ""). Tokens are grouped until the group's text no longer
    ends in U+FFFD: decoding is additive at such a point (the UTF-8 decoder holds no partial
    character), so the pieces join to the text decoded in one go."""
    single: dict[int, str] = {}
    grouped: dict[tuple[int, ...], str] = {}

    def decode(ids: tuple[int, ...]) -> str:
        table = single if len(ids) == 1 else grouped
        key = ids[0] if len(ids) == 1 else ids
        if key not in table:
            table[key] = tokenizer.decode(list(ids), skip_special_tokens=True)
        return table[key]

    def pieces(ids: list[int]) -> list[str]:
        out, pending = [], []
        for tok in ids:
            pending.append(int(tok))
            text = decode(tuple(pending))
            if text.endswith(_REPLACEMENT) and len(pending) < _MAX_GROUP:
                out.append("")
                continue
            out.append(text)
            pending = []
        if pending:  # an incomplete character at the end: keep what was decoded
            out[-1] = decode(tuple(pending))
        return out

    return pieces


def pieces_for_model(name: str) -> Callable[[list[int]], list[str]] | None:
    tok = local_tokenizer(name)
    return None if tok is None else piece_decoder(tok)
