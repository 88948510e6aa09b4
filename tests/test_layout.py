"""The sm90 load-time layout of weight codes (jax_nvfp4/layout.py).

Oracle: ml_dtypes' float4_e2m1fn and bfloat16 decodes, and an index mapping written out here
from the layout's definition (loops over thread, tile and register), not the module's reshapes.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_nvfp4 import layout


def random_packed(rng, shape):
    return rng.integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("shape", [(128, 32), (2, 256, 96), (3, 1, 128, 64)])
def test_round_trip_and_same_bytes(rng, shape):
    data = random_packed(rng, shape)
    prep = np.asarray(jax.jit(layout.prepare_sm90)(data))
    assert prep.shape == data.shape and prep.dtype == np.uint8
    assert not np.array_equal(prep, data)
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.unprepare_sm90)(prep)), data)
    # a permutation of bits: the number of set bits is kept
    popcount = lambda a: np.unpackbits(a).sum()  # noqa: E731
    assert popcount(prep) == popcount(data)


def test_kernel_extraction_gives_e2m1_times_2_pow_minus_126(rng):
    n, k = 256, 128
    data = random_packed(rng, (n, k // 2))
    prep = np.asarray(layout.prepare_sm90(data))
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(n, k)      # code of (row, k)
    e2m1 = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    checked = 0
    for nb in range(n // 128):
        for kblk in range(k // 64):
            block = prep[128 * nb:128 * nb + 128, 32 * kblk:32 * kblk + 32].reshape(-1)
            words = block.view("<u4")                                  # little-endian words
            for mt in range(8):
                for lane in range(32):
                    g8, t = lane // 4, lane % 4
                    for kb in range(4):
                        w = words[(512 * mt + 16 * lane + 4 * kb) // 4]
                        regs = layout.fragments_sm90(np.array([w], np.uint32))[0]
                        for i, (drow, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                            row = 128 * nb + 16 * mt + g8 + drow
                            kk = 64 * kblk + 16 * kb + 2 * t + dk
                            halves = np.array([regs[i] & 0xFFFF, regs[i] >> 16], np.uint16)
                            got = halves.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126
                            np.testing.assert_array_equal(got, e2m1[row, kk:kk + 2])
                            checked += 2
    assert checked == n * k


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"data: the sm90 layout needs N % 128 == 0"):
        layout.prepare_sm90(np.zeros((100, 32), np.uint8))
    with pytest.raises(ValueError, match="K % 64"):
        layout.prepare_sm90(np.zeros((128, 16), np.uint8))
    with pytest.raises(ValueError, match="data: expected uint8"):
        layout.unprepare_sm90(np.zeros((128, 32), np.int32))


def test_selftest_host_copy_matches(rng, tmp_path):
    """tools/sm90_layout_host.h (the GPU self-test's C++ copy of prepare_sm90) gives the same bytes."""
    import shutil
    import subprocess
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "driver.cpp"
    src.write_text(
        '#include "tools/sm90_layout_host.h"\n#include <cstdio>\n#include <cstdlib>\n'
        "int main(int, char** a) {\n"
        "  long G = atol(a[1]), N = atol(a[2]), K = atol(a[3]);\n"
        "  std::vector<uint8_t> in(G * N * K / 2);\n"
        "  FILE* f = fopen(a[4], \"rb\"); if (fread(in.data(), 1, in.size(), f) != in.size()) return 3; fclose(f);\n"
        "  auto out = jax_nvfp4_tools::prepare_sm90_host(in, G, N, K);\n"
        "  f = fopen(a[5], \"wb\"); fwrite(out.data(), 1, out.size(), f); fclose(f);\n  return 0;\n}\n")
    exe = tmp_path / "driver"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{root}", str(src), "-o", str(exe)], check=True)
    for g, n, k in [(1, 128, 64), (3, 256, 192)]:
        data = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
        data.tofile(tmp_path / "in.bin")
        subprocess.run([str(exe), str(g), str(n), str(k), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       check=True)
        got = np.fromfile(tmp_path / "out.bin", np.uint8).reshape(g, n, k // 2)
        np.testing.assert_array_equal(got, np.asarray(layout.prepare_sm90(jnp.asarray(data))))
