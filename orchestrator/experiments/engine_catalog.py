"""vLLM's own engine-argument list, used to validate specs at submission.

The list comes from the engine environment itself (``jobs/launcher/vllm_launcher.py
engine-args`` builds ``vllm serve``'s parser and dumps every argument), is
cached as JSON in ``<home>/engine_args.json`` keyed by the engine python, and
is loaded once per process. Nothing here imports vLLM.

:func:`load_catalog` returns the catalogue bound to the settings' path policy
(:mod:`orchestrator.experiments.pathpolicy`): :meth:`EngineArgCatalog.check` then also refuses
arguments that name files, folders or code on the server outside what the operator
allowed. A catalogue built without settings (:meth:`EngineArgCatalog.from_doc`) has
the strictest policy: no folder allowed, no code.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.engine.queries import list_engine_args
from jobs.engine.server import EngineError
from orchestrator.core.errors import EngineUnavailableError
from orchestrator.core.settings import Settings
from orchestrator.experiments.pathpolicy import (
    ArgPolicy,
    PathPolicy,
    path_like_args,
    policy_from_settings,
)

# Set by the orchestrator for every run, or through ``layout``: refused in engine_args.
RESERVED: dict[str, str] = {
    "model": "set the experiment's `model` instead",
    "model_tag": "set the experiment's `model` instead",
    "revision": "set the experiment's `revision` instead (resolved on the node that runs it)",
    "distributed_executor_backend": "set `layout.executor` instead ('mp' or 'ray')",
    "served_model_name": "set by the orchestrator",
    "host": "set by the orchestrator",
    "port": "set by the orchestrator",
    "tensor_parallel_size": "set `layout.tensor_parallel_size` instead",
    "pipeline_parallel_size": "set `layout.pipeline_parallel_size` instead",
    "headless": "set by the orchestrator for multi-node launches",
    "nnodes": "set by the orchestrator for multi-node launches",
    "node_rank": "set by the orchestrator for multi-node launches",
    "master_addr": "set by the orchestrator for multi-node launches",
    "master_port": "set by the orchestrator for multi-node launches",
    "api_server_count": "set by the orchestrator",
    "config": "give the arguments in engine_args (a config file would bypass their checks)",
    "uds": "set by the orchestrator (the server listens on host:port)",
}

#: Largest integer an engine argument may take: vLLM hands them to C++/torch (int64).
INT64_MAX = 2**63 - 1
#: Engine arguments kept in a 32-bit column (``runs.max_model_len``) and bounded by it.
INT32_ARGS = {"max_model_len": 2**31 - 1}


@dataclass
class EngineArgCatalog:
    """Every ``vllm serve`` argument of one engine environment.

    ``args`` maps the snake_case ``dest`` to the entry the launcher printed:
    ``options``, ``default``, ``type``, ``choices``, ``is_bool_flag``, ``help``.
    """

    vllm_version: str
    args: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: where arguments naming files, folders or code may point (default: nowhere)
    policy: PathPolicy = field(default_factory=PathPolicy)
    _path_args: dict[str, ArgPolicy] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> EngineArgCatalog:
        return cls(
            vllm_version=str(doc.get("vllm_version", "unknown")),
            args={a["dest"]: a for a in doc.get("args", []) if a.get("dest")},
        )

    def with_policy(self, policy: PathPolicy) -> EngineArgCatalog:
        """This catalogue checking paths and code with ``policy``."""
        bound = dataclasses.replace(self, policy=policy)
        bound._path_args = self.path_args
        return bound

    @property
    def path_args(self) -> dict[str, ArgPolicy]:
        """The arguments that name files, folders or code (:func:`path_like_args`)."""
        if self._path_args is None:
            self._path_args = path_like_args(self.args)
        return self._path_args

    def defaults(self) -> dict[str, Any]:
        """``dest -> default`` for every argument vLLM knows (JSON-safe values)."""
        return {k: v.get("default") for k, v in sorted(self.args.items())}

    def resolve(self, explicit: dict[str, Any]) -> dict[str, Any]:
        """The full resolved engine arguments: vLLM's defaults overlaid with ``explicit``."""
        resolved = self.defaults()
        resolved.update(explicit)
        return resolved

    def check_spec(
        self, baseline: dict[str, Any], changes_at: list[tuple[list[str | int], Any]]
    ) -> list[dict[str, Any]]:
        """Problems with a spec's engine arguments: the baseline's (located at
        ``body.baseline.engine_args``), then each ``engine_args.<name>`` change of
        ``changes_at`` (``(loc, changes)`` per variant, located at ``[*loc, "changes",
        path]``; ``changes`` may be anything a raw document holds). The one loop over a
        submission's engine arguments, as :meth:`check` judges each."""
        errors = self.check(baseline, ["body", "baseline", "engine_args"])
        for loc, changes in changes_at:
            for path, value in (changes if isinstance(changes, dict) else {}).items():
                if isinstance(path, str) and path.startswith("engine_args."):
                    for err in self.check({path.split(".", 1)[1]: value}, []):
                        errors.append({**err, "loc": [*loc, "changes", path]})
        return errors

    def check(self, engine_args: dict[str, Any], loc: list[str | int]) -> list[dict[str, Any]]:
        """Problems with ``engine_args`` as ``{"loc", "msg", "type"}`` entries (empty if fine).

        Checks: the name is one vLLM knows (with a close-match suggestion),
        is not reserved, the value fits the argument's kind (boolean flags take
        booleans, int/float arguments numbers within what stores them, choices one
        of them), and a value naming a file, folder or code on the server is
        allowed by :attr:`policy` (``path_not_allowed``, ``code_not_allowed``).
        """
        errors: list[dict[str, Any]] = []
        for name, value in engine_args.items():
            where = [*loc, name]
            if name in RESERVED:
                errors.append(
                    {"loc": where, "msg": f"{name}: {RESERVED[name]}", "type": "reserved_arg"}
                )
                continue
            info = self.args.get(name)
            if info is None:
                near = difflib.get_close_matches(name, list(self.args), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                errors.append(
                    {
                        "loc": where,
                        "msg": f"vLLM {self.vllm_version} has no engine argument {name!r}{hint}",
                        "type": "unknown_engine_arg",
                    }
                )
                continue
            problem = _value_problem(info, value)
            if problem:
                errors.append({"loc": where, "msg": problem, "type": "bad_engine_arg_value"})
                continue
            errors += self.policy.check_arg(
                name, value, self.path_args.get(name), info.get("default"), where
            )
        return errors


#: Deepest nesting of brackets accepted in a JSON-text engine argument (vLLM's own
#: configs nest a few levels; Python's JSON parser gives up near 1,000).
MAX_JSON_DEPTH = 64


def _json_depth(text: str) -> int:
    """Deepest bracket nesting of ``text`` (brackets inside strings counted too: an upper
    bound, enough to refuse a value before any parser recurses into it)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _value_problem(info: dict[str, Any], value: Any) -> str | None:
    name = info["dest"]
    if isinstance(value, str) and _json_depth(value) > MAX_JSON_DEPTH:
        return f"{name}: JSON nested deeper than {MAX_JSON_DEPTH} levels"
    if value is None:
        return None
    if info.get("is_bool_flag"):
        if not isinstance(value, bool):
            return f"{name} is a boolean flag; got {value!r}"
        return None
    choices = info.get("choices")
    if choices and not isinstance(value, list) and value not in choices:
        return f"{name} must be one of {choices}; got {value!r}"
    kind = info.get("type")
    if kind in ("human_readable_int", "human_readable_int_or_auto"):
        # vLLM accepts 2048, "2k" (x1000), "2K" (x1024), "1.5M"...; "auto" / -1 where allowed
        if isinstance(value, bool):
            return f"{name} takes an integer like 2048 or '2k'; got {value!r}"
        if isinstance(value, int):
            return _int_bound_problem(name, value)
        if isinstance(value, str) and kind.endswith("_or_auto") and value.lower() in ("auto", "-1"):
            return None
        if isinstance(value, str) and HUMAN_INT.fullmatch(value):
            return _int_bound_problem(name, parse_human_int(value) or 0)
        return f"{name} takes an integer like 2048 or '2k'; got {value!r}"
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name} takes an integer; got {value!r}"
    if kind == "int":
        return _int_bound_problem(name, value)
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, int | float)):
        return f"{name} takes a number; got {value!r}"
    return None


def _int_bound_problem(name: str, value: int) -> str | None:
    top = INT32_ARGS.get(name, INT64_MAX)
    if -top - 1 <= value <= top:
        return None
    return f"{name} must be at most {top}; got {value}"


#: vLLM's human-readable integers: digits with an optional decimal part and k/m/g/t suffix.
HUMAN_INT = re.compile(r"\d+(\.\d+)?[kKmMgGtT]?")

_SUFFIX_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SUFFIX_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(value: Any) -> int | None:
    """An integer engine-argument value as vLLM reads it: ``2048``, ``"2k"`` (2000),
    ``"2K"`` (2048), ``"1.5M"``; None for anything else (``"auto"``, -1, bools).

    Source: vLLM's ``human_readable_int`` (lowercase suffixes are powers of
    1000, uppercase powers of 1024).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if not isinstance(value, str) or not HUMAN_INT.fullmatch(value):
        return None
    suffix = value[-1]
    if suffix.isdigit():
        return int(float(value))
    mult = _SUFFIX_DECIMAL.get(suffix) or _SUFFIX_BINARY[suffix]
    return int(float(value[:-1]) * mult)


_lock = threading.Lock()
_cache: dict[str, EngineArgCatalog] = {}


def load_catalog(settings: Settings, *, refresh: bool = False) -> EngineArgCatalog:
    """The catalogue for ``settings.engine.python``: memory, then file cache, then the engine.

    Raises :class:`EngineUnavailableError` when the engine environment is
    missing or cannot describe its arguments. The catalogue returned checks paths
    and code with the path policy of ``settings`` (``settings.paths``).
    """
    return _load_catalog(settings, refresh=refresh).with_policy(policy_from_settings(settings))


def _load_catalog(settings: Settings, *, refresh: bool) -> EngineArgCatalog:
    python = str(settings.engine.python)
    cache_file: Path = settings.engine_args_cache
    with _lock:
        if not refresh and python in _cache:
            return _cache[python]
        if not refresh and cache_file.exists():
            try:
                stored = json.loads(cache_file.read_text())
                if stored.get("engine_python") == python:
                    cat = EngineArgCatalog.from_doc(stored)
                    _cache[python] = cat
                    return cat
            except (OSError, ValueError):
                pass
        if not Path(python).exists():
            raise EngineUnavailableError(
                f"engine environment not found at {python}; run `make engine` "
                "(or set VLAB_ENGINE__PYTHON)"
            )
        try:
            doc = list_engine_args(python)
        except EngineError as exc:
            raise EngineUnavailableError(f"cannot list vLLM engine arguments: {exc}") from exc
        doc["engine_python"] = python
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(cache_file)
        cat = EngineArgCatalog.from_doc(doc)
        _cache[python] = cat
        return cat
