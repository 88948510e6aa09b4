"""Prints where NVIDIA's CUDA wheels lay out a toolkit in this interpreter's site-packages, or
nothing: with the argument ``toolkit``, the root nvidia/cu13 holding nvcc (nvidia-cuda-nvcc),
cicc (nvidia-nvvm), the runtime's headers and static library (nvidia-cuda-runtime) and the crt
headers (nvidia-cuda-crt): what ``jax[cuda13]`` installs; with ``cccl``, the CCCL headers
(nvidia-cuda-cccl: nv/target, cuda/std, which cuda_bf16.h includes). Run by CMakeLists.txt; the
folders are looked at, nothing is imported."""

import os
import sys

NEEDED = {
    "toolkit": ("bin/nvcc", "nvvm/bin/cicc", "include/cuda_runtime.h", "include/crt/host_config.h",
                "lib/libcudart_static.a"),
    "cccl": ("include/cccl/nv/target", "include/cccl/cuda/std/cstdint"),
}


def main(what):
    for entry in sys.path:
        root = os.path.join(entry or os.getcwd(), "nvidia", "cu13")
        if all(os.path.isfile(os.path.join(root, f)) for f in NEEDED[what]):
            root = os.path.realpath(root)
            print(root if what == "toolkit" else os.path.join(root, "include", "cccl"))
            return


if __name__ == "__main__":
    main(sys.argv[1])
