"""Files and folders a user hands a tool, checked for kind and readability before any work, and YAML read
strictly (a duplicated key, an empty file, a section left ``null``): each problem one :class:`ConfigError`
naming the key and the path. No torch here."""

import contextlib
import os
from pathlib import Path
from typing import Any

import yaml

from modelwright.errors import ConfigError, require

#: The sections of a training config; ``trainer: null`` in a file would silently drop all of its defaults.
TRAINING_SECTIONS = ("trainer", "model", "data")


def require_file(key: str, path: str | os.PathLike, writable: bool = False) -> Path:
    """``path``, an existing readable (and, with ``writable``, writable) file; else a ConfigError naming
    ``key``."""
    path = Path(path)
    require(path.exists(), f"{key}: no file {path}")
    require(path.is_file(), f"{key}: {path} is a folder, not a file")
    require(os.access(path, os.R_OK), f"{key}: cannot read {path}")
    if writable:
        require(os.access(path, os.W_OK), f"{key}: cannot write {path}")
    return path


def require_folder(key: str, path: str | os.PathLike) -> Path:
    """``path``, an existing folder this process can read."""
    path = Path(path)
    require(path.exists(), f"{key}: no folder {path}")
    require(path.is_dir(), f"{key}: {path} is a file, not a folder")
    require(os.access(path, os.R_OK | os.X_OK), f"{key}: cannot read {path}")
    return path


def require_creatable_folder(key: str, path: str | os.PathLike) -> Path:
    """``path``, a folder that exists or can be made, and written in: the nearest existing part of it is a
    folder this process can write in, and the missing parts are made (then removed: a refused run leaves
    nothing): an access check passes where no folder can be made (root's ``/proc/x``, a name too long)."""
    path = Path(path)
    try:
        existing = next(part for part in (path, *path.parents) if part.exists())  # "." or "/" at the latest
        if existing == path:
            require(path.is_dir(), f"{key}: {path} is a file, not a folder")
        else:
            require(existing.is_dir(), f"{key}: cannot create {path}: {existing} is not a folder")
        require(os.access(existing, os.W_OK | os.X_OK), f"{key}: cannot write in {existing}")
        _make_and_remove(path, existing)
    except OSError as err:
        raise ConfigError(f"{key}: cannot create {path}: {err.strerror or err}") from None
    return path


def _make_and_remove(path: Path, existing: Path) -> None:
    """Make the folders from ``existing`` down to ``path``, then remove those this call made."""
    missing = [part for part in (path, *path.parents) if part != existing and existing in part.parents]
    made = []
    try:
        for part in reversed(missing):
            try:
                part.mkdir()
            except FileExistsError:  # another process (a DDP rank) made it meanwhile: not ours to remove
                continue
            made.append(part)
    finally:
        for part in reversed(made):
            with contextlib.suppress(OSError):  # written in meanwhile by another process: it stays
                part.rmdir()


class _DuplicateKey(yaml.YAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice (lines {seen[key]} and {line})")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark else ""
    return f"{where} ({getattr(err, 'problem', None) or err})"


def read_yaml(key: str, path: str | os.PathLike, sections: tuple[str, ...] = ()) -> dict:
    """The mapping in the YAML file ``path``; a ConfigError naming ``key`` and the file if it cannot be read,
    is not YAML, names a key twice, is empty, is not a mapping, or leaves one of ``sections`` ``null``."""
    path = require_file(key, path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # noqa: S506 (a safe loader)
    except _DuplicateKey as err:
        raise ConfigError(f"{key}: {path}: {err}; the later one would win unseen") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: {path}:{_problem(err)} is not valid YAML") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{key}: cannot read {path} ({err})") from None
    require(data is not None, f"{key}: {path} is empty; a config file holds a mapping of keys")
    require(isinstance(data, dict), f"{key}: {path} holds a {type(data).__name__}, not a mapping of keys")
    for section in sections:
        left_null = section in data and data[section] is None
        require(not left_null, f"{key}: {path}: {section}: null; leave the section out to keep its defaults")
    return data
