"""A safetensors reader and writer that keep F8_E4M3 (and the other 8-bit floats) as stored.

The ``safetensors`` package's numpy/flax readers cannot return F8_E4M3 tensors, so this package
has its own. The file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then
the raw little-endian bytes (offsets relative to the end of the header).

* The reader checks every header entry before anything is mapped: integer shape and offsets,
  a byte count that matches the shape and fits numpy's array size, no overlap between tensors,
  nothing past the end of the file, a known dtype, ``__metadata__`` a str -> str map, names and
  strings valid Unicode, no repeated key, a header of at most 100,000,000 bytes (the
  ``safetensors`` package's limit). Anything else is a ValueError naming the file and the tensor.
  The header is read from, and the data mapped from, one open descriptor: a reader keeps
  returning the bytes of the file it validated even when that path is atomically replaced.
* The writer refuses what the reader (and the ``safetensors`` package) would refuse: names or
  metadata that are not valid Unicode (lone surrogates), a header over the size limit. It
  writes atomically: a temporary file in the target's folder, flushed and fsynced, renamed over
  the target, then the folder fsynced. A failure midway (disk full, file size limit) leaves the
  old file as it was and no temporary file behind; arrays that are memory-mapped views of the
  target itself (``t = read_safetensors(p); save_safetensors(p, t)``) are safe to save, since
  the old file is only unlinked once the new one is complete. A target that exists and is not a
  regular file (a folder, FIFO, device) is refused, and a symbolic link is written through (its
  target is replaced, the link kept).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import tempfile
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union, cast

import ml_dtypes
import numpy as np

__all__ = ["read_safetensors", "save_safetensors", "read_safetensors_metadata", "SafetensorsReader",
           "METADATA_KEY"]

PathLike = Union[str, os.PathLike]

METADATA_KEY = "__metadata__"
"""The header key holding the file's str -> str metadata (not a tensor name)."""

_ST_TO_NP: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST: dict[np.dtype, str] = {v.newbyteorder("=") if v.byteorder in "<>" else v: k
                                 for k, v in _ST_TO_NP.items()}
_MAX_HEADER = 100_000_000   # the safetensors package's limit on the header length, padding included
_MAX_NBYTES = int(np.iinfo(np.intp).max)   # numpy's limit on an array's byte count


def _st_dtype_of(arr: np.ndarray, name: str) -> str:
    dt = arr.dtype
    key = dt.newbyteorder("=") if dt.byteorder in "<>" else dt
    try:
        return _NP_TO_ST[key]
    except KeyError:
        raise ValueError(f"{name}: dtype {dt} has no safetensors equivalent (supported: "
                         f"{sorted(str(d) for d in _NP_TO_ST)})") from None


def _check_unicode(text: str, what: str) -> None:
    """Refuse a str that has no UTF-8 encoding (a lone surrogate): JSON can escape it, but the
    safetensors package refuses such a header."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} {text!r:.200} is not valid Unicode (lone surrogate "
                         f"{text[e.start]!r} at index {e.start}); safetensors headers are UTF-8"
                         ) from None


def _check_metadata(metadata: Any, where: str) -> dict[str, str]:
    if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{where}: {METADATA_KEY} must be a str -> str map (the safetensors "
                         f"format), got {metadata!r:.200}")
    for k, v in metadata.items():
        _check_unicode(k, f"{where}: {METADATA_KEY} key")
        _check_unicode(v, f"{where}: {METADATA_KEY}[{k!r:.100}] value")
    return dict(metadata)


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask sets it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _target_path(path: str) -> str:
    """The file ``save_safetensors(path)`` replaces: ``path``, or a symbolic link's target.

    Raises ValueError for an empty path, a path ending in a separator, or an existing
    non-regular file (the atomic rename would replace a folder, FIFO or device node by a file).
    """
    if not path:
        raise ValueError("path: expected a file path, got an empty string")
    if not os.path.basename(path):
        raise ValueError(f"path: {path!r} ends in a separator; expected a file path")
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        where = path if target == os.path.abspath(path) else f"{path} (-> {target})"
        raise ValueError(f"path: {where} exists and is {kind}; save_safetensors only creates or "
                         "replaces regular files")
    return target


def _write_atomic(path: str, chunks) -> None:
    """Write the byte chunks to ``path`` through a temporary file renamed over it."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        try:
            mode = os.stat(path).st_mode & 0o7777      # keep an existing file's permissions
        except FileNotFoundError:
            mode = 0o666 & ~_umask()                   # what open(path, "wb") would have made
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable; not every filesystem lets a folder be opened or fsynced
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def save_safetensors(path: PathLike, tensors: Mapping[str, Any],
                     metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` (name -> numpy/jax array) to a safetensors file at ``path``, atomically.

    Dtypes: float64/32/16, bfloat16, float8_e4m3fn (F8_E4M3), float8_e5m2, float8_e8m0fnu,
    uint8/int8/int16/uint16/int32/uint32/int64/uint64, bool. Shapes are kept as given (a 0-d array
    is stored with shape ``[]``). ``metadata`` is an optional str -> str dict, stored as the
    header's ``__metadata__`` (read it back with :func:`read_safetensors_metadata`). The file is
    readable by the ``safetensors`` package for the dtypes that package supports.

    The old file at ``path`` (if any) is replaced only once the new one is completely written
    and synced; ``tensors`` may be views of that old file (e.g. from :func:`read_safetensors`).

    ``path`` may be a symbolic link: the file it points to is replaced and the link kept.

    Raises:
      ValueError: an empty ``path``, or one that exists and is not a regular file (a folder,
        FIFO, device: left as it was); a tensor named ``"__metadata__"`` (reserved by the format;
        pass ``metadata``), a non-str name, metadata that is not str -> str, a name or metadata
        string that is not valid Unicode (a lone surrogate), a dtype safetensors cannot store,
        or a header longer than the 100,000,000 bytes the safetensors package reads.
    """
    path = _target_path(os.fspath(path))
    header: dict[str, Any] = {}
    if metadata is not None:
        meta = _check_metadata(metadata, "metadata")
        if meta:
            header[METADATA_KEY] = meta
    arrays = []
    offset = 0
    for name in tensors:
        if not isinstance(name, str):
            raise ValueError(f"tensors: names must be str, got {name!r}")
        _check_unicode(name, "tensors: name")
        if name == METADATA_KEY:
            raise ValueError(f"tensors: {METADATA_KEY!r} is reserved by the safetensors format for "
                             "the file's str -> str metadata; pass it as metadata= instead")
        arr = np.asarray(tensors[name])
        st = _st_dtype_of(arr, name)
        arr = np.asarray(arr.astype(_ST_TO_NP[st], copy=False), order="C")  # little-endian, 0-d kept
        header[name] = {"dtype": st, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)  # pad so the data starts 8-byte aligned
    if len(hbytes) > _MAX_HEADER:
        raise ValueError(f"tensors/metadata: the JSON header would be {len(hbytes)} bytes; "
                         f"safetensors readers accept at most {_MAX_HEADER} (fewer tensors per "
                         "file, shorter names or less metadata)")

    def chunks():
        yield struct.pack("<Q", len(hbytes))
        yield hbytes
        for arr in arrays:
            if arr.nbytes:
                yield memoryview(arr.reshape(-1).view(np.uint8))

    _write_atomic(path, chunks())


def _open_nonblocking(path: str, flags: int) -> int:
    """os.open with O_NONBLOCK: opening a FIFO returns at once (and is then refused) instead of
    waiting for a writer; regular files ignore the flag."""
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def _unique_keys(pairs: list) -> dict:
    """json object hook: a repeated key is an error (the safetensors package refuses it too)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r:.200} appears twice")
        out[k] = v
    return out


def _read_header(path: str, f, size: int) -> tuple[dict, int]:
    """Return (header dict, data start offset) of the safetensors file open as ``f``."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or 8 + n > size:
        raise ValueError(f"{path}: not a safetensors file (header length {n}, file size {size}; "
                         f"readers accept headers of at most {_MAX_HEADER} bytes)")
    hraw = f.read(n)
    try:
        header = json.loads(hraw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as e:   # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: unreadable safetensors JSON header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_entry(path: str, name: str, info: Any, data_size: int
                 ) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry; return (dtype string, shape, begin, end)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: tensor {name!r}: {why} (header entry {info!r:.200})")

    _check_unicode(name, f"{path}: tensor name")
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise bad("expected an object with 'dtype', 'shape' and 'data_offsets'")
    st, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(st, str) or st not in _ST_TO_NP:
        raise bad(f"unsupported dtype {st!r} (supported: {sorted(_ST_TO_NP)})")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise bad("shape must be a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(x) for x in offsets)):
        raise bad("data_offsets must be two integers [begin, end]")
    b, e = offsets
    nbytes = _ST_TO_NP[st].itemsize   # Python ints: no overflow, however large the dims
    span = nbytes                     # what numpy allocates for: the nonzero dims
    for s in shape:
        nbytes *= s
        span *= max(s, 1)
    if span > _MAX_NBYTES:
        raise bad(f"{st} {shape} has more elements than an array can hold (the product of its "
                  f"nonzero dims times the item size exceeds {_MAX_NBYTES})")
    if not 0 <= b <= e:
        raise bad(f"data_offsets [{b}, {e}] must satisfy 0 <= begin <= end")
    if e - b != nbytes:
        raise bad(f"{st} {shape} is {nbytes} bytes but data_offsets [{b}, {e}] span {e - b}")
    if e > data_size:
        raise bad(f"data_offsets [{b}, {e}] run past the end of the data ({data_size} bytes)")
    return st, tuple(shape), b, e


class SafetensorsReader(Mapping):
    """A lazy read-only mapping name -> numpy array over one or more safetensors files.

    Only the JSON headers are read up front (and fully validated: a corrupt entry is a ValueError
    naming the file and the tensor); each file is memory-mapped read-only through the descriptor
    its header was read from, and each tensor is a view into that mapping (pages are read when
    touched). The reader therefore keeps reading the files it validated: replacing a path
    atomically (as :func:`save_safetensors` does) does not change what an open reader returns.
    Tensors keep their stored dtype: F8_E4M3 arrives as ``ml_dtypes.float8_e4m3fn``, BF16 as
    ``ml_dtypes.bfloat16``. A name stored in two files raises ValueError. ``metadata`` maps each
    path to its ``__metadata__`` (str -> str), for the files that have one.
    """

    def __init__(self, paths: Union[PathLike, Sequence[PathLike]]):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self._entries: dict[str, tuple[int, str, tuple[int, ...], int, int]] = {}
        self._paths: list[str] = [os.fspath(p) for p in paths]
        self._maps: list[Optional[mmap.mmap]] = []
        self._starts: list[int] = []
        self.metadata: dict[str, dict[str, str]] = {}
        for i, path in enumerate(self._paths):
            # One descriptor for the header and the mapping: an atomic save to the same path
            # in between cannot pair this header with another file's bytes.
            with open(path, "rb", opener=_open_nonblocking) as f:
                st_ = os.fstat(f.fileno())
                if not stat.S_ISREG(st_.st_mode):
                    raise ValueError(f"{path}: not a regular file (a safetensors file expected)")
                size = st_.st_size
                header, start = _read_header(path, f, size)
                self._index(i, path, header, size - start)
                self._starts.append(start)
                # The mapping holds the file (its own descriptor) for the reader's lifetime;
                # pages are read when touched.
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                                  if size > start else None)

    def _index(self, i: int, path: str, header: dict, data_size: int) -> None:
        """Validate file ``i``'s header and record its tensors in ``self._entries``."""
        if METADATA_KEY in header:
            self.metadata[path] = _check_metadata(header.pop(METADATA_KEY), path)
        spans = []
        for name, info in header.items():
            st, shape, b, e = _parse_entry(path, name, info, data_size)
            if name in self._entries:
                other = self._paths[self._entries[name][0]]
                raise ValueError(f"tensor {name!r} is stored in both {other} and {path}")
            self._entries[name] = (i, st, shape, b, e)
            if e > b:
                spans.append((b, e, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise ValueError(f"{path}: tensors {n0!r} (data_offsets [{b0}, {e0}]) and "
                                 f"{n1!r} (data_offsets [{b1}, {e1}]) overlap")

    def __getitem__(self, name: str) -> np.ndarray:
        i, st, shape, b, e = self._entries[name]
        dt = _ST_TO_NP[st]
        if e == b:
            return np.zeros(shape, dt)
        count = (e - b) // dt.itemsize
        return np.frombuffer(cast(mmap.mmap, self._maps[i]), dtype=dt, count=count,   # (mapped: e > b)
                             offset=self._starts[i] + b).reshape(shape)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    @property
    def paths(self) -> list[str]:
        """The files read, in order."""
        return list(self._paths)

    def dtype_of(self, name: str) -> str:
        """The safetensors dtype string (e.g. ``"F8_E4M3"``) of tensor ``name``."""
        return self._entries[name][1]

    def file_of(self, name: str) -> str:
        """The path of the file holding tensor ``name``."""
        return self._paths[self._entries[name][0]]


def read_safetensors(paths: Union[PathLike, Sequence[PathLike]], *,
                     copy: bool = False) -> dict[str, np.ndarray]:
    """Read every tensor of one or more safetensors files into a dict name -> numpy array.

    Dtypes keep their stored meaning: F8_E4M3 -> ``ml_dtypes.float8_e4m3fn`` (the bytes, not a
    value conversion), BF16 -> ``ml_dtypes.bfloat16``, F32 -> float32, U8 -> uint8, I32 -> int32,
    etc. With ``copy=False`` (default) the arrays are read-only views of memory-mapped files; with
    ``copy=True`` they are independent in-memory copies. The file's ``__metadata__`` is not a
    tensor: read it with :func:`read_safetensors_metadata`. For a lazy mapping that reads only the
    headers up front, use :class:`SafetensorsReader`.
    """
    reader = SafetensorsReader(paths)
    if copy:
        return {k: np.array(reader[k]) for k in reader}
    return {k: reader[k] for k in reader}


def read_safetensors_metadata(path: PathLike) -> dict[str, str]:
    """The ``__metadata__`` str -> str map of one safetensors file (``{}`` when it has none)."""
    path = os.fspath(path)
    return SafetensorsReader([path]).metadata.get(path, {})
