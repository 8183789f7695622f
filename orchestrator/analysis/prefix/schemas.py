"""The prefix analyser's data: requests in, rendered prompts, divergences, predictions,
advice and the analysis out (pydantic models, JSON-safe), with vLLM's default block size
and the kinds of cause a divergence is classified as.

Units as in :mod:`orchestrator.analysis.prefix`: positions and lengths are tokens unless
named ``*_chars`` (characters) or ``*_blocks`` (KV cache blocks); hit rates are fractions.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

#: vLLM's default KV cache block size (tokens per block) on GPU and CPU.
DEFAULT_BLOCK_SIZE = 16

CauseKind = Literal[
    "timestamp",
    "uuid",
    "request_id",
    "random_id",
    "user_name",
    "json_key_order",
    "whitespace",
    "reordered_messages",
    "reordered_tools",
    "end_of_prompt",
    "retokenization_whitespace_merge",
    "retokenization",
    "other",
]

#: Each cause in words, for people (the code stays the stable key).
CAUSE_LABELS: dict[str, str] = {
    "timestamp": "timestamp or date",
    "uuid": "UUID",
    "request_id": "request / trace / session id",
    "random_id": "random id (hex / base62)",
    "user_name": "user name",
    "json_key_order": "JSON key order",
    "whitespace": "whitespace",
    "reordered_messages": "messages in another order",
    "reordered_tools": "tools in another order",
    "end_of_prompt": "end of a prompt",
    "retokenization_whitespace_merge": "re-tokenization / whitespace merge",
    "retokenization": "re-tokenization (same text, other tokens)",
    "other": "other content",
}


class PrefixRequest(BaseModel):
    """One request of the workload: a chat (``messages`` + optional ``tools``), a text
    ``prompt`` or a prompt given as token ids (``prompt_token_ids``).

    ``messages`` is an OpenAI chat-completions list (``role``, ``content`` as a string or a
    list of ``{"type": "text", "text": ...}`` parts, optional ``name`` and ``tool_calls``);
    ``tools`` the OpenAI ``tools`` list. ``prompt_token_ids``: the prompt as the engine gets
    it (vLLM's completions ``prompt: [int, ...]``, ``TokensPrompt.prompt_token_ids``,
    ``/inference/v1/generate`` ``token_ids``): used as is, no special tokens added.
    Exactly one of ``messages``, ``prompt`` and ``prompt_token_ids`` is set.

    ``generated_token_ids``: the token ids the engine generated for this request (its
    answer: vLLM's ``choices[0].token_ids`` with ``return_token_ids``, or a trace's
    ``output_token_ids``), when known. The engine caches their full blocks too, so a later
    turn that resends the answer can reuse them if it resends the same tokens.
    """

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    generated_token_ids: list[Annotated[int, Field(ge=0)]] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PrefixRequest:
        kinds = [
            k
            for k, v in (
                ("messages", self.messages),
                ("prompt", self.prompt),
                ("prompt_token_ids", self.prompt_token_ids),
            )
            if v is not None
        ]
        if not kinds:
            raise ValueError('needs "messages" (chat) or "prompt" (completions)')
        if len(kinds) > 1:
            raise ValueError(f"has {' and '.join(repr(k) for k in kinds)}: send one of them")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("the prompt's token id list is empty")
        if self.messages is None and self.tools:
            raise ValueError('"tools" needs "messages" (a chat request), not "prompt"')
        return self


class SourceSpan(BaseModel):
    """A range of the rendered text that comes from one place of the request.

    ``rendered_start``/``rendered_end``: character range in the rendered prompt text.
    ``source``: where it comes from, e.g. ``messages[0].content``, ``messages[2].name``,
    ``messages[1].tool_calls[0].function.arguments``, ``tools[0].function.parameters``,
    ``prompt``. ``source_start``: character offset of ``rendered_start`` in the source
    string (for tool schemas: in the schema's JSON serialisation as rendered).
    """

    rendered_start: int
    rendered_end: int
    source: str
    source_start: int
    message_index: int | None = None
    role: str | None = None
    tool_index: int | None = None


class RenderedPrompt(BaseModel):
    """A request rendered and tokenized as the engine sees it.

    ``token_ids[i]`` covers ``text[offsets[i][0]:offsets[i][1]]`` (characters; special
    tokens added by the tokenizer have an empty range). ``spans`` map rendered characters
    to the request (characters in no span were written by the chat template). A prompt
    given as token ids has its ``text`` decoded by the tokenizer (``offsets`` from the
    decoding); without a tokenizer ``text_known`` is False, ``text`` is empty and every
    offset is ``(0, 0)``: only the ids can be compared.
    """

    index: int
    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]
    spans: list[SourceSpan]
    text_known: bool = True


class SourceLocation(BaseModel):
    """Where a token position falls, in the rendered text and in the request.

    ``token_position``: index of the token (tokens). ``rendered_chars``: the character
    range of the first *differing characters* in the rendered text (start inclusive, end
    exclusive). ``source``: ``messages[i].<field>``, ``tools[i].<json path>``, ``prompt``
    or ``template`` (text the chat template wrote). ``source_chars``: the same characters
    as a range of the source string (for tools: of the tool's rendered JSON); None for
    ``template``. ``value_chars``: source-string range of the whole volatile value the
    divergence falls in (the timestamp, id or name), when the cause is one.
    ``excerpt``: rendered text around the divergence (about 40 characters
    either side), for humans.
    """

    request: int
    token_position: int
    rendered_chars: tuple[int, int]
    source: str
    message_index: int | None = None
    role: str | None = None
    field: str | None = None
    tool_index: int | None = None
    source_chars: tuple[int, int] | None = None
    value_chars: tuple[int, int] | None = None
    excerpt: str = ""


class Divergence(BaseModel):
    """The first token where two groups of requests differ, and why.

    ``token_position`` (tokens) equals the length of their shared token prefix;
    ``shared_prefix_blocks`` is that in whole KV blocks (``token_position // block_size``).
    ``requests``: the two representatives compared (one of each group);
    ``locations``: the divergence in each of them. ``cause`` is the kind of content that
    differs and ``values`` the differing values (e.g. ``["9:41 AM", "9:42 AM"]``).
    ``json_path``: for ``json_key_order``, the object whose keys are ordered differently.
    ``actionable`` is False when the divergence is where prompts are expected to differ
    (inside the last message, i.e. the new turn) or where one prompt simply ends.
    ``retokenization_whitespace_merge`` / ``retokenization``: the two token runs from
    ``token_position`` on spell the *same text* and the prompts agree again right after
    them (or one ends inside them): the text was split into other tokens, e.g. two ``"\n"``
    tokens the model generated against the one ``"\n\n"`` token the tokenizer makes of
    the resent text, or a prompt ending in the middle of what the tokenizer merges when
    more text follows (``values``: the two token runs as text pieces, ``|`` between tokens).
    """

    token_position: int
    shared_prefix_blocks: int
    requests: tuple[int, int]
    locations: tuple[SourceLocation, SourceLocation]
    cause: CauseKind
    detail: str
    values: tuple[str, str]
    json_path: str | None = None
    actionable: bool

    @computed_field  # type: ignore[prop-decorator]
    @property
    def label(self) -> str:
        """The cause in words (:data:`CAUSE_LABELS`), e.g. "re-tokenization / whitespace
        merge" for ``retokenization_whitespace_merge``."""
        return CAUSE_LABELS.get(self.cause, self.cause)


class PrefixCluster(BaseModel):
    """Requests that share a longer token prefix than the whole set.

    ``shared_prefix_tokens`` (tokens) / ``shared_prefix_blocks`` (whole KV blocks) is the
    prefix common to every member; ``divergence`` is where the members split further
    (None for a single request or identical prompts).
    """

    requests: list[int]
    shared_prefix_tokens: int
    shared_prefix_blocks: int
    divergence: Divergence | None = None


class RequestPrediction(BaseModel):
    """Predicted prefix cache use of one request: ``prompt_tokens`` queried, ``cached_tokens``
    hit (whole blocks, tokens), ``reused_from``: the earlier request whose blocks it reuses.

    ``cached_tokens`` is split by where the blocks it hits come from (tokens, whole blocks,
    the three parts add up to ``cached_tokens``): ``cached_shared_prefix_tokens``: the
    prefix every request of the list shares (:attr:`HitRatePrediction.reusable_prefix_tokens`;
    0 for the first request, which has nothing to hit); ``cached_generated_tokens``: blocks
    first cached from tokens an earlier request *generated* (its ``generated_token_ids``,
    resent by this one); ``cached_prompt_tokens``: the rest, blocks of earlier prompts that
    only some requests share (a conversation's earlier turns, a cluster's longer prefix).
    """

    index: int
    prompt_tokens: int
    cached_tokens: int
    reused_from: int | None = None
    cached_shared_prefix_tokens: int = 0
    cached_generated_tokens: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cached_prompt_tokens(self) -> int:
        """Hit tokens from earlier prompts beyond the prefix all requests share."""
        return self.cached_tokens - self.cached_shared_prefix_tokens - self.cached_generated_tokens

    @model_validator(mode="after")
    def _parts_add_up(self) -> RequestPrediction:
        parts = (self.cached_shared_prefix_tokens, self.cached_generated_tokens)
        if min(parts) < 0 or sum(parts) > self.cached_tokens:
            raise ValueError(
                f"request {self.index}: the parts of cached_tokens ({self.cached_tokens}) do not "
                f"add up: shared prefix {parts[0]}, generated {parts[1]}"
            )
        return self


class HitRatePrediction(BaseModel):
    """Predicted ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` (tokens) of a
    workload sent in order to a fresh engine with an unbounded cache; ``hit_rate`` in [0, 1].

    The figures are those of ``per_request``, summed (a validator refuses any other):
    ``queries_tokens`` = sum of ``prompt_tokens``, ``hits_tokens`` = sum of
    ``cached_tokens``, and ``hits_tokens`` split as each request's is:
    ``hits_shared_prefix_tokens`` + ``hits_prompt_tokens`` + ``hits_generated_tokens``.
    ``shared_prefix_tokens``: the token prefix common to every prompt of the list;
    ``reusable_prefix_tokens``: what of it each request after the first hits, ``block_size
    * (min(shared, shortest - 1) // block_size)`` tokens, so ``hits_shared_prefix_tokens``
    = ``reusable_prefix_tokens * (requests - 1)``. ``generated_tokens_counted``: the
    requests whose generated token ids were given, so the blocks of their answers are
    counted (nothing of any other request's answer is).
    """

    block_size: int
    queries_tokens: int
    hits_tokens: int
    hit_rate: float
    per_request: list[RequestPrediction]
    shared_prefix_tokens: int = 0
    reusable_prefix_tokens: int = 0
    generated_tokens_counted: list[int] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hits_shared_prefix_tokens(self) -> int:
        """Hit tokens in the prefix every request shares (sum over ``per_request``)."""
        return sum(p.cached_shared_prefix_tokens for p in self.per_request)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hits_prompt_tokens(self) -> int:
        """Hit tokens in earlier prompts beyond that prefix (sum over ``per_request``)."""
        return sum(p.cached_prompt_tokens for p in self.per_request)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hits_generated_tokens(self) -> int:
        """Hit tokens in blocks earlier requests generated (sum over ``per_request``)."""
        return sum(p.cached_generated_tokens for p in self.per_request)

    @model_validator(mode="after")
    def _sums_are_the_details(self) -> HitRatePrediction:
        queries = sum(p.prompt_tokens for p in self.per_request)
        hits = sum(p.cached_tokens for p in self.per_request)
        rate = hits / queries if queries else 0.0
        if (self.queries_tokens, self.hits_tokens) != (queries, hits) or not math.isclose(
            self.hit_rate, rate, rel_tol=1e-9, abs_tol=1e-12
        ):
            raise ValueError(
                f"the prediction's totals ({self.hits_tokens} hits / {self.queries_tokens} "
                f"queries, rate {self.hit_rate}) are not those of its requests ({hits} / "
                f"{queries}, rate {rate})"
            )
        return self


class Advice(BaseModel):
    """A change for one ``cause`` found at ``source`` (the ``step``-th cause of
    :attr:`PrefixAnalysis.causes`, prompt order).

    ``predicted_hit_rate_after`` (fraction) / ``predicted_hits_tokens_after`` (tokens):
    the prediction re-run on the requests rewritten as this change *and every earlier
    cause's change* (steps ``0..step``) say, i.e. cumulative (None when the change cannot
    be simulated, e.g. text the chat template inserts). ``raises_hit_rate``: the change
    is part of the plan that raises the predicted hit rate: the simulated steps up to the
    one with the best cumulative hit rate, when that beats the workload as it is. A step
    that gains nothing alone but is needed for a later one (a clock before an id) is
    part of it; a change that cannot raise it (a clock already at the end of the shared
    text) or cannot be simulated is not.
    """

    cause: CauseKind
    source: str
    change: str
    step: int = 0
    predicted_hit_rate_after: float | None = None
    predicted_hits_tokens_after: int | None = None
    raises_hit_rate: bool = False


class NotCompared(BaseModel):
    """A request left out of the comparison, and why (``request``: where it is in the
    input, e.g. ``requests[3]`` or ``requests[3].prompt[1]``)."""

    request: str
    reason: str


class Resend(BaseModel):
    """A later turn that resends an earlier request's answer, checked token by token.

    ``request`` resends the answer of ``previous`` (indices in the analysed list): a chat
    whose messages continue ``previous``'s messages with an assistant message
    (``message_index``), or a prompt that starts with ``previous``'s prompt. The engine
    held ``previous``'s prompt followed by the tokens it generated: ``checked_with`` says
    how those are known: ``generated_token_ids`` (given with ``previous``: what the engine
    really generated) or ``tokenizer`` (not given: the answer as the tokenizer encodes it
    on its own, right after ``previous``'s prompt, i.e. ``encode(a) + encode(b)`` against
    this request's ``encode(a + b)``).

    Tokens: ``cached_tokens`` = that sequence less its last token (vLLM computes, so
    caches, at most ``len - 1`` tokens of a finished request); ``matching_tokens`` = its
    common token prefix with this request's prompt; ``reusable_tokens`` = the whole
    blocks of that this request can hit, ``block_size * (min(matching, cached, prompt - 1)
    // block_size)``; ``reusable_tokens_if_stable``: the same had the answer come back as
    the cached tokens (None when the resent text differs from the cached text, so no
    tokenization could match); ``lost_tokens`` = the difference.
    ``reusable_tokens_in_prediction``: of ``reusable_tokens``, what the hit-rate prediction
    counts: all of them with ``generated_token_ids``; with ``tokenizer`` only the whole
    blocks of ``previous``'s prompt, because the answer's own encoding is an assumption
    about what the model generated, not a fact (the prediction for ``request`` hits at
    least this many tokens). ``divergence``: where the
    two first differ and why, located in this request (``locations[1]``) and in the
    cached sequence (``locations[0]``: source ``generated_token_ids`` for generated
    tokens); None when the resend matches all the cache holds.
    """

    request: int
    previous: int
    message_index: int | None = None
    checked_with: Literal["generated_token_ids", "tokenizer"]
    cached_tokens: int
    matching_tokens: int
    reusable_tokens: int
    reusable_tokens_if_stable: int | None = None
    lost_tokens: int | None = 0
    reusable_tokens_in_prediction: int = 0
    divergence: Divergence | None = None


class PrefixAnalysis(BaseModel):
    """Result of :func:`analyze_prefix`.

    ``num_requests``: requests compared; ``request_sources[i]``: where request ``i`` is in
    the input (``requests[3]``; ``requests[3].prompt[1]`` for a batch prompt), every index
    in the result refers to this list. ``prompt_tokens``: per request (tokens).
    ``shared_prefix_tokens``: token prefix common to all requests; ``shared_prefix_blocks``:
    in whole KV blocks; ``reusable_prefix_tokens``: what APC can reuse of it, ``block_size *
    (min(shared, shortest - 1) // block_size)`` tokens. ``divergence``: the first divergence
    of the whole set (None for one request or identical prompts). ``clusters``: the groups
    the set splits into at that divergence. ``causes``: every actionable divergence found
    along the prompts, in prompt order: the first one, then (after simulating its change
    on the requests, re-rendering and comparing again) the next one, and so on, at most
    ``MAX_CAUSE_ROUNDS`` rounds (divergences of clusters are included when the set's own
    divergence cannot be changed), then the first re-tokenized resend. ``prediction``: the
    best hit rate for the workload as it is (blocks of generated tokens are counted when
    ``generated_token_ids`` are given: ``prediction_counts_generated_tokens``); ``advice``:
    one change per cause, with the cumulative hit rate predicted after it, in prompt order;
    ``raises_hit_rate`` marks the plan (the steps to make together).
    ``predicted_hit_rate_after_advice``: with every simulated change applied;
    ``predicted_hit_rate_after_plan``: with the plan's changes applied (the steps marked
    ``raises_hit_rate``: the figure to show beside the plan; None without a plan).
    ``resends``: every later turn that resends an earlier answer (:class:`Resend`).
    ``generated_tokens_not_counted``: what the prediction leaves out: the requests whose
    answer a later request resends (or whose prompt a later one extends) without their
    ``generated_token_ids``: the engine caches what it generated there too, so those
    later requests may hit more than predicted (a note says so).

    Headline and details come from one computation: ``shared_prefix_tokens`` and
    ``reusable_prefix_tokens`` are the prediction's own (:class:`HitRatePrediction`), whose
    totals are the sums of its ``per_request`` figures, generated tokens included where
    given.
    ``not_compared``: requests left out (text without a tokenizer, prompt embeddings).
    ``notes``: facts about the rendering worth knowing (tools the chat template does not
    render, a date the chat template writes itself, requests left out).
    """

    model_dir: str | None
    block_size: int
    num_requests: int
    request_sources: list[str] = Field(default_factory=list)
    prompt_tokens: list[int]
    shared_prefix_tokens: int
    shared_prefix_blocks: int
    reusable_prefix_tokens: int
    divergence: Divergence | None
    clusters: list[PrefixCluster]
    causes: list[Divergence]
    prediction: HitRatePrediction
    prediction_counts_generated_tokens: bool = False
    advice: list[Advice]
    predicted_hit_rate_after_advice: float | None = None
    predicted_hit_rate_after_plan: float | None = None
    resends: list[Resend] = Field(default_factory=list)
    generated_tokens_not_counted: list[int] = Field(default_factory=list)
    not_compared: list[NotCompared] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class PrefixFinding(BaseModel):
    """A finding on a run: measured prefix cache hit rate far from the predicted one.

    ``evidence`` holds ``predicted_hit_rate``, ``measured_hit_rate`` (fractions),
    ``difference`` (measured - predicted) and ``tolerance``, plus the server signals the
    finding weighed when they were given (``num_preemptions``, ``kv_cache_usage_peak``,
    ``num_requests_waiting_peak``, ``vllm_version``, token counts), each absent when not
    measured. ``explanation``: what the numbers say caused the gap
    (``preemption_recompute``: preempted requests' recomputed tokens counted as hits
    explain it; ``preemption_recompute_possible``: they may; ``not_preemption``: they
    cannot, the counters do not count them or none happened; ``eviction_likely``: the KV
    cache was full; None: the signals were not measured). ``action``: the change to make
    first, in words.
    """

    code: Literal["hit_rate_below_prediction", "hit_rate_above_prediction"]
    severity: Literal["info", "warning"]
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    explanation: (
        Literal[
            "preemption_recompute",
            "preemption_recompute_possible",
            "not_preemption",
            "eviction_likely",
        ]
        | None
    ) = None
    action: str | None = None
