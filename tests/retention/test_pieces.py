"""Per-token texts for the viewer (`retention.models.pieces`): from a tokenizer on this machine only."""

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


def test_no_tokenizer_without_a_local_copy(tmp_path):
    assert local_tokenizer("no-such-model") is None
    (tmp_path / "config.json").write_text("{}")  # a model folder without tokenizer files
    assert local_tokenizer(str(tmp_path)) is None and pieces_for_model(str(tmp_path)) is None
