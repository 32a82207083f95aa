"""Per-token texts for the viewer (`retention.models.pieces`): from a tokenizer on this machine only."""

import random

from retention.models.pieces import local_tokenizer, piece_decoder, pieces_for_model
from retention.models.prompts import output_text


def test_pieces_spell_the_recorded_text_and_keep_split_characters_whole():
    tok = local_tokenizer("tiny-random")
    pieces = piece_decoder(tok)
    ids = list("x é 𝑥!".encode("utf-8"))  # tiny-random's ids are byte values: é is 2 tokens, 𝑥 is 4
    out = pieces(ids)
    assert len(out) == len(ids) and "".join(out) == output_text(tok, [], ids) == "x é 𝑥!"
    assert out[2:4] == ["", "é"] and out[5:9] == ["", "", "", "𝑥"]
    # a character cut off at the end decodes as the text does (U+FFFD)
    assert pieces([]) == [] and "".join(pieces(ids[:3])) == output_text(tok, [], ids[:3]) == "x \ufffd"


def test_pieces_join_to_the_text_when_stray_bytes_chain_incomplete_characters():
    tok = local_tokenizer("tiny-random")
    pieces = piece_decoder(tok)
    # a lone continuation byte, then a 2-byte lead cut short by a 3-byte character (seen in a sampled run)
    ids = [83, 0x8B, 0xC3, 0xE4, 0x93, 0xBE, 104]
    out = pieces(ids)
    assert "".join(out) == output_text(tok, [], ids) == "S\ufffd\ufffd\u44feh"
    assert out[1:6] == ["", "", "", "", "\ufffd\ufffd\u44fe"]
    rng = random.Random(0)
    for _ in range(300):  # random byte streams, about half of them high bytes
        ids = [rng.choice([rng.randrange(32, 127), rng.randrange(128, 256)]) for _ in range(rng.randrange(1, 40))]
        out = pieces(ids)
        assert len(out) == len(ids) and "".join(out) == output_text(tok, [], ids), ids


def test_no_tokenizer_without_a_local_copy(tmp_path):
    assert local_tokenizer("no-such-model") is None
    (tmp_path / "config.json").write_text("{}")  # a model folder without tokenizer files
    assert local_tokenizer(str(tmp_path)) is None and pieces_for_model(str(tmp_path)) is None
