"""Prompt-prefix analyser: how much of a workload's prompts the prefix cache (APC) can reuse.

Pure module: no database, no Ray, no HTTP. Input is a list of requests (OpenAI chat
``messages`` with optional ``tools``, completion ``prompt`` strings, prompts given as token
ids: ``prompt: [int]``, batches, vLLM's ``prompt_token_ids``; optionally the token ids the
engine generated for each) and a model directory (none: token ids only); output is a
JSON-safe :class:`PrefixAnalysis`. Units: positions and lengths of
prompts are **tokens** unless named ``*_chars`` (characters of a string) or ``*_blocks``
(KV cache blocks of ``block_size`` tokens); hit rates are fractions in ``[0, 1]``.

What it does, in order:

1. **Render** every request the way vLLM's OpenAI server does: chat requests through the
   model's chat template (``transformers`` ``apply_chat_template(messages, tools=tools,
   tokenize=False, add_generation_prompt=True)``), then tokenized *without* adding special
   tokens (the template writes BOS itself; vLLM's chat endpoint defaults to
   ``add_special_tokens=False``); raw prompts are tokenized *with* special tokens (the
   completions endpoint's default). Every token keeps its character range in the rendered
   text (offset mapping) and every rendered character is mapped back to its source: a
   message field (``messages[1].content``), a tool schema path
   (``tools[0].function.parameters.required``) or text the template itself wrote
   (``template``).
2. **Compare tokens, not strings**: the shared prefix is the longest common prefix of the
   token id lists. A string comparison overstates it: a word whose tail changed is a
   different token from its first character on (or earlier, when a whitespace run merges
   differently), and vLLM hashes token ids.
3. **Cluster** requests by the token at the first divergence (each cluster shares a longer
   prefix) and **classify** each divergence: ``timestamp``, ``uuid``, ``request_id``,
   ``random_id`` (random hex / base62), ``user_name``, ``json_key_order``, ``whitespace``,
   ``reordered_messages``, ``reordered_tools``, ``end_of_prompt`` (one prompt is a prefix of
   the other), ``retokenization_whitespace_merge`` / ``retokenization`` (the same text
   split into other tokens: :mod:`~orchestrator.analysis.prefix.tokens`) or ``other``.
4. **Predict** the prefix cache hit rate of the workload sent in order, and re-predict it
   after each advised change (the volatile span moved to the end of the last message, JSON
   keys sorted, tools sorted, whitespace normalised, messages kept in one order).
5. **Follow the prefix**: a prompt often holds several volatile values (an id, then a
   clock). The change for the first cause is simulated on the requests, which are
   re-rendered and compared again to find the next cause, and so on (at most
   ``MAX_CAUSE_ROUNDS`` rounds, until the prompts differ only in the last message). Each
   advice carries the hit rate predicted with its change and every earlier one applied
   (cumulative) and whether that raises the hit rate; changes that do not (e.g. moving a
   clock that already sits at the end of the shared text) are listed after the others.
6. **Check multi-turn resends** token by token: a later turn that resends an earlier
   answer as text against the tokens the engine held (the generated ids when given, else
   the tokenizer's ``encode(a) + encode(b)`` at the turn boundary); the reusable tokens are
   counted up to the first difference and a re-tokenization is a cause with its advice
   (:mod:`~orchestrator.analysis.prefix.resend`).
7. **Note** what the rendering hides: tools the chat template does not render (they do
   not reach the prompt, so they cannot break the prefix), a date the template writes
   itself.

Malformed requests raise :class:`ValueError` whose message starts with ``requests[i]: ``
(``i``: the index in the list given) and says what is wrong in plain words.

How vLLM (V1 engine; checked against the vLLM 0.32 sources of the engine environment)
counts prefix cache hits, which :func:`predict_hit_rate` reproduces:

- Only **full blocks** are hashed and cached; a block's hash chains its parent's hash and
  its ``block_size`` token ids (``vllm/v1/core/kv_cache_utils.py``, docs
  ``design/prefix_caching.md``: "we only cache full blocks").
- ``KVCacheManager.get_computed_blocks`` (``vllm/v1/core/kv_cache_manager.py``) looks up
  at most ``request.num_tokens - 1`` tokens: "When all tokens hit the cache, we must
  recompute the last token to obtain logits", and ``find_longest_cache_hit``
  (``vllm/v1/core/single_type_kv_cache_manager.py``) walks at most ``max_length //
  block_size`` whole blocks. So a request of ``n`` prompt tokens can hit at most
  ``block_size * ((n - 1) // block_size)`` tokens.
- ``PrefixCacheStats.record`` (``vllm/v1/metrics/stats.py``) adds ``num_tokens`` to
  ``queries`` and the hit tokens to ``hits`` per scheduled request; the Prometheus
  counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` are these, in
  tokens. vLLM 0.32 books re-scheduled preempted requests separately
  (``preempted_queries``/``preempted_hits``); versions before vllm-project/vllm#25787
  (the fix of vllm-project/vllm#25780, merged 2025-09-26) counted them again, so a run
  with preemptions can *measure* more hits than any prompt layout explains:
  :func:`hit_rate_finding` weighs preemptions, KV cache usage and waiting requests.

The prediction assumes an unbounded cache (no eviction) and requests admitted one after
another in list order; only prompt blocks are counted unless a request carries the token
ids the engine generated for it: then their blocks are cached too (vLLM hashes
``all_token_ids``), and a later turn that resends exactly those tokens hits them. It is
therefore the best hit rate the engine can reach for this request list.

Headlines are the sums of their details (one computation, :func:`predict_hit_rate`):
``hits_tokens`` is the sum of the per-request hits, each split by where its blocks come
from (the prefix every request shares, earlier prompts only some share, tokens an earlier
request generated), and so are the totals; ``shared_prefix_tokens`` /
``reusable_prefix_tokens`` are the prediction's own. What the prediction leaves out is
named: the requests whose answer a later request resends without its generated ids
(``generated_tokens_not_counted``, with a note), and of each resend's reusable tokens the
part the prediction counts (``reusable_tokens_in_prediction``).

Modules (each imports only the ones above it):

- :mod:`~orchestrator.analysis.prefix.schemas`: the models in and out, :data:`CauseKind`,
  :data:`DEFAULT_BLOCK_SIZE`;
- :mod:`~orchestrator.analysis.prefix.inputs`: request-like items checked and coerced;
- :mod:`~orchestrator.analysis.prefix.tokens`: token ids decoded with character ranges, and
  the same text split into other tokens (re-tokenization);
- :mod:`~orchestrator.analysis.prefix.rendering`: tokenizer loading, chat template
  rendering, token offsets and source spans (step 1);
- :mod:`~orchestrator.analysis.prefix.prediction`: shared token prefix and the predicted
  hit rate (steps 2 and 4);
- :mod:`~orchestrator.analysis.prefix.patterns`: regular expressions of volatile values;
- :mod:`~orchestrator.analysis.prefix.divergence`: locating and classifying a divergence
  (step 3);
- :mod:`~orchestrator.analysis.prefix.changes`: the advised change per cause, in words
  and simulated on the requests (step 5);
- :mod:`~orchestrator.analysis.prefix.resend`: multi-turn resends against the tokens the
  engine held (step 6);
- :mod:`~orchestrator.analysis.prefix.analyze`: :func:`analyze_prefix`, following the
  causes, the resends and the notes (steps 5 to 7);
- :mod:`~orchestrator.analysis.prefix.findings`: measured vs predicted hit rate on a run,
  weighed against preemptions, KV cache usage and waiting requests, and the summary a run
  keeps.
"""

from __future__ import annotations

from orchestrator.analysis.prefix.analyze import MAX_CAUSE_ROUNDS, analyze_prefix
from orchestrator.analysis.prefix.findings import hit_rate_finding, summarize
from orchestrator.analysis.prefix.inputs import coerce_requests
from orchestrator.analysis.prefix.prediction import predict_hit_rate, shared_prefix_length
from orchestrator.analysis.prefix.rendering import load_tokenizer, render_request
from orchestrator.analysis.prefix.resend import find_resends
from orchestrator.analysis.prefix.schemas import (
    CAUSE_LABELS,
    DEFAULT_BLOCK_SIZE,
    Advice,
    CauseKind,
    Divergence,
    HitRatePrediction,
    NotCompared,
    PrefixAnalysis,
    PrefixCluster,
    PrefixFinding,
    PrefixRequest,
    RenderedPrompt,
    RequestPrediction,
    Resend,
    SourceLocation,
    SourceSpan,
)

__all__ = [
    "CAUSE_LABELS",
    "DEFAULT_BLOCK_SIZE",
    "MAX_CAUSE_ROUNDS",
    "Advice",
    "CauseKind",
    "Divergence",
    "HitRatePrediction",
    "NotCompared",
    "PrefixAnalysis",
    "PrefixCluster",
    "PrefixFinding",
    "PrefixRequest",
    "RenderedPrompt",
    "RequestPrediction",
    "Resend",
    "SourceLocation",
    "SourceSpan",
    "analyze_prefix",
    "coerce_requests",
    "find_resends",
    "hit_rate_finding",
    "load_tokenizer",
    "predict_hit_rate",
    "render_request",
    "shared_prefix_length",
    "summarize",
]
