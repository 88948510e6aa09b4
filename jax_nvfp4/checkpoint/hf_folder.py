"""Hugging Face checkpoint folders: ``model-0000k-of-0000n.safetensors`` shards and the
``model.safetensors.index.json`` that says which shard holds each tensor.

:func:`open_checkpoint` turns what a user points at (a folder, its index file, one safetensors
file, or a list of files) into a lazy mapping name -> numpy array. Over an index, a shard's header
is read and the shard memory-mapped only when one of its tensors is first looked up, so loading
one layer of a many-shard checkpoint opens only the shards that hold that layer.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Sequence, Union, cast

import numpy as np

from .safetensors_io import SafetensorsReader

__all__ = ["ShardedCheckpoint", "open_checkpoint", "INDEX_NAME", "SINGLE_FILE_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
_SHARD_RE = re.compile(r"-\d+-of-\d+\.safetensors$")

PathLike = Union[str, os.PathLike]


def _listing(paths: Sequence[str], limit: int = 6) -> str:
    """The first ``limit`` base names of ``paths`` (or tensor names), comma-separated."""
    names = [os.path.basename(p) for p in paths]
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_shard_name(index_path: str, shard: str) -> None:
    """Refuse a weight_map entry that leaves the index's folder: an absolute path, or a path
    component equal to ``..`` (a file name that merely starts with dots, ``..x.safetensors``, is
    a plain name). Relative subfolders (``sub/x.safetensors``) stay inside and are allowed."""
    parts = shard.replace(os.sep, "/").split("/")
    if os.altsep:
        parts = [q for p in parts for q in p.split(os.altsep)]
    if (not shard or "\0" in shard or os.path.isabs(shard) or ".." in parts
            or parts[-1] in ("", ".")):
        raise ValueError(f"{index_path}: shard {shard!r} is not a file name inside the index's "
                         "folder (expected a relative path with no '..' component, e.g. "
                         "'model-00001-of-00002.safetensors')")


class _JsonObject(dict):
    """A JSON object as a dict that remembers its repeated keys (``json.load`` keeps the last
    value of a repeated key silently): ``repeated`` lists ``(key, [values in order])``."""

    def __init__(self, pairs):
        super().__init__(pairs)
        seen: dict = {}
        for k, v in pairs:
            seen.setdefault(k, []).append(v)
        self.repeated = [(k, vs) for k, vs in seen.items() if len(vs) > 1]


def _refuse_repeated_keys(index_path: str, index, weight_map) -> None:
    """ValueError naming the index and the key when a JSON object of the index repeats a key;
    in the weight_map, naming the tensor and its shards."""
    if isinstance(weight_map, _JsonObject) and weight_map.repeated:
        name, shards = weight_map.repeated[0]
        raise ValueError(f"{index_path}: its weight_map names tensor {name!r} twice "
                         f"({', '.join(map(str, shards))}): which shard holds it is ambiguous")

    def walk(v):
        if isinstance(v, _JsonObject):
            if v.repeated:
                raise ValueError(f"{index_path}: key {v.repeated[0][0]!r} appears twice in one "
                                 "JSON object of the index (JSON keeps the last one silently)")
            for u in v.values():
                walk(u)
        elif isinstance(v, list):
            for u in v:
                walk(u)

    walk(index)


class ShardedCheckpoint(Mapping):
    """A lazy read-only mapping name -> numpy array over a sharded checkpoint's index.

    ``index_path``: a ``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``,
    shard files relative to the index's folder). Names, membership and :meth:`shard_of` come from
    the index alone; the first lookup of a tensor opens its shard (header read and validated,
    file memory-mapped). ``opened`` lists the shards opened so far. Tensors keep their stored
    dtype, as with :class:`~jax_nvfp4.checkpoint.safetensors_io.SafetensorsReader`.
    """

    def __init__(self, index_path: PathLike):
        self.index_path = os.fspath(index_path)
        try:
            with open(self.index_path, encoding="utf-8") as f:
                index = json.load(f, object_pairs_hook=_JsonObject)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.index_path}: not a safetensors index (unreadable JSON: {e})"
                             ) from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        _refuse_repeated_keys(self.index_path, index, wm)
        if not isinstance(wm, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise ValueError(f"{self.index_path}: not a safetensors index (expected a JSON object "
                             "with a \"weight_map\" of tensor name -> shard file name)")
        folder = os.path.dirname(os.path.abspath(self.index_path))
        for shard in set(wm.values()):
            _check_shard_name(self.index_path, shard)
        self._weight_map = {k: os.path.join(folder, v) for k, v in wm.items()}
        self._readers: dict[str, SafetensorsReader] = {}
        self.metadata = index.get("metadata", {})

    @property
    def paths(self) -> list[str]:
        """Every shard the index names, sorted."""
        return sorted(set(self._weight_map.values()))

    @property
    def opened(self) -> list[str]:
        """The shards opened so far, in order."""
        return list(self._readers)

    def shard_of(self, name: str) -> str:
        """The path of the shard holding tensor ``name`` (by the index; KeyError if absent)."""
        return self._weight_map[name]

    def _reader(self, shard: str) -> SafetensorsReader:
        if shard not in self._readers:
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"{shard}: shard named by {self.index_path} is missing")
            self._readers[shard] = SafetensorsReader([shard])
        return self._readers[shard]

    def _holder(self, name: str) -> SafetensorsReader:
        """The opened shard the index places ``name`` in; ValueError when it does not hold it."""
        shard = self._weight_map[name]
        reader = self._reader(shard)
        if name not in reader:
            raise ValueError(f"{self.index_path}: its weight_map places tensor {name!r} in "
                             f"{os.path.basename(shard)}, which does not hold it ({shard} holds "
                             f"{len(reader)} tensors: {_listing(list(reader), 4)}); the index "
                             "and the shards disagree")
        return reader

    def __getitem__(self, name: str) -> np.ndarray:
        return self._holder(name)[name]

    def __iter__(self):
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def dtype_of(self, name: str) -> str:
        """The safetensors dtype string of tensor ``name`` (opens its shard)."""
        return self._holder(name).dtype_of(name)

    def file_of(self, name: str) -> str:
        """The path of the file holding tensor ``name``."""
        return self.shard_of(name)


def open_checkpoint(source: Union[PathLike, Sequence[PathLike]]) -> Mapping:
    """A lazy mapping name -> numpy array over a checkpoint on disk.

    ``source`` may be:

    * a model folder: its ``model.safetensors.index.json`` if present (a
      :class:`ShardedCheckpoint`), else its ``model.safetensors``, else every ``*.safetensors``
      in it;
    * an index file (``*.json`` with a ``weight_map``);
    * one safetensors file, or a list of them (their headers are read up front).

    Raises:
      FileNotFoundError naming the path when it does not exist or a folder holds no
      safetensors; ValueError when a ``.json`` is not an index or a file is not safetensors.
    """
    if isinstance(source, (list, tuple)):
        paths = [os.fspath(p) for p in source]
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: no such safetensors file"
                                        + (" (a folder: pass it alone, not in a list)"
                                           if os.path.isdir(p) else ""))
        return SafetensorsReader(paths)
    path = os.fspath(cast(Union[str, os.PathLike], source))      # (not a list or tuple here)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            return ShardedCheckpoint(index)
        single = os.path.join(path, SINGLE_FILE_NAME)
        if os.path.isfile(single):
            return SafetensorsReader([single])
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: folder has no {INDEX_NAME}, no {SINGLE_FILE_NAME} "
                                    "and no *.safetensors file")
        return SafetensorsReader(files)
    if os.path.isfile(path):
        if path.endswith(".json"):
            return ShardedCheckpoint(path)
        return SafetensorsReader([path])
    raise FileNotFoundError(f"{path}: neither a file nor a folder (expected a model folder, its "
                            f"{INDEX_NAME}, or a safetensors file)")


def where_looked(src: Mapping) -> str:
    """A clause for a missing-tensor error saying which files were searched (empty for a dict)."""
    if isinstance(src, ShardedCheckpoint):
        return (f" (not in the weight_map of {src.index_path}, whose shards are "
                f"{_listing(src.paths)})")
    if isinstance(src, SafetensorsReader):
        paths = src.paths
        hint = ""
        if len(paths) == 1 and _SHARD_RE.search(paths[0]):
            hint = (f"; it looks like one shard of a sharded checkpoint: pass the folder or its "
                    f"{INDEX_NAME}")
        return f" (looked in {_listing(paths)}{hint})"
    return ""
