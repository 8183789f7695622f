"""Tests of :mod:`jobs.modelgen.generator`: generated model directories, digests and tokenizers.

These tests check the files only; serving a generated directory with vLLM
(``--load-format dummy``) is an engine-level concern covered where the engine is launched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from jobs.modelgen.generator import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOT_TOKEN,
    MAX_POSITION_EMBEDDINGS,
    SHAPES,
    SPECIAL_TOKENS,
    generate_model,
    is_generated_model,
    load_tokenizer,
    model_digest,
    render_chat,
)

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _json(path: Path) -> dict[str, object]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def test_tiny_model_files_and_config(tiny_model_dir: Path) -> None:
    assert {p.name for p in tiny_model_dir.iterdir()} == EXPECTED_FILES
    cfg = _json(tiny_model_dir / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["hidden_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 32
    assert cfg["intermediate_size"] == 352
    assert cfg["max_position_embeddings"] == MAX_POSITION_EMBEDDINGS >= 4096
    assert cfg["rope_parameters"] == {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    assert is_generated_model(tiny_model_dir)


def test_special_token_ids_match_tokenizer(tiny_model_dir: Path, tiny_tokenizer: Tokenizer) -> None:
    cfg = _json(tiny_model_dir / "config.json")
    gen = _json(tiny_model_dir / "generation_config.json")
    tok_cfg = _json(tiny_model_dir / "tokenizer_config.json")
    ids = {t: tiny_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(len(SPECIAL_TOKENS)))
    assert cfg["bos_token_id"] == gen["bos_token_id"] == ids[BOS_TOKEN]
    assert ids[EOT_TOKEN] in cfg["eos_token_id"]  # type: ignore[operator]
    assert cfg["eos_token_id"] == gen["eos_token_id"]
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["bos_token"] == BOS_TOKEN
    assert tok_cfg["eos_token"] == EOT_TOKEN
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    decoder = tok_cfg["added_tokens_decoder"]
    assert isinstance(decoder, dict)
    assert {v["content"] for v in decoder.values()} == set(SPECIAL_TOKENS)
    vocab = tiny_tokenizer.get_vocab_size()
    assert vocab == SHAPES["tiny"].vocab_size
    rows = cfg["vocab_size"]
    assert isinstance(rows, int) and rows >= vocab and rows % 64 == 0


def test_tokenizer_round_trip_and_bos(tiny_tokenizer: Tokenizer) -> None:
    text = "The server returned 3 errors; see section 4.2 of the handbook.\nRetry later!"
    enc = tiny_tokenizer.encode(text)
    assert enc.ids[0] == tiny_tokenizer.token_to_id(BOS_TOKEN)
    raw = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert raw.ids == enc.ids[1:]
    assert tiny_tokenizer.decode(raw.ids) == text
    # Byte-level BPE: any text encodes, non-ASCII included.
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("naive cafe ü €").ids) == "naive cafe ü €"


def test_render_chat_matches_template_layout(tiny_tokenizer: Tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi?"},
    ]
    assert render_chat(msgs) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not render_chat(msgs, add_generation_prompt=False).endswith("\n\n")
    ids = tiny_tokenizer.encode(render_chat(msgs), add_special_tokens=False).ids
    assert ids[0] == tiny_tokenizer.token_to_id(BOS_TOKEN)
    eot = tiny_tokenizer.token_to_id(EOT_TOKEN)
    assert eot is not None and ids.count(eot) == 2


def test_generation_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = generate_model(tmp_path / "a", "tiny", seed=0)
    assert model_digest(again) == model_digest(tiny_model_dir)
    for name in EXPECTED_FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    other = generate_model(tmp_path / "b", "tiny", seed=1)
    assert model_digest(other) != model_digest(tiny_model_dir)


def test_small_shape(tmp_path: Path) -> None:
    d = generate_model(tmp_path / "small", "small")
    cfg = _json(d / "config.json")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (512, 8, 64)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["intermediate_size"] == 1408
    assert 4000 <= load_tokenizer(d).get_vocab_size() <= 8192


def test_unknown_shape_and_existing_dest(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model shape"):
        generate_model(tmp_path / "x", "huge")
    with pytest.raises(ValueError):
        generate_model(tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()
    d = generate_model(tmp_path / "m")
    with pytest.raises(FileExistsError):
        generate_model(d)
    (d / "stale.bin").write_bytes(b"x")
    assert generate_model(d, overwrite=True) == d
    assert not (d / "stale.bin").exists()
    # Atomic build: no temporary folders are left next to the destination.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_model_digest(tmp_path: Path, tiny_model_dir: Path) -> None:
    digest = model_digest(tiny_model_dir)
    assert len(digest) == 64 and int(digest, 16) >= 0
    copy = generate_model(tmp_path / "copy")
    assert model_digest(copy) == digest  # independent of the directory's location
    (copy / "config.json").write_bytes((copy / "config.json").read_bytes() + b" ")
    assert model_digest(copy) != digest
    (copy / "extra.txt").write_text("")
    before = model_digest(copy)
    (copy / "extra.txt").rename(copy / "extra2.txt")
    assert model_digest(copy) != before  # file names count, not only contents
    with pytest.raises(NotADirectoryError):
        model_digest(tmp_path / "missing")


def test_is_generated_model_and_load_errors(tmp_path: Path) -> None:
    assert not is_generated_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert not is_generated_model(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
