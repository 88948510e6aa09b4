"""Compare the machine code of two builds kernel by kernel (a refactor that must not change speed or
numerics should leave every kernel's SASS identical).

    cuobjdump -sass -arch sm_90a OLD/_jax_nvfp4*.so > old.sass
    cuobjdump -sass -arch sm_90a NEW/_jax_nvfp4*.so > new.sass
    python tools/lab/sass_compare.py old.sass new.sass

Kernels are matched by their mangled names with the anonymous namespace's per-file hash removed
(so renamed source files still match); instructions are compared with their encodings, without
addresses. Prints IDENTICAL / DIFFERENT per kernel, and kernels present on one side only. Exit
status 1 if anything differs. (Pass text: cuobjdump -sass output. cuobjdump ships in the CUDA toolkit, or pip's nvidia-cuda-cuobjdump
with nvidia-cuda-nvdisasm.)
"""

import re
import sys


def load(paths):
    out = {}
    for p in paths:
        cur = None
        with open(p) as f:
            for line in f:
                m = re.match(r"\s*Function : (\S+)", line)
                if m:
                    name = re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "ANON", m.group(1))
                    cur = out.setdefault(name, [])
                    continue
                if cur is not None and "/*" in line:
                    s = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip()
                    if s:
                        cur.append(s)
    return out


def main(argv):
    if len(argv) != 3:
        print(__doc__)
        return 2
    a, b = load(argv[1].split(",")), load(argv[2].split(","))
    bad = 0
    for k in sorted(a):
        if k not in b:
            print("ONLY_OLD", k)
            bad = 1
            continue
        same = a[k] == b[k]
        bad |= not same
        print("IDENTICAL" if same else "DIFFERENT", len(a[k]), len(b[k]), k)
    for k in sorted(set(b) - set(a)):
        print("ONLY_NEW", k)
        bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv))
