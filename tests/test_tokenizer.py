import pytest

from birkhoff.tokenizer import CharTokenizer


def test_round_trip_and_ids():
    tok = CharTokenizer()
    text = "sort:dcba=abcd 12+34=46"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert min(ids) >= 3  # specials are never produced from text
    assert tok.decode(ids) == text
    assert tok.vocab_size < 64 and max(ids) < tok.vocab_size


def test_decode_skips_pad_bos_and_stops_at_eos():
    tok = CharTokenizer()
    ids = [tok.bos_id, *tok.encode("579"), tok.eos_id, *tok.encode("99"), tok.pad_id]
    assert tok.decode(ids) == "579"
    assert tok.decode([tok.pad_id, tok.bos_id]) == ""


def test_unknown_character_names_it():
    with pytest.raises(ValueError, match="'A' at position 1"):
        CharTokenizer().encode("1A")


def test_decode_rejects_out_of_range_id():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=str(tok.vocab_size)):
        tok.decode([tok.vocab_size])


def test_prompt_convention_is_bos_then_text():
    tok = CharTokenizer()
    assert tok.encode_prompt("1+2=") == [tok.bos_id, *tok.encode("1+2=")]
