"""A spec file read for ``vlab submit``: JSON or bounded YAML, replay files inlined.

:func:`load_spec_file` reads at most :data:`SPEC_FILE_MAX_BYTES`, parses YAML with
bounded aliases (:func:`load_yaml_spec`) and puts each ``workload.replay_file``'s
requests in place; every problem is a :class:`CliError` of one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from jobs.load.replay import ReplayFileError, load_jsonl

__all__ = ["CliError", "load_spec_file", "load_yaml_spec"]


class CliError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


#: Largest spec file read (bytes): the API's default request body limit.
SPEC_FILE_MAX_BYTES = 16 * 2**20
#: YAML aliases (``*name``) a spec may use ...
YAML_MAX_ALIASES = 100
#: ... and how many nodes they may repeat in all (the document as the API receives it
#: holds at most this many nodes more than the file itself).
YAML_MAX_REPEATED_NODES = 10_000


class _SpecYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with bounded aliases.

    Anchors and aliases stay allowed (sharing a workload between variants is a
    fair use), but a spec is a small document: more than :data:`YAML_MAX_ALIASES`
    aliases, aliases that repeat more than :data:`YAML_MAX_REPEATED_NODES` nodes once
    expanded (a "billion laughs" bomb: a few lines that expand to gigabytes when
    sent as JSON), or an alias inside the node it names (a recursive structure) are
    refused while composing, before anything is built or expanded.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > YAML_MAX_ALIASES:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"more than {YAML_MAX_ALIASES} aliases (*name) in one spec",
                    self.peek_event().start_mark,
                )
        return super().compose_node(parent, index)


def _expanded_size(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """Nodes of ``node`` with every alias expanded (each distinct node counted once per
    use), in time linear in the distinct nodes; raises on a recursive alias."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in open_:
        raise yaml.composer.ComposerError(
            None, None, "an alias inside the node it names (a recursive structure)", node.start_mark
        )
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, memo, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(
            _expanded_size(k, memo, open_) + _expanded_size(v, memo, open_) for k, v in node.value
        )
    open_.discard(key)
    memo[key] = size
    return size


def load_yaml_spec(text: str) -> Any:
    """A YAML document parsed with :class:`_SpecYamlLoader` (safe tags only, bounded
    aliases). Raises :class:`yaml.YAMLError` with the position of the problem."""
    loader = _SpecYamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        memo: dict[int, int] = {}
        expanded = _expanded_size(node, memo, set())
        if expanded - len(memo) > YAML_MAX_REPEATED_NODES:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"its aliases repeat {expanded - len(memo)} nodes, more than "
                f"{YAML_MAX_REPEATED_NODES} (an alias bomb?)",
                node.start_mark,
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read a spec from JSON or YAML (by extension; YAML is a superset of JSON).

    At most :data:`SPEC_FILE_MAX_BYTES` are read; YAML goes through
    :func:`load_yaml_spec` (aliases bounded). Raises :class:`CliError` with the
    parser's message and position: every problem is one line, never a traceback.
    """
    try:
        with path.open("rb") as f:
            raw = f.read(SPEC_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise CliError(f"{path}: cannot read the spec: {exc.strerror or exc}") from exc
    if len(raw) > SPEC_FILE_MAX_BYTES:
        raise CliError(
            f"{path}: the spec is larger than {SPEC_FILE_MAX_BYTES} bytes; give long "
            "request lists as a workload.replay_file"
        )
    try:
        text = raw.decode("utf-8")
        data = json.loads(text) if path.suffix == ".json" else load_yaml_spec(text)
    except UnicodeDecodeError as exc:
        raise CliError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise CliError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from exc
    except RecursionError as exc:
        raise CliError(f"{path}: the spec is nested too deeply") from exc
    if not isinstance(data, dict):
        raise CliError(f"{path}: the spec must be an object")
    _inline_replay_files(data, path.parent)
    return data


def _inline_replay_files(spec: dict[str, Any], base: Path) -> None:
    """Replace each ``workload.replay_file`` (JSONL, relative to the spec) with its requests.

    Looks at ``baseline.workload`` and every variant's ``changes`` value for
    ``workload.replay_file``. Raises :class:`CliError` naming the file and
    every bad line (:func:`jobs.load.replay.load_jsonl`); nothing is submitted then.
    """

    def load(name: Any) -> list[dict[str, Any]]:
        if not isinstance(name, str):
            raise CliError("workload.replay_file must be a path")
        file = (base / name).expanduser()
        try:
            return load_jsonl(file)
        except ReplayFileError as exc:
            raise CliError(f"{file}: {exc}") from exc
        except OSError as exc:
            raise CliError(f"{file}: cannot read the replay file: {exc.strerror}") from exc

    baseline = spec.get("baseline")
    workload = baseline.get("workload") if isinstance(baseline, dict) else None
    if isinstance(workload, dict) and "replay_file" in workload:
        if "replay" in workload:
            raise CliError("workload: give 'replay' or 'replay_file', not both")
        workload["replay"] = load(workload.pop("replay_file"))
    for variant in spec.get("variants") or []:
        changes = variant.get("changes") if isinstance(variant, dict) else None
        if isinstance(changes, dict) and "workload.replay_file" in changes:
            if "workload.replay" in changes:
                raise CliError(
                    "changes: give 'workload.replay' or 'workload.replay_file', not both"
                )
            changes["workload.replay"] = load(changes.pop("workload.replay_file"))
