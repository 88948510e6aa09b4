"""Compare the machine code of two builds kernel by kernel (a refactor that must not change speed or
numerics should leave every kernel's SASS identical).

    cuobjdump -sass -arch sm_90a OLD/_jax_nvfp4*.so > old.sass
    cuobjdump -sass -arch sm_90a NEW/_jax_nvfp4*.so > new.sass
    python tools/lab/sass_compare.py old.sass new.sass

    python tools/lab/sass_compare.py --loops old.sass new.sass

--loops prints, per kernel, the innermost loops that hold tensor-core instructions (HMMA/HGMMA):
their length in instructions (NOPs left out) and MMA count, old then new: a refactor of a kernel
body that must keep its speed should keep these (the k-loops) the same length.

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
                    cur = out.setdefault(_anon(m.group(1)), [])
                    continue
                if cur is not None and "/*" in line:
                    # cuobjdump pads its columns differently from one dump to another: compare
                    # the instruction text with runs of blanks collapsed
                    s = " ".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split())
                    if s:
                        cur.append(s)
    return out


def _anon(name):
    return re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "ANON", name)


def load_addressed(paths):
    """Per kernel: [(address, instruction text)], NOPs included."""
    out = {}
    for p in paths:
        cur = None
        with open(p) as f:
            for line in f:
                m = re.match(r"\s*Function : (\S+)", line)
                if m:
                    cur = out.setdefault(_anon(m.group(1)), [])
                    continue
                m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
                if m and cur is not None:
                    cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def mma_loops(ins):
    """The innermost backward-branch loops holding MMA instructions: [(length without NOPs, MMAs)]."""
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
        mmas = sum(1 for t in body if "MMA" in t.split()[0] or " HMMA" in t or " HGMMA" in t)
        if mmas:
            loops.append((int(m.group(1), 16), addr, sum(1 for t in body if "NOP" not in t), mmas))
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    return [(n, k) for _, _, n, k in inner]


def print_loops(old, new):
    a, b = load_addressed(old.split(",")), load_addressed(new.split(","))
    for k in sorted(set(a) | set(b)):
        la, lb = mma_loops(a.get(k, [])), mma_loops(b.get(k, []))
        if la or lb:
            print("LOOPS", la, "->", lb, k)
    return 0


def main(argv):
    if len(argv) == 4 and argv[1] == "--loops":
        return print_loops(argv[2], argv[3])
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
