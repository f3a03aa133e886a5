"""The reduced CLIP tokenizer gives the full CLIP tokenizer's tokens on the words it keeps."""

import pytest

from diffrl.shapes.tokenizer import MAX_LENGTH, build_tokenizer_files, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tokenizer_files(tmp_path_factory.mktemp("tok")))


def test_small_vocabulary(tokenizer):
    assert 512 < len(tokenizer) < 1000
    assert tokenizer.model_max_length == MAX_LENGTH


@pytest.mark.parametrize("text", ["a red circle to the left of an orange square on a gray background",
                                  "three purple triangles", "a pair of blue circles", "an image of 3 yellow squares"])
def test_same_tokens_as_full_clip(tokenizer, text):
    from open_clip.tokenizer import SimpleTokenizer

    full = SimpleTokenizer()
    expected = [full.decoder[i] for i in full.encode(text)]
    ids = tokenizer(text).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|startoftext|>"] + expected + ["<|endoftext|>"]


def test_round_trip_through_save(tokenizer, tmp_path):
    from transformers import CLIPTokenizer

    tokenizer.save_pretrained(tmp_path)
    again = CLIPTokenizer.from_pretrained(tmp_path)
    assert again("two green squares").input_ids == tokenizer("two green squares").input_ids
    assert again.model_max_length == MAX_LENGTH


def test_unknown_words_still_tokenize(tokenizer):
    # Words outside the kept list fall back to smaller pieces that still spell them.
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("a zebra").input_ids)[1:-1]
    assert tokens[0] == "a</w>" and "".join(tokens[1:]) == "zebra</w>" and len(tokens) > 2
