"""A small byte-level BPE tokenizer with the whitespace merges real tokenizers have, saved
as a Hugging Face model directory the prefix analyser loads like any other.

The generated models of :mod:`jobs.modelgen.generator` split text with the GPT-2 pattern and are
trained on paragraphs without blank lines: they have no ``"\\n\\n"`` token, so no test on
them can see a whitespace merge. This one is built like Qwen2's and Llama 3's tokenizers:

- pre-tokenizer: ``Split`` on the Qwen2 / Llama 3 pattern (``\\s*[\\r\\n]+`` keeps a
  newline run in one piece, `` ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*`` glues newlines to the
  punctuation before them, ``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`` a space to the word after it),
  then ``ByteLevel(use_regex=False)``: the ``tokenizer.json`` layout of
  ``Qwen/Qwen2.5-*-Instruct`` and ``meta-llama/Llama-3.*``;
- vocabulary: BPE trained at test time (``tokenizers`` ``BpeTrainer``, deterministic) on a
  small corpus whose paragraphs are separated by blank lines, so it learns ``"ĊĊ"``
  (``"\\n\\n"``), ``".ĊĊ"`` and space-prefixed words (``"ĠHello"``) as real vocabularies do
  (Qwen2: ``"\\n\\n"`` is id 271, ``"\\n"`` id 198; PrimeIntellect-ai/prime-rl#1863);
- chat template: ChatML as Qwen2.5 writes it (``<|im_start|>role\\ncontent<|im_end|>\\n``,
  content not trimmed, generation prompt ``<|im_start|>assistant\\n``).

:func:`build_bpe_model` checks the merges it relies on and fails loudly if training did not
produce them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

#: The Qwen2 / Llama 3 pre-tokenizer pattern (``tokenizer.json`` ``pre_tokenizer.Split``).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL = (ENDOFTEXT, IM_START, IM_END)

#: ChatML, as Qwen2.5's template writes it (no system prompt injected, content verbatim).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PARAGRAPHS = [
    "Hello there",
    "Hello Alice",
    "Here is the plan",
    "Check the logs first",
    "Restart the service and watch the queue",
    "The rollback plan is ready",
    "The answer is yes",
    "Sure. Here is the summary",
    "You are a helpful assistant",
    "The user asks about the incident",
    "Open an incident channel and assign a commander",
    "Every production change needs a ticket and a reviewer",
]
#: Paragraphs joined by blank lines (some after a word, some after a full stop), role
#: names, and a few list lines: enough for the merges real vocabularies have.
CORPUS = [
    "\n\n".join(_PARAGRAPHS),
    ".\n\n".join(_PARAGRAPHS) + ".",
    "\n\n".join(
        f"{p}:\n\n1. {q}." for p, q in zip(_PARAGRAPHS, reversed(_PARAGRAPHS), strict=True)
    ),
    " ".join(["system user assistant"] * 4),
] * 8

#: Tokens the tests rely on (byte-level spelling): ``"\n\n"``, ``"\n"``, ``".\n\n"``, and a
#: space merged into the word after it.
REQUIRED = ("ĊĊ", "Ċ", ".ĊĊ", "ĠHello", "Hello", "Ġthe")


def train() -> Tokenizer:
    """The tokenizer, trained on :data:`CORPUS` (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=2,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    vocab = tok.get_vocab()
    missing = [t for t in REQUIRED if t not in vocab]
    if missing:
        raise RuntimeError(f"the test BPE did not learn {missing}")
    return tok


def build_bpe_model(dest: Path, *, chat_template: str = CHATML_TEMPLATE) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (ChatML template) and a
    ``config.json`` (``vocab_size``) to ``dest``; returns ``dest``."""
    tok = train()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(tok.to_str())
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL
    }
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "added_tokens_decoder": added,
                "eos_token": IM_END,
                "pad_token": ENDOFTEXT,
                "clean_up_tokenization_spaces": False,
                "chat_template": chat_template,
            },
            indent=2,
        )
    )
    (dest / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "vocab_size": tok.get_vocab_size()})
    )
    return dest
