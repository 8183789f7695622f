"""Path policy: engine arguments that name files, folders or code on the server.

A spec's ``engine_args`` become ``vllm serve`` flags on a node, so an argument that
names a file (``chat_template: "/etc/passwd"``), a folder (``download_dir: "/"``) or
code (``trust_remote_code: true``, ``worker_cls``) reaches the server's file system
or interpreter. Such arguments are accepted only where the operator allowed them:

- a **path** only under one of ``settings.paths.allowed_roots``
  (``VLAB_PATHS__ALLOWED_ROOTS``, a JSON list of folders; default none: every path is
  refused), absolute, after ``..`` is folded (and, where the path exists on this
  host, after symbolic links are followed);
- **code** only with ``settings.paths.allow_remote_code``
  (``VLAB_PATHS__ALLOW_REMOTE_CODE=true``; default false).

Refusals are ``{"loc", "msg", "type"}`` entries (``path_not_allowed``,
``code_not_allowed``) naming the argument, the value and the setting to change; the
catalogue's check (:meth:`orchestrator.experiments.engine_catalog.EngineArgCatalog.check`) adds
them, so the baseline, every variant's ``changes``, every factor level, a schedule's
template and a parity check's arguments all pass through it.

**Which arguments** (:func:`path_like_args`): derived from vLLM's own argument
metadata (``jobs/launcher/vllm_launcher.py engine-args``: ``dest``, ``type``, ``choices``,
``is_bool_flag``, ``help``), so a new vLLM release's new file arguments are covered
without a change here. The rule:

1. *path*: a free-text argument (not a boolean flag, no ``choices``, not a number)
   whose name ends in ``_path``, ``_dir``, ``_file``, ``_keyfile``, ``_certfile`` or
   ``_certs``, or whose help's first sentence mentions a file, folder, directory or
   path (``"The file path to ..."``, ``"Name or path of ..."``, ``"Path to ..."``), not
   a remote file, an import path or a URL path. Of those, a help saying "name or
   path" makes it *name or path* (a Hugging Face id or a path) and one mentioning a
   template makes it *template or path*.
2. *code*: a free-text argument whose name ends in ``_cls`` or ``_plugin``, or whose
   help speaks of an import path, class names, ``module:class`` or a fully-qualified
   name; and any argument (boolean flags included) whose help mentions remote code.

The small explicit list, for what the metadata cannot tell (:data:`EXPLICIT`,
:data:`NOT_PATHS`, :data:`KEYWORDS`): ``tool_parser_plugin`` is a Python file's path
too; ``spec_model`` is a name or path (and a dotted ``pkg.Class`` is a custom
proposer: code); ``lora_modules`` holds ``name=path`` pairs or JSON objects with a
``path``; ``tool_server: demo`` runs model-generated code; ``root_path`` and
``disable_access_log_for_endpoints`` are URL paths, not files; ``generation_config``
takes the keywords ``auto`` and ``vllm``. ``config`` (a YAML file of further
arguments, which would bypass every check) and ``uds`` are reserved
(:data:`orchestrator.experiments.engine_catalog.RESERVED`).

Objects inside JSON-valued arguments (``speculative_config``, ``compilation_config``,
``profiler_config``, ``kv_transfer_config``, ``logging_config``...; as objects or JSON
text) are walked by key: ``path``/``*_path``/``*_dir``/``*_file`` are paths,
``model``/``tokenizer`` names or paths, ``*_cls``/``*_plugin``/``*_module_path`` code.

**Is the value a path?** vLLM accepts names and inline text in several of these, and
so does the policy, deciding by content:

- *path*: every value except the argument's default, an empty value and its keywords;
- *name or path* (``tokenizer``, ``hf_config_path``, ``spec_model``): a value shaped
  like a Hugging Face id (``name`` or ``org/name``: letters, digits, ``._-``, not
  starting with a dot, no ``..``) is an id; anything else (``/abs``, ``./rel``,
  ``~``, ``a/b/c``, ``..``) is a path;
- *template or path* (``chat_template``): text holding ``{{``, ``{%``, ``{#`` or a
  line break is an inline Jinja template (vLLM first tries to open it, which fails,
  then uses it as the template); a bare file name (no separator) is one of vLLM's
  built-in templates, looked up in the engine's working directory (the run's own
  folder) and then in vLLM's ``chat_templates`` folder; anything else is a path.

A relative path is refused even under a root (it would resolve against the
engine's working directory on the node): give the absolute path. The refusal says what
the value is (:meth:`PathPolicy.path_problem`): a ``file:`` URI or a URL (vLLM opens the
value as a local path, so ``file:///etc/passwd`` is not ``/etc/passwd`` to it), a Windows
drive path, a path in a home folder, a relative or an absolute path.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Kind = Literal["path", "name_or_path", "template_or_path", "lora_modules", "code"]

#: The settings a refusal names.
ROOTS_SETTING = "VLAB_PATHS__ALLOWED_ROOTS"
CODE_SETTING = "VLAB_PATHS__ALLOW_REMOTE_CODE"

#: Longest model name or path a request may give (characters); the file system's
#: NAME_MAX is 255 bytes per component, and Hugging Face ids are far shorter.
MAX_MODEL_CHARS = 255
#: Linux NAME_MAX (one path component) and PATH_MAX (a whole path), in bytes.
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4096

_NUMERIC_TYPES = frozenset({"int", "float", "human_readable_int", "human_readable_int_or_auto"})
_PATH_NAME = re.compile(r"(?:^|_)(?:path|dir|file|keyfile|certfile|certs)$")
_PATH_HELP = re.compile(
    r"\b(?:file|files|folder|folders|directory|directories|path|paths)\b", re.IGNORECASE
)
_NOT_PATH_HELP = re.compile(
    r"\b(?:remote files?|import path|endpoint paths?|url paths?|path based)\b", re.IGNORECASE
)
_NAME_OR_PATH_HELP = re.compile(r"\bname or path\b", re.IGNORECASE)
_TEMPLATE_HELP = re.compile(r"\btemplate\b", re.IGNORECASE)
_CODE_NAME = re.compile(r"(?:^|_)(?:cls|plugin)$")
_CODE_HELP = re.compile(
    r"\b(?:import path|class names?|fully-qualified|module:class)\b", re.IGNORECASE
)
_REMOTE_CODE_HELP = re.compile(r"\bremote code\b", re.IGNORECASE)

_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_BARE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DOTTED_IMPORT = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
_JINJA_MARKERS = ("{{", "{%", "{#", "\n")
#: Values that are not local paths although a path argument receives them.
_FILE_URI = re.compile(r"^file:", re.IGNORECASE)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


@dataclass(frozen=True)
class ArgPolicy:
    """How one argument's values are checked: its ``kinds``, non-path ``keywords``, and
    ``why`` it counts as code (for the refusal's message)."""

    kinds: frozenset[str]
    keywords: frozenset[str] = frozenset()
    why: str = ""


def _policy(*kinds: Kind, keywords: tuple[str, ...] = (), why: str) -> ArgPolicy:
    return ArgPolicy(frozenset(kinds), frozenset(keywords), why)


#: What vLLM's metadata cannot tell (see the module docstring).
EXPLICIT: dict[str, ArgPolicy] = {
    "tool_parser_plugin": _policy(
        "path", "code", why="a Python file vLLM imports (its help does not say it is a path)"
    ),
    "spec_model": _policy(
        "name_or_path", why="the draft model: a Hugging Face id or a path (a dotted name is code)"
    ),
    "lora_modules": _policy("lora_modules", why="'name=path' pairs or JSON with a 'path'"),
    "tool_server": _policy("code", why="'demo' runs model-generated Python code"),
}
#: Arguments the rule would take for paths that are not files on the server.
NOT_PATHS: dict[str, str] = {
    "root_path": "the URL prefix the API is served under",
    "disable_access_log_for_endpoints": "URL paths of the API",
}
#: Values of path arguments that are keywords, not paths.
KEYWORDS: dict[str, frozenset[str]] = {"generation_config": frozenset({"auto", "vllm"})}


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=[.;:])\s", text.strip(), maxsplit=1)[0]


def classify(info: dict[str, Any]) -> ArgPolicy | None:
    """The policy of one catalogue entry by the rule, or None when it names no file or code."""
    dest = str(info.get("dest") or "")
    if dest in EXPLICIT:
        return EXPLICIT[dest]
    help_text = str(info.get("help") or "")
    first = _first_sentence(help_text)
    free_text = (
        not info.get("is_bool_flag")
        and not info.get("choices")
        and info.get("type") not in _NUMERIC_TYPES
    )
    kinds: set[str] = set()
    why = ""
    if free_text and dest not in NOT_PATHS:
        by_name = bool(_PATH_NAME.search(dest))
        by_help = bool(_PATH_HELP.search(first)) and not _NOT_PATH_HELP.search(first)
        if by_name or by_help:
            if _NAME_OR_PATH_HELP.search(first):
                kinds.add("name_or_path")
            elif _TEMPLATE_HELP.search(first):
                kinds.add("template_or_path")
            else:
                kinds.add("path")
    if _REMOTE_CODE_HELP.search(help_text):
        kinds.add("code")
        why = "it runs Python code that comes with the model"
    elif free_text and (_CODE_NAME.search(dest) or _CODE_HELP.search(help_text)):
        kinds.add("code")
        why = "it imports a module, class or plugin by name"
    if not kinds:
        return None
    return ArgPolicy(frozenset(kinds), KEYWORDS.get(dest, frozenset()), why)


def path_like_args(args: dict[str, dict[str, Any]]) -> dict[str, ArgPolicy]:
    """``dest -> policy`` for every catalogue argument that names a file, folder or code."""
    out = {}
    for dest, info in args.items():
        pol = classify(info)
        if pol is not None:
            out[dest] = pol
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _empty(value: Any) -> bool:
    return value is None or value is False or value in ("", [], {})


def name_problem(value: str, what: str = "name") -> str | None:
    """Why ``value`` cannot be handed to the file system as a name or path, or None.

    Refuses NUL characters, more than :data:`PATH_MAX_BYTES` bytes, and a component
    longer than :data:`NAME_MAX_BYTES` bytes ("File name too long" otherwise).
    """
    if "\x00" in value:
        return f"the {what} contains a NUL character"
    raw = value.encode("utf-8", "surrogatepass")
    if len(raw) > PATH_MAX_BYTES:
        return f"the {what} is {len(raw)} bytes long, above the limit of {PATH_MAX_BYTES}"
    longest = max(len(part.encode("utf-8", "surrogatepass")) for part in value.split("/"))
    if longest > NAME_MAX_BYTES:
        return (
            f"a component of the {what} is {longest} bytes long, above the file system's "
            f"limit of {NAME_MAX_BYTES}"
        )
    return None


def model_name_problem(model: str) -> str | None:
    """Why ``model`` (a spec's or request's model) is refused before any look-up, or None."""
    if len(model) > MAX_MODEL_CHARS:
        return (
            f"the model name is {len(model)} characters long; at most {MAX_MODEL_CHARS} "
            "(a Hugging Face id, a generated model name or a directory path)"
        )
    return name_problem(model, "model name")


def _is_under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@dataclass(frozen=True)
class PathPolicy:
    """Where engine arguments may point: ``allowed_roots`` (absolute folders) and
    whether arguments that load code are allowed (``allow_remote_code``)."""

    allowed_roots: tuple[str, ...] = ()
    allow_remote_code: bool = False
    _real_roots: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, roots: list[Path] | tuple[Path, ...], allow_remote_code: bool) -> PathPolicy:
        normalized = tuple(os.path.normpath(os.path.abspath(str(r))) for r in roots)
        real = tuple(os.path.realpath(r) for r in normalized)
        return cls(normalized, allow_remote_code, real)

    # ------------------------------------------------------------------ paths

    def path_problem(self, value: str) -> str | None:
        """Why ``value`` may not be used as a path on the server, or None when it may; the
        reason starts with what the value is: a ``file:`` URI, a URL, a Windows drive
        path, a path in a home folder, a relative path or an absolute path."""
        too_long = name_problem(value, "path")
        if too_long:
            return too_long
        if _FILE_URI.match(value):
            return (
                "a file: URI, not a path (vLLM opens the value as it is: a relative path "
                "starting with 'file:' in the engine's working directory on the node); give "
                "the file's absolute path under an allowed root"
            )
        url = _URL.match(value)
        if url:
            return (
                f"a URL ({url.group(1)}://), not a path (vLLM reads this argument from the "
                "node's file system and downloads nothing); put the file under an allowed "
                "root and give its absolute path"
            )
        if _DRIVE.match(value):
            return (
                "a Windows drive path (the engine runs on Linux); give an absolute path "
                "under an allowed root"
            )
        if value.startswith("~"):
            return (
                "a path in a home folder (vLLM does not expand '~'); give an absolute path "
                "under an allowed root"
            )
        if not os.path.isabs(value):
            return (
                "a relative path (it would resolve against the engine's working directory "
                "on the node); give an absolute path under an allowed root"
            )
        if not self.allowed_roots:
            return f"an absolute path, and no folder is allowed: {ROOTS_SETTING} is not set"
        norm = os.path.normpath(value)
        if not _is_under(norm, self.allowed_roots):
            return (
                f"an absolute path outside the allowed roots {list(self.allowed_roots)} "
                f"({ROOTS_SETTING})"
            )
        # realpath follows every symbolic link of the parts that exist, also when the last
        # part does not exist yet (a file vLLM would create under a linked folder)
        try:
            real = os.path.realpath(norm)
        except (OSError, ValueError):
            real = norm
        if not _is_under(real, self._real_roots):
            return (
                f"an absolute path that leads through a symbolic link to {real}, outside "
                f"the allowed roots {list(self.allowed_roots)} ({ROOTS_SETTING})"
            )
        return None

    def _path_error(self, name: str, value: str, reason: str, loc: list[Any]) -> dict[str, Any]:
        roots = list(self.allowed_roots) or "none"
        return {
            "loc": loc,
            "msg": f"{name}: {_short(value)} is read as a file or folder on the server, "
            f"refused: {reason}. Engine arguments may name only absolute paths under the allowed "
            f"roots (now: {roots}); to allow a folder, add it to {ROOTS_SETTING} "
            "(a JSON list, e.g. '[\"/models\"]')",
            "type": "path_not_allowed",
        }

    def _code_error(self, name: str, value: Any, why: str, loc: list[Any]) -> dict[str, Any]:
        return {
            "loc": loc,
            "msg": f"{name}={_short(value)} makes vLLM run or import code the server does not "
            f"ship ({why}), refused; an operator may allow it with {CODE_SETTING}=true",
            "type": "code_not_allowed",
        }

    # ------------------------------------------------------------------ values

    def check_arg(
        self, name: str, value: Any, policy: ArgPolicy | None, default: Any, loc: list[Any]
    ) -> list[dict[str, Any]]:
        """Problems with ``value`` of engine argument ``name`` (``policy``: its entry of
        :func:`path_like_args`, None when the argument itself names nothing); nested
        objects of JSON-valued arguments are walked by key."""
        if _empty(value) or value == default:
            return []
        errors: list[dict[str, Any]] = []
        if policy is not None:
            errors += self._check_kinds(name, value, policy, loc)
        else:
            errors += self._walk(name, _as_json(value), loc)
        return errors

    def _check_kinds(
        self, name: str, value: Any, policy: ArgPolicy, loc: list[Any]
    ) -> list[dict[str, Any]]:
        kinds = policy.kinds
        if "code" in kinds and not self.allow_remote_code:
            return [self._code_error(name, value, policy.why or "it loads code", loc)]
        if "template_or_path" in kinds:
            return self._leaves(name, value, loc, self._template_or_path)
        if "lora_modules" in kinds:
            return self._lora_modules(name, value, loc)
        value = _as_json(value)
        if "name_or_path" in kinds:
            code_check = name == "spec_model"
            return self._leaves(
                name, value, loc, lambda n, v, lc: self._name_or_path(n, v, lc, code_check)
            )
        if "path" in kinds:
            keywords = policy.keywords

            def one(n: str, v: str, lc: list[Any]) -> list[dict[str, Any]]:
                if v in keywords or v == "":
                    return []
                reason = self.path_problem(v)
                return [self._path_error(n, v, reason, lc)] if reason else []

            return self._leaves(name, value, loc, one)
        return []

    def _leaves(self, name: str, value: Any, loc: list[Any], check: Any) -> list[dict[str, Any]]:
        """``check(name, string, loc)`` on every string in ``value`` (lists and object values)."""
        if isinstance(value, str):
            out: list[dict[str, Any]] = check(name, value, loc)
            return out
        errors: list[dict[str, Any]] = []
        if isinstance(value, list):
            for item in value:
                errors += self._leaves(name, item, loc, check)
        elif isinstance(value, dict):
            for key, item in value.items():
                errors += self._leaves(f"{name}.{key}", item, loc, check)
        return errors

    def _name_or_path(
        self, name: str, value: str, loc: list[Any], code_check: bool = False
    ) -> list[dict[str, Any]]:
        if code_check and _DOTTED_IMPORT.match(value) and not self.allow_remote_code:
            return [self._code_error(name, value, "a dotted name is a proposer class", loc)]
        if value == "" or (_HF_ID.match(value) and ".." not in value):
            return []
        reason = self.path_problem(value)
        return [self._path_error(name, value, reason, loc)] if reason else []

    def _template_or_path(self, name: str, value: str, loc: list[Any]) -> list[dict[str, Any]]:
        if any(marker in value for marker in _JINJA_MARKERS):
            return []  # inline Jinja text
        if _BARE_NAME.match(value) and ".." not in value:
            return []  # a built-in template's name (or a file in the run's own folder)
        reason = self.path_problem(value)
        return [self._path_error(name, value, reason, loc)] if reason else []

    def _lora_modules(self, name: str, value: Any, loc: list[Any]) -> list[dict[str, Any]]:
        """``name=path`` strings (the old format) or JSON objects with a ``path`` (as
        objects or JSON text), alone or in a list."""
        value = _as_json(value)
        if isinstance(value, list):
            return [e for item in value for e in self._lora_modules(name, item, loc)]
        if isinstance(value, dict):
            return self._walk(name, value, loc)
        if isinstance(value, str):
            return self._name_or_path(name, value.split("=", 1)[-1], loc)
        return []

    def _walk(self, name: str, value: Any, loc: list[Any]) -> list[dict[str, Any]]:
        """Keys of objects inside a JSON-valued argument that name files or code."""
        errors: list[dict[str, Any]] = []
        if isinstance(value, list):
            for item in value:
                errors += self._walk(name, item, loc)
        elif isinstance(value, dict):
            for key, item in value.items():
                here = f"{name}.{key}"
                pol = _nested_policy(str(key))
                if pol is not None and not _empty(item):
                    if pol == "code":
                        if not self.allow_remote_code:
                            errors.append(self._code_error(here, item, "it names code", loc))
                    elif pol == "name_or_path":
                        errors += self._leaves(
                            here, item, loc, lambda n, v, lc: self._name_or_path(n, v, lc, True)
                        )
                    else:
                        errors += self._check_kinds(here, item, _policy("path", why=""), loc)
                else:
                    errors += self._walk(here, item, loc)
        return errors

    # ------------------------------------------------------------------ models

    def model_dir_problem(self, directory: Path, extra_roots: list[Path]) -> str | None:
        """Why a model directory may not be served, or None. Only with roots set: the
        directory (links followed) must be under an allowed root or ``extra_roots``
        (the model roots and the generated models' folder)."""
        if not self.allowed_roots:
            return None
        real = os.path.realpath(directory)
        roots = self._real_roots + tuple(os.path.realpath(r) for r in extra_roots)
        if _is_under(real, roots):
            return None
        return (
            f"the model directory {real} is outside the allowed roots "
            f"{list(self.allowed_roots)}; add its folder to {ROOTS_SETTING}"
        )


def _nested_policy(key: str) -> str | None:
    """The kind of a key inside a JSON-valued argument, or None."""
    if key.endswith(("_cls", "_plugin", "_module_path")):
        return "code"
    if key in ("model", "tokenizer", "draft_model"):
        return "name_or_path"
    if key in ("path", "dir", "file") or key.endswith(("_path", "_dir", "_file", "_files")):
        return "path"
    return None


def _as_json(value: Any) -> Any:
    """A JSON text (an object or a list, as vLLM accepts for these arguments) parsed;
    anything else unchanged."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def policy_from_settings(settings: Any) -> PathPolicy:
    """The :class:`PathPolicy` of ``settings.paths``."""
    paths = settings.paths
    return PathPolicy.of(list(paths.allowed_roots), bool(paths.allow_remote_code))
