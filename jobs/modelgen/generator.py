"""Generate small Llama-shaped model directories that vLLM serves without any download.

A generated directory holds only configuration and a tokenizer trained locally on the shipped
corpus (:mod:`jobs.modelgen.corpus`); there are no weight files. vLLM serves it with
``--load-format dummy`` (random weights, real compute), which is all an engine experiment
needs: performance depends on shapes, not weight values.

Files written (the names Hugging Face ``transformers`` and vLLM look for):

``config.json``
    ``LlamaForCausalLM`` with the chosen :data:`SHAPES` entry, ``bfloat16`` (the vLLM CPU
    build's preferred dtype), ``max_position_embeddings`` :data:`MAX_POSITION_EMBEDDINGS`,
    RoPE parameters in both the transformers 5 (``rope_parameters``) and the legacy
    (``rope_theta``) spelling, and a ``vlab`` block recording shape and seed.
``generation_config.json``
    bos/eos/pad ids.
``tokenizer.json``
    byte-level BPE trained with the ``tokenizers`` library; adds ``<|begin_of_text|>`` in
    front of plain (non-chat) prompts, like Llama 3.
``tokenizer_config.json`` / ``special_tokens_map.json``
    ``PreTrainedTokenizerFast``, special tokens, and a Llama-3-style Jinja ``chat_template``
    (system / user / assistant roles, ``add_generation_prompt``).

Generation is deterministic: the same shape and seed give byte-identical files (checked by
:func:`model_digest`). ``seed`` only shuffles the order of the training paragraphs, so
different seeds give slightly different tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jobs.modelgen.corpus import paragraphs

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
PAD_TOKEN = "<|pad|>"

#: Special tokens, in id order (ids 0..5 of every generated vocabulary).
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    PAD_TOKEN,
)

#: Llama-3-style chat template: ``bos``, then per message
#: ``<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>``, then an open assistant
#: header when ``add_generation_prompt`` is true. Roles: system, user, assistant (any other
#: role is rendered the same way).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

#: Largest context the generated models declare (tokens); pass ``--max-model-len`` to cap it.
MAX_POSITION_EMBEDDINGS = 16384

#: Weight dtype written to ``config.json``; the vLLM CPU build runs bfloat16 natively.
DTYPE = "bfloat16"

#: Key of the marker block in ``config.json`` (see :func:`is_generated_model`).
_MARKER_KEY = "vlab"
#: The generator's name in that marker: the module's name when the format was set, kept
#: as is (it is part of every generated config.json, so of each model's digest).
_GENERATOR = "jobs.modelgen"

_FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class ModelShape:
    """Architecture sizes of a generated Llama model (all counts, no units)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """Target BPE vocabulary size, special tokens included."""


#: Available shapes. ``tiny`` is for tests (fast even on one CPU core); ``small`` makes
#: prefill cost visible on CPU (prefix-caching effects are measurable).
SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=352,
        vocab_size=1024,
    ),
    "small": ModelShape(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=4096,
    ),
}


def train_tokenizer(vocab_size: int, *, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE tokenizer on the shipped corpus.

    Args:
        vocab_size: target vocabulary size including :data:`SPECIAL_TOKENS` (the trainer may
            stop earlier if the corpus has too few pair merges; ~5.7k is the ceiling).
        seed: shuffles the order of the training paragraphs (``random.Random(seed)``).

    Returns:
        A tokenizer whose ``encode(text)`` prepends ``<|begin_of_text|>`` (use
        ``add_special_tokens=False`` for raw pieces) and whose ``decode`` round-trips text.
        Training takes well under a second and is deterministic.

    Raises:
        ValueError: if ``vocab_size`` is not larger than 256 byte symbols + special tokens.
    """
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    texts = paragraphs()
    random.Random(seed).shuffle(texts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _config(shape_name: str, seed: int, ids: dict[str, int], trained_vocab: int) -> dict[str, Any]:
    """``config.json`` of a generated model (Llama, the shape's sizes, vlab's marker)."""
    shape = SHAPES[shape_name]
    # Round the embedding rows up to a multiple of 64, as real checkpoints do.
    vocab_rows = -(-trained_vocab // 64) * 64
    rope_theta = 500000.0
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[EOT_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_bias": False,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE,
        "dtype": DTYPE,
        "use_cache": True,
        "vocab_size": vocab_rows,
        _MARKER_KEY: {
            "generator": _GENERATOR,
            "shape": shape_name,
            "seed": seed,
            "tokenizer_vocab_size": trained_vocab,
            **asdict(shape),
        },
    }
    return config


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    """``tokenizer_config.json``: the special tokens (by their trained ids) and chat template."""
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }
    return tokenizer_config


def _build_files(shape_name: str, seed: int) -> dict[str, bytes]:
    shape = SHAPES[shape_name]
    tok = train_tokenizer(shape.vocab_size, seed=seed)
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        tid = tok.token_to_id(t)
        if tid is None:  # pragma: no cover - the trainer always adds special tokens
            raise RuntimeError(f"special token {t} missing from the trained vocabulary")
        ids[t] = tid
    trained_vocab = tok.get_vocab_size()
    config = _config(shape_name, seed, ids, trained_vocab)
    generation_config = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[EOT_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    tokenizer_config = _tokenizer_config(ids)
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN, "pad_token": PAD_TOKEN}
    tok_json = json.loads(tok.to_str())
    return {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(generation_config),
        "special_tokens_map.json": _json_bytes(special_tokens_map),
        "tokenizer.json": _json_bytes(tok_json),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
    }


def generate_model(
    dest: Path | str, shape: str = "tiny", *, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write a servable model directory for ``shape`` at ``dest`` and return its path.

    The directory is built in a temporary sibling folder and renamed into place, so readers
    never see a half-written model. Takes about a second.

    Args:
        dest: directory to create; its parent is created if needed.
        shape: a key of :data:`SHAPES` (``"tiny"`` or ``"small"``).
        seed: tokenizer training seed (see :func:`train_tokenizer`); recorded in config.json.
        overwrite: replace an existing ``dest``; otherwise an existing ``dest`` is an error.

    Returns:
        ``dest`` as an absolute :class:`~pathlib.Path`.

    Raises:
        ValueError: unknown ``shape`` or negative ``seed``.
        FileExistsError: ``dest`` exists and ``overwrite`` is false.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    dest = Path(dest).absolute()
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} exists (pass overwrite=True to replace it)")
    files = _build_files(shape, seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        os.chmod(tmp, 0o755)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "model")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def model_digest(model_dir: Path | str) -> str:
    """Return a sha256 hex digest identifying a model directory's files.

    Hashes, for every regular file under ``model_dir`` in sorted relative-path order, the
    relative POSIX path, the size in bytes and the content. Use it in node fingerprints and
    parity checks: equal digests mean byte-identical model files.

    Raises:
        NotADirectoryError: if ``model_dir`` is not a directory.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise NotADirectoryError(f"not a directory: {root}")
    h = hashlib.sha256()
    files = sorted(
        (p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix()
    )
    for path in files:
        rel = path.relative_to(root).as_posix()
        size = path.stat().st_size
        h.update(rel.encode() + b"\0" + str(size).encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def is_generated_model(path: Path | str) -> bool:
    """Return True if ``path`` is a complete directory written by :func:`generate_model`."""
    root = Path(path)
    if not all((root / name).is_file() for name in _FILES):
        return False
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    marker = config.get(_MARKER_KEY)
    return isinstance(marker, dict) and marker.get("generator") == _GENERATOR


def load_tokenizer(model_dir: Path | str) -> Tokenizer:
    """Load ``tokenizer.json`` of a model directory with the ``tokenizers`` library.

    ``encode(text)`` prepends ``<|begin_of_text|>``; pass ``add_special_tokens=False`` to
    count the tokens of a text piece.

    Raises:
        FileNotFoundError: if the directory has no ``tokenizer.json``.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


def render_chat(messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Render ``messages`` exactly as :data:`CHAT_TEMPLATE` does, without Jinja.

    Useful to count prompt tokens client-side: ``load_tokenizer(d).encode(render_chat(m),
    add_special_tokens=False)`` gives the ids vLLM's chat endpoint feeds the model.
    """
    parts = [BOS_TOKEN]
    for m in messages:
        parts.append(f"{START_HEADER_TOKEN}{m['role']}{END_HEADER_TOKEN}\n\n")
        parts.append(m["content"].strip())
        parts.append(EOT_TOKEN)
    if add_generation_prompt:
        parts.append(f"{START_HEADER_TOKEN}assistant{END_HEADER_TOKEN}\n\n")
    return "".join(parts)
