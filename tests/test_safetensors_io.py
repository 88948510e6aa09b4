"""Tests of jax_nvfp4.checkpoint.safetensors_io: the safetensors reader/writer (dtypes kept as stored, corrupt
headers rejected, atomic writes), cross-checked against the ``safetensors`` package."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from jax_nvfp4.checkpoint import hf_folder
from jax_nvfp4.checkpoint import safetensors_io as st

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw(a) -> np.ndarray:
    """The bytes of an array (any rank, including 0-d), for bit-exact comparisons."""
    return np.asarray(a).reshape(-1).view(np.uint8)


# ------------------------------------------------------------------------------------------------
# safetensors reader / writer
# ------------------------------------------------------------------------------------------------

ALL_DTYPES = [np.float32, np.float16, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
              ml_dtypes.float8_e5m2, np.uint8, np.int8, np.int16, np.uint16, np.int32,
              np.uint32, np.int64, np.uint64, np.bool_]


def _random(rng, dt, shape):
    raw = rng.integers(0, 256, size=(int(np.prod(shape)) * np.dtype(dt).itemsize,), dtype=np.uint8)
    if np.dtype(dt) == np.bool_:
        return (raw % 2).astype(np.bool_).reshape(shape)
    return raw.view(dt).reshape(shape)


def test_safetensors_roundtrip_all_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"t.{np.dtype(dt).name}": _random(rng, dt, (3, 5)) for dt in ALL_DTYPES}
    tensors["scalar0"] = np.array(2.5, np.float32)
    tensors["scalar1"] = np.array([0.125], ml_dtypes.bfloat16)
    tensors["empty"] = np.zeros((0, 4), np.uint8)
    path = tmp_path / "a.safetensors"
    st.save_safetensors(path, tensors, metadata={"format": "pt"})
    back = st.read_safetensors(path)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        np.testing.assert_array_equal(raw(back[k]), raw(v), err_msg=k)
    reader = st.SafetensorsReader([path])
    assert reader.dtype_of("t.float8_e4m3fn") == "F8_E4M3" and reader.dtype_of("t.bfloat16") == "BF16"
    assert reader.metadata[str(path)] == {"format": "pt"}
    copied = st.read_safetensors([path], copy=True)
    assert copied["t.uint8"].flags.writeable


def test_reader_against_safetensors_package(tmp_path):
    """Independent oracle: files written by the safetensors package read back identically, and
    our files are read identically by the package (for the dtypes its numpy reader supports)."""
    sn = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(1)
    dts = [np.float32, np.float16, ml_dtypes.bfloat16, np.uint8, np.int8, np.int32, np.int64]
    tensors = {f"x.{np.dtype(dt).name}": _random(rng, dt, (4, 6)) for dt in dts}
    tensors["s0"] = np.array(3.0, np.float32)
    tensors["s1"] = np.array([3.0], np.float32)
    p1 = tmp_path / "theirs.safetensors"
    sn.save_file(tensors, str(p1))
    ours = st.read_safetensors(p1)
    for k, v in tensors.items():
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
        np.testing.assert_array_equal(raw(ours[k]), raw(v), err_msg=k)
    p2 = tmp_path / "ours.safetensors"
    st.save_safetensors(p2, tensors)
    theirs = sn.load_file(str(p2))
    for k, v in tensors.items():
        assert theirs[k].dtype == v.dtype and theirs[k].shape == v.shape, k
        np.testing.assert_array_equal(raw(theirs[k]), raw(v), err_msg=k)


def test_f8_written_by_safetensors_package_is_bitcast(tmp_path):
    """The package can *write* F8_E4M3 (it cannot read it back into numpy): we read the bytes."""
    sn = pytest.importorskip("safetensors.numpy")
    raw_ = np.array([[0x3F, 0x7E, 0x01, 0xBF]], np.uint8)
    p = tmp_path / "f8.safetensors"
    sn.save_file({"s": raw_.view(F8)}, str(p))
    header = json.loads(open(p, "rb").read()[8:8 + struct.unpack("<Q", open(p, "rb").read(8))[0]])
    assert header["s"]["dtype"] == "F8_E4M3"
    got = st.read_safetensors(p)["s"]
    assert got.dtype == F8
    np.testing.assert_array_equal(got.view(np.uint8), raw_)
    np.testing.assert_array_equal(got.astype(np.float32), [[1.875, 448.0, 2.0 ** -9, -1.875]])


def test_f8_hand_built_header(tmp_path):
    """A file built byte by byte: F8_E4M3 byte 0x3F must load as 1.875 (not 63)."""
    header = {"__metadata__": {"k": "v"},
              "sc": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]},
              "w": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
              "f": {"dtype": "F32", "shape": [], "data_offsets": [6, 10]}}
    h = json.dumps(header).encode()
    body = bytes([0x3F, 0x38, 0x7E, 0x00, 0x3F, 0x12]) + struct.pack("<f", 0.25)
    p = tmp_path / "hand.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + body)
    t = st.read_safetensors(p)
    assert t["sc"].dtype == F8
    np.testing.assert_array_equal(t["sc"].astype(np.float32), [[1.875, 1.0], [448.0, 0.0]])
    np.testing.assert_array_equal(t["w"], [0x3F, 0x12])
    assert t["w"].dtype == np.uint8 and t["f"].shape == () and t["f"] == 0.25


def test_reader_rejects_bad_files(tmp_path):
    p = tmp_path / "bad.safetensors"
    h = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 8)
    with pytest.raises(ValueError, match="'a'"):
        st.read_safetensors(p)
    h = json.dumps({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode()
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0")
    with pytest.raises(ValueError, match="unsupported dtype"):
        st.read_safetensors(p)
    p.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        st.read_safetensors(p)
    st.save_safetensors(tmp_path / "x.safetensors", {"a": np.ones(2, np.float32)})
    st.save_safetensors(tmp_path / "y.safetensors", {"a": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="both"):
        st.read_safetensors([tmp_path / "x.safetensors", tmp_path / "y.safetensors"])




# ------------------------------------------------------------------------------------------------
# corrupt headers (issue 23 item 3): each a ValueError naming the file and the tensor
# ------------------------------------------------------------------------------------------------

def _hand_file(path, header: dict, body: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


def _e(dtype, shape, offsets):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


CORRUPT = {   # case: (header, body bytes, the tensor named, what the message says was expected)
    "overlap": ({"a": _e("F32", [2], [0, 8]), "b": _e("F32", [2], [4, 12])}, 16, "b", "overlap"),
    "shape_minus_one": ({"a": _e("F32", [-1], [4, 0])}, 8, "a", "non-negative integers"),
    "two_minus_ones": ({"a": _e("F32", [-1, -1], [0, 4])}, 8, "a", "non-negative integers"),
    "negative_dim": ({"a": _e("F32", [2, -2], [16, 0])}, 16, "a", "non-negative integers"),
    "byte_count_overflows_int64": ({"a": _e("F32", [2 ** 32, 2 ** 32], [0, 0])}, 8, "a",
                                   "more elements than an array can hold"),
    "begin_after_end": ({"a": _e("U8", [0], [8, 8]), "b": _e("U8", [4], [6, 2])}, 8, "b",
                        r"0 <= begin <= end"),
    "byte_count_mismatch": ({"a": _e("F32", [2], [4, 8])}, 8, "a",
                            r"is 8 bytes but data_offsets \[4, 8\] span 4"),
    "past_end_of_file": ({"a": _e("U8", [16], [0, 16])}, 8, "a", r"past the end of the data"),
    "float_dim": ({"a": _e("F32", [2.5], [0, 8])}, 8, "a", "non-negative integers"),
    "bool_dim": ({"a": _e("U8", [True], [0, 1])}, 8, "a", "non-negative integers"),
    "float_offsets": ({"a": _e("F32", [2], [0.0, 8.0])}, 8, "a", "two integers"),
    "three_offsets": ({"a": _e("F32", [2], [0, 8, 8])}, 8, "a", "two integers"),
    "shape_not_a_list": ({"a": _e("F32", "2", [0, 8])}, 8, "a", "non-negative integers"),
    "unknown_dtype": ({"a": _e("Q7", [1], [0, 1])}, 8, "a", "unsupported dtype 'Q7'"),
    "entry_not_an_object": ({"a": [1, 2]}, 8, "a", "'dtype', 'shape' and 'data_offsets'"),
    "missing_key": ({"a": {"dtype": "F32", "shape": [2]}}, 8, "a",
                    "'dtype', 'shape' and 'data_offsets'"),
    "metadata_not_str_to_str": ({"__metadata__": {"step": 1}, "a": _e("U8", [1], [0, 1])}, 8,
                                "__metadata__", "str -> str"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_reader_rejects_corrupt_header(tmp_path, case):
    """Each a ValueError naming the file, the tensor and what was expected."""
    header, nbody, tensor, why = CORRUPT[case]
    p = tmp_path / f"{case}.safetensors"
    _hand_file(p, header, bytes(range(nbody)))
    with pytest.raises(ValueError, match=why) as ei:
        st.read_safetensors(p)
    msg = str(ei.value)
    named = tensor if tensor == "__metadata__" else repr(tensor)
    assert str(p) in msg and named in msg, msg


def test_reader_accepts_touching_and_empty_tensors(tmp_path):
    """Adjacent spans and zero-byte tensors (which may share an offset) are not overlaps."""
    p = tmp_path / "ok.safetensors"
    _hand_file(p, {"a": _e("U8", [2], [0, 2]), "z": _e("F32", [0, 3], [2, 2]),
                   "b": _e("U8", [2], [2, 4])}, bytes([1, 2, 3, 4]))
    t = st.read_safetensors(p)
    np.testing.assert_array_equal(t["a"], [1, 2])
    np.testing.assert_array_equal(t["b"], [3, 4])
    assert t["z"].shape == (0, 3) and t["z"].dtype == np.float32


def test_metadata_name_rejected_and_metadata_roundtrips(tmp_path):
    p = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match="__metadata__"):
        st.save_safetensors(p, {"__metadata__": np.zeros(2, np.uint8), "a": np.ones(1, np.uint8)})
    assert not p.exists()
    with pytest.raises(ValueError, match="str -> str"):
        st.save_safetensors(p, {"a": np.ones(1, np.uint8)}, metadata={"step": 3})
    st.save_safetensors(p, {"a": np.ones(1, np.uint8)}, metadata={"format": "pt", "step": "3"})
    with open(tmp_path / "plain", "wb"):   # a new file gets the mode open() would give it
        pass
    assert os.stat(p).st_mode & 0o7777 == os.stat(tmp_path / "plain").st_mode & 0o7777
    assert st.read_safetensors_metadata(p) == {"format": "pt", "step": "3"}
    assert set(st.read_safetensors(p)) == {"a"}
    st.save_safetensors(p, {"a": np.ones(1, np.uint8)})
    assert st.read_safetensors_metadata(p) == {}


def test_metadata_against_safetensors_package(tmp_path):
    """The package (the oracle) reads our metadata, and we read its."""
    sn = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open  # noqa: PLC0415 - after the importorskip
    t = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    st.save_safetensors(ours, t, metadata={"format": "np", "who": "jax_nvfp4"})
    with safe_open(str(ours), framework="numpy") as f:
        assert f.metadata() == {"format": "np", "who": "jax_nvfp4"}
        np.testing.assert_array_equal(f.get_tensor("w"), t["w"])
    sn.save_file(t, str(theirs), metadata={"format": "np", "k": "v"})
    assert st.read_safetensors_metadata(theirs) == {"format": "np", "k": "v"}
    np.testing.assert_array_equal(st.read_safetensors(theirs)["w"], t["w"])


# ------------------------------------------------------------------------------------------------
# atomic writes (issue 23 item 2)
# ------------------------------------------------------------------------------------------------

def _run(code: str, *args) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a SIGBUS or a file size limit must not hit pytest)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_overwrite_in_place_with_views_of_the_same_file(tmp_path):
    """``t = read_safetensors(p); save_safetensors(p, t)``: t maps p while p is rewritten."""
    p = tmp_path / "ckpt.safetensors"
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, size=(1 << 20,), dtype=np.uint8)
    scales = rng.integers(0, 0x7E, size=(64, 16), dtype=np.uint8).view(F8)
    st.save_safetensors(p, {"big": big, "scales": scales}, metadata={"k": "v"})
    os.chmod(p, 0o640)
    r = _run("""
        import sys
        import numpy as np
        from jax_nvfp4 import checkpoint as ckpt
        p = sys.argv[1]
        t = ckpt.read_safetensors(p)             # read-only memory-mapped views of p
        t["extra"] = np.arange(3, dtype=np.int32)
        ckpt.save_safetensors(p, t, metadata={"k": "v2"})
        print("saved")
        """, p)
    assert r.returncode == 0 and "saved" in r.stdout, (r.returncode, r.stderr[-2000:])
    back = st.read_safetensors(p)
    np.testing.assert_array_equal(back["big"], big)
    np.testing.assert_array_equal(back["scales"].view(np.uint8), scales.view(np.uint8))
    np.testing.assert_array_equal(back["extra"], [0, 1, 2])
    assert st.read_safetensors_metadata(p) == {"k": "v2"}
    assert os.stat(p).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]


def test_failed_save_keeps_old_file_and_leaves_no_temp(tmp_path):
    """A save that fails midway (here: the file size limit, as on a full disk) leaves the old
    file intact and loadable, and removes its temporary file."""
    p = tmp_path / "ckpt.safetensors"
    old = {"w": np.arange(1000, dtype=np.float32), "s": np.full((4, 4), 0x38, np.uint8).view(F8)}
    st.save_safetensors(p, old)
    before = p.read_bytes()
    r = _run("""
        import resource, signal, sys
        import numpy as np
        from jax_nvfp4 import checkpoint as ckpt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            ckpt.save_safetensors(sys.argv[1], {"w": np.ones(1 << 20, np.float32)})
        except OSError as e:
            print("failed:", e)
        else:
            print("saved")
        """, p)
    assert r.returncode == 0 and "failed:" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    assert p.read_bytes() == before
    back = st.read_safetensors(p)
    np.testing.assert_array_equal(back["w"], old["w"])
    np.testing.assert_array_equal(back["s"].view(np.uint8), old["s"].view(np.uint8))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.safetensors"]


def test_failed_save_in_process_removes_temp(tmp_path, monkeypatch):
    """The same in-process: the writer raising partway (after the header) leaves nothing behind."""
    p = tmp_path / "new.safetensors"

    calls = []
    real = st._write_atomic

    def failing(path, chunks):
        def gen():
            for i, c in enumerate(chunks):
                if i == 3:
                    calls.append(i)
                    raise OSError(28, "No space left on device")
                yield c
        return real(path, gen())

    monkeypatch.setattr(st, "_write_atomic", failing)
    with pytest.raises(OSError, match="No space"):
        st.save_safetensors(p, {f"t{i}": np.full(10, i, np.uint8) for i in range(4)})
    assert calls and os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# what a save may replace (issue 46 item 4)
# ------------------------------------------------------------------------------------------------

def test_save_refuses_paths_that_are_not_regular_files(tmp_path):
    """A folder, FIFO or device at the path stays as it was (the atomic rename would replace it
    by a regular file), and nothing is left behind; an empty path is an error, not a temp file
    in the current folder."""
    t = {"a": np.ones(2, np.float32)}
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    link = tmp_path / "link.safetensors"
    os.symlink(fifo, link)
    for path, kind in ((folder, "a folder"), (fifo, "a FIFO"), (link, "a FIFO")):
        with pytest.raises(ValueError, match=rf"path: .*{path.name}.* is {kind}"):
            st.save_safetensors(path, t)
    assert folder.is_dir() and not any(folder.iterdir())
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.path.islink(link)
    assert sorted(os.listdir(tmp_path)) == ["fifo.safetensors", "folder.safetensors",
                                            "link.safetensors"]
    with pytest.raises(ValueError, match="not a regular file"):   # and reading it does not hang
        st.read_safetensors(fifo)
    if os.path.exists("/dev/null"):
        with pytest.raises(ValueError, match="is a device"):
            st.save_safetensors("/dev/null", t)
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ValueError, match="path: expected a file path"):
            st.save_safetensors("", t)
        with pytest.raises(ValueError, match="is a folder"):   # pathlib.Path("") is "."
            st.save_safetensors(type(tmp_path)(""), t)
        with pytest.raises(ValueError, match="ends in a separator"):
            st.save_safetensors("sub/", t)
    finally:
        os.chdir(cwd)
    assert sorted(os.listdir(tmp_path)) == ["fifo.safetensors", "folder.safetensors",
                                            "link.safetensors"]


def test_save_through_a_symlink_replaces_its_target(tmp_path):
    """The link stays a link; the file it points to gets the new tensors."""
    real = tmp_path / "real.safetensors"
    st.save_safetensors(real, {"a": np.zeros(3, np.float32)})
    link = tmp_path / "link.safetensors"
    os.symlink(real, link)
    st.save_safetensors(link, {"a": np.arange(3, dtype=np.float32)})
    assert os.path.islink(link) and os.readlink(link) == str(real)
    np.testing.assert_array_equal(st.read_safetensors(real, copy=True)["a"], [0.0, 1.0, 2.0])


# ------------------------------------------------------------------------------------------------
# readers and atomic replacement of the same path (issue 46 item 5)
# ------------------------------------------------------------------------------------------------

def _version(k: int) -> dict[str, np.ndarray]:
    """Version k of a file: sizes and offsets differ between versions, so an old header over new
    bytes (or the reverse) reads values that belong to no version, or runs past the end."""
    return {"a": np.full(64 * (k % 5 + 1), k, np.float32),
            "b": np.arange(32 * (k % 3 + 1), dtype=np.int64) * (k + 1),
            "c": np.full((k % 4 + 1, 16), k % 256, np.uint8)}


def test_open_reader_keeps_reading_the_file_it_validated(tmp_path):
    p = tmp_path / "w.safetensors"
    old, new = _version(1), _version(2)
    st.save_safetensors(p, old)
    reader = st.SafetensorsReader(p)
    lazy = hf_folder.open_checkpoint([p])          # a list of files, read lazily
    folder_ckpt = hf_folder.open_checkpoint(tmp_path)  # a folder without an index
    st.save_safetensors(p, new)                    # atomic replace of the same path
    for src in (reader, lazy, folder_ckpt):
        for k, v in old.items():
            np.testing.assert_array_equal(src[k], v, err_msg=k)
    fresh = st.SafetensorsReader(p)
    for k, v in new.items():
        np.testing.assert_array_equal(fresh[k], v, err_msg=k)


def test_reads_during_atomic_saves_see_complete_versions(tmp_path):
    """A writer keeps replacing the file; readers open and read it meanwhile. Every read is one
    whole written version (all tensors from the same one), and no read raises."""
    p = tmp_path / "busy.safetensors"
    versions = [_version(k) for k in range(12)]
    st.save_safetensors(p, versions[0])
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[int] = []

    def writer():
        k = 0
        while not stop.is_set():
            k = (k + 1) % len(versions)
            st.save_safetensors(p, versions[k])

    def reader():
        try:
            while not stop.is_set():
                got = st.read_safetensors(p)
                k = int(got["a"][0])
                for name, v in versions[k].items():
                    np.testing.assert_array_equal(got[name], v, err_msg=f"version {k}: {name}")
                seen.append(k)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(set(seen)) > 1, "the readers saw a single version: the test did not race"


# ------------------------------------------------------------------------------------------------
# the writer refuses what readers refuse (issue 46 item 11), header limits (item 13)
# ------------------------------------------------------------------------------------------------

def test_writer_refuses_names_and_metadata_that_are_not_unicode(tmp_path):
    """The safetensors package (the oracle) cannot read a header holding a lone surrogate; the
    writer refuses it, and our reader refuses such a file too."""
    p = tmp_path / "s.safetensors"
    bad = "layer\ud800.weight"
    for kwargs in ({"tensors": {bad: np.ones(1, np.float32)}},
                   {"tensors": {"a": np.ones(1, np.float32)}, "metadata": {bad: "v"}},
                   {"tensors": {"a": np.ones(1, np.float32)}, "metadata": {"k": bad}}):
        with pytest.raises(ValueError, match="not valid Unicode"):
            st.save_safetensors(p, **kwargs)
    assert not p.exists()
    # such a file built by hand: the package refuses it, and so does our reader, naming it
    _hand_file(p, {bad: _e("F32", [1], [0, 4])}, b"\0" * 4)
    safe_open = pytest.importorskip("safetensors").safe_open
    with pytest.raises(Exception, match="surrogate|hex escape"):
        with safe_open(str(p), framework="numpy") as f:
            list(f.keys())
    with pytest.raises(ValueError, match=rf"{p.name}.*not valid Unicode"):
        st.read_safetensors(p)


def test_header_size_limit_matches_the_safetensors_package(tmp_path):
    """Headers up to the package's limit are written and read by both; one byte more is refused
    by the writer (and, built by hand, by the package and by our reader)."""
    safe_open = pytest.importorskip("safetensors").safe_open
    limit = st._MAX_HEADER
    t = {"a": np.ones(2, np.float32)}

    def header_len(meta_len):
        return len(json.dumps({"__metadata__": {"m": "x" * meta_len}, "a": _e("F32", [2], [0, 8])},
                              separators=(",", ":")).encode())

    fill = limit - header_len(0)                      # header exactly at the limit
    ok = tmp_path / "ok.safetensors"
    st.save_safetensors(ok, t, metadata={"m": "x" * fill})
    with open(ok, "rb") as f:
        assert struct.unpack("<Q", f.read(8))[0] == limit
    with safe_open(str(ok), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("a"), t["a"])
    np.testing.assert_array_equal(st.read_safetensors(ok)["a"], t["a"])
    big = tmp_path / "big.safetensors"
    with pytest.raises(ValueError, match=f"header would be {limit + 8} bytes.*at most {limit}"):
        st.save_safetensors(big, t, metadata={"m": "x" * (fill + 1)})
    assert not big.exists()
    h = json.dumps({"__metadata__": {"m": "x" * (fill + 1)}, "a": _e("F32", [2], [0, 8])},
                   separators=(",", ":")).encode()
    assert len(h) == limit + 1
    big.write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 8)
    with pytest.raises(Exception, match="header too large"):
        with safe_open(str(big), framework="numpy") as f:
            list(f.keys())
    with pytest.raises(ValueError, match="at most 100000000 bytes"):
        st.read_safetensors(big)


@pytest.mark.parametrize("shape", [[0, 2 ** 70], [2 ** 40, 2 ** 40, 0], [0, 2 ** 62]])
def test_shapes_too_large_for_an_array_are_rejected_at_the_header(tmp_path, shape):
    """Zero bytes of data, but more elements than numpy can shape: a ValueError naming the file
    and the tensor when the header is read (numpy's own message names neither)."""
    with pytest.raises(ValueError, match="too big|dimension exceeded"):  # numpy itself (the oracle)
        np.zeros(shape, np.float32)
    p = tmp_path / "huge.safetensors"
    _hand_file(p, {"ok": _e("U8", [2], [0, 2]), "huge": _e("F32", shape, [2, 2])}, b"\1\2")
    with pytest.raises(ValueError, match=rf"{p.name}.*'huge'.*more elements than an array"):
        st.SafetensorsReader(p)


def test_repeated_header_key_is_rejected(tmp_path):
    """JSON with a key twice (json.loads would keep the last one silently)."""
    p = tmp_path / "dup.safetensors"
    h = (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
         b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\1\2")
    with pytest.raises(ValueError, match=rf"{p.name}.*'a' appears twice"):
        st.read_safetensors(p)


# ------------------------------------------------------------------------------------------------
# the contract's edges (issue 58: the mutation run's survivors)
# ------------------------------------------------------------------------------------------------

def test_big_endian_arrays_are_stored_as_their_values(tmp_path):
    """A non-native byte order is the same dtype to the format: the file holds the values
    little-endian, and both readers (ours, the package's) give them back."""
    t = {"f32": np.arange(6, dtype=">f4").reshape(2, 3) / 7, "i64": np.arange(-3, 3, dtype=">i8"),
         "u16": np.array([1, 0x1234, 0xFFFF], ">u2"), "f64": np.array(np.pi, ">f8"),
         "le": np.array([1.5, -2.0], "<f2")}
    p = tmp_path / "be.safetensors"
    st.save_safetensors(p, t)
    back = st.read_safetensors(p)
    reader = st.SafetensorsReader(p)
    assert {k: reader.dtype_of(k) for k in t} == {"f32": "F32", "i64": "I64", "u16": "U16",
                                                  "f64": "F64", "le": "F16"}
    for k, v in t.items():
        assert back[k].dtype == v.dtype.newbyteorder("<") and back[k].shape == v.shape, k
        np.testing.assert_array_equal(back[k], v, err_msg=k)
        np.testing.assert_array_equal(raw(back[k]), raw(v.astype(v.dtype.newbyteorder("<"))))
    sn = pytest.importorskip("safetensors.numpy")
    for k, v in sn.load_file(str(p)).items():
        np.testing.assert_array_equal(v, t[k], err_msg=k)


def test_writer_errors_name_the_argument(tmp_path):
    p = tmp_path / "e.safetensors"
    one = np.ones(1, np.float32)
    cases = [
        ({"tensors": {3: one}}, r"^tensors: names must be str, got 3"),
        ({"tensors": {"bad\ud800": one}}, r"^tensors: name 'bad\\ud800' is not valid Unicode"),
        ({"tensors": {"a": one}, "metadata": {"k\ud800": "v"}},
         r"^metadata: __metadata__ key 'k\\ud800' is not valid Unicode"),
        ({"tensors": {"a": one}, "metadata": {"k": "v\ud800"}},
         r"^metadata: __metadata__\['k'\] value 'v\\ud800' is not valid Unicode"),
        ({"tensors": {"a": one}, "metadata": {"k": 1}}, r"^metadata: __metadata__ must be a str"),
        ({"tensors": {"layer.w": np.ones(2, np.complex64)}},
         r"^layer\.w: dtype complex64 has no safetensors equivalent"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            st.save_safetensors(p, **kwargs)
    assert not p.exists()


def test_save_refusals_name_the_kind_and_where_a_link_points(tmp_path, monkeypatch):
    t = {"a": np.ones(2, np.float32)}
    monkeypatch.chdir(tmp_path)          # short relative names: a socket path has a length limit
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("sock.safetensors")
        with pytest.raises(ValueError, match=r"^path: sock\.safetensors exists and is a socket;"):
            st.save_safetensors("sock.safetensors", t)
        assert stat.S_ISSOCK(os.stat("sock.safetensors").st_mode)
    finally:
        sock.close()
    os.mkdir("folder")
    os.symlink("folder", "link.safetensors")
    real = os.path.realpath("folder")
    if real == os.path.abspath("folder"):    # no symbolic link above tmp_path
        with pytest.raises(ValueError, match=r"^path: folder exists and is a folder;"):
            st.save_safetensors("folder", t)
    with pytest.raises(ValueError, match=rf"^path: link\.safetensors \(-> {re.escape(real)}\) "
                                         r"exists and is a folder;"):
        st.save_safetensors("link.safetensors", t)


def test_save_renames_a_temporary_file_from_the_target_folder(tmp_path, monkeypatch):
    """The temporary file lies beside the target (one filesystem: the rename is atomic)."""
    renames = []
    real_replace = os.replace

    def replace(src, dst, **kw):
        renames.append((os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    p = tmp_path / "sub" / "w.safetensors"
    p.parent.mkdir()
    st.save_safetensors(p, {"a": np.arange(3, dtype=np.int32)})
    assert len(renames) == 1 and renames[0][1] == str(p)
    assert os.path.dirname(renames[0][0]) == str(p.parent)
    assert os.listdir(tmp_path / "elsewhere") == [] and os.listdir(p.parent) == [p.name]


def _open_fds():
    return sorted(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None


@pytest.mark.parametrize("where", ["fchmod", "fsync"])
def test_failed_save_closes_only_its_own_file(tmp_path, monkeypatch, where):
    """A failure before or after the temporary file is opened as a Python file: the error
    propagates, the old file stays, no temporary file and no descriptor is left, and no other
    descriptor of the process is closed."""
    p = tmp_path / "w.safetensors"
    st.save_safetensors(p, {"a": np.zeros(4, np.float32)})
    before, fds = p.read_bytes(), _open_fds()

    def fail(*args):
        raise OSError(errno.EIO, f"{where} failed")

    monkeypatch.setattr(os, where, fail)
    with pytest.raises(OSError, match=f"{where} failed"):
        st.save_safetensors(p, {"a": np.ones(4, np.float32)})
    monkeypatch.undo()
    assert _open_fds() == fds
    assert p.read_bytes() == before and os.listdir(tmp_path) == [p.name]


def test_data_starts_8_byte_aligned(tmp_path):
    """The header is padded so the data starts at a multiple of 8 (as the safetensors package
    writes it): every tensor of 8-byte items is an aligned view."""
    for n in range(1, 10):
        p = tmp_path / f"a{n}.safetensors"
        st.save_safetensors(p, {"x" * n: np.arange(3, dtype=np.float64),
                                "y": np.arange(2, dtype=np.int64)})
        with open(p, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = f.read(hlen)
        assert hlen % 8 == 0 and header.rstrip(b" ").endswith(b"}"), (n, header)
        for k, v in st.read_safetensors(p).items():
            assert v.flags.aligned, (n, k)


def test_a_file_without_tensors(tmp_path):
    """No tensors (the header runs to the end of the file): an empty mapping, metadata kept."""
    p = tmp_path / "empty.safetensors"
    st.save_safetensors(p, {})
    assert st.read_safetensors(p) == {} and st.read_safetensors_metadata(p) == {}
    st.save_safetensors(p, {}, metadata={"format": "np"})
    assert os.path.getsize(p) == 8 + struct.unpack("<Q", p.read_bytes()[:8])[0]
    assert st.read_safetensors(p) == {} and st.read_safetensors_metadata(p) == {"format": "np"}
    sn = pytest.importorskip("safetensors.numpy")
    assert sn.load_file(str(p)) == {}


def test_header_length_and_top_level_are_checked(tmp_path):
    p = tmp_path / "h.safetensors"
    h = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    for n in (len(h) + 2, 2 ** 63 + 1, 2 ** 64 - 1):      # past the end of the file
        p.write_bytes(struct.pack("<Q", n) + h + b"\1")
        with pytest.raises(ValueError, match=rf"{p.name}: not a safetensors file \(header "
                                             rf"length {n}, file size {len(h) + 9};"):
            st.read_safetensors(p)
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\1")       # the same, with the right length
    assert st.read_safetensors(p, copy=True)["a"].tolist() == [1]
    for top in (b"[]", b'"a"', b"3"):
        p.write_bytes(struct.pack("<Q", len(top)) + top)
        with pytest.raises(ValueError, match=rf"{p.name}: safetensors header is not a JSON object"):
            st.read_safetensors(p)


@pytest.mark.parametrize("dtype,shape,ok", [
    ("U8", [1] * 64, True),            # 64 unit dims: one byte
    ("U8", [0, 2 ** 63 - 1], True),    # numpy's largest dim, no data
    ("U8", [0, 2 ** 63], False),
    ("I16", [0, 2 ** 62 - 1], True),   # just under the byte limit
    ("I16", [0, 2 ** 62], False),
])
def test_array_size_limit_at_its_boundary(tmp_path, dtype, shape, ok):
    """The largest shapes numpy can make are read; one more is refused at the header (numpy
    itself is the oracle)."""
    np_dtype = st._ST_TO_NP[dtype]
    if ok:
        assert np.zeros(shape, np_dtype).shape == tuple(shape)
    else:
        with pytest.raises(ValueError, match="exceeded|too big"):
            np.zeros(shape, np_dtype)
    nbytes = int(np.prod(shape, dtype=object)) * np_dtype.itemsize
    p = tmp_path / "s.safetensors"
    _hand_file(p, {"t": _e(dtype, shape, [0, nbytes])}, b"\7" * nbytes)
    if ok:
        t = st.read_safetensors(p)["t"]
        assert t.shape == tuple(shape) and t.dtype == np_dtype and raw(t).tolist() == [7] * nbytes
    else:
        with pytest.raises(ValueError, match=rf"{p.name}: tensor 't': .*more elements than an "
                                             "array can hold"):
            st.read_safetensors(p)


def test_reader_over_several_files(tmp_path):
    """Membership, file_of and read-only views by default; a name in two files names both."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st.save_safetensors(a, {"x": np.ones(2, np.float32), "y": np.zeros(1, np.uint8)})
    st.save_safetensors(b, {"z": np.arange(3, dtype=np.int32)})
    r = st.SafetensorsReader([a, b])
    assert "x" in r and "z" in r and "w" not in r and 3 not in r
    assert [r.file_of(k) for k in ("x", "y", "z")] == [str(a), str(a), str(b)]
    assert r.paths == [str(a), str(b)] and len(r) == 3
    views = st.read_safetensors([a, b])
    assert not any(v.flags.writeable for v in views.values())
    with pytest.raises(ValueError, match="read-only"):
        views["x"][0] = 2
    st.save_safetensors(b, {"x": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=rf"^tensor 'x' is stored in both {re.escape(str(a))} "
                                         rf"and {re.escape(str(b))}$"):
        st.SafetensorsReader([a, b])
