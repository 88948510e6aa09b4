"""The documents against what they describe: the README's benchmark numbers against the committed
JSON (docs/bench-*.json), its test counts against the collected quick tier; docs/design.md's kernel
tables, the family lists (design.md, README, kernel_config, ffi/gemm_ffi.h) and Python's family and
layout codes against the C++ enums and tables of csrc/kernel_table.h and gemm_attributes.h, read from the
header (a family added there with its rows and sections passes); section references into
design.md; design.md's module layers against the package's import graph. (The benchmarks page is generated: test_benchmarks_md.py.)"""

import ast
import json
import pathlib
import re

import pytest

from jax_nvfp4.config import kernel_config, options

from conftest import COLLECTED, QUICK, QUICK_BUDGET_S

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(text, heading):
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _gemm_ms(name):
    """{(case, impl): ms} of a committed grouped GEMM benchmark JSON."""
    d = json.loads((ROOT / "docs" / name).read_text())
    return {(r["case"], r["impl"]): r["ms"] for r in d["results"]}


def _printed(value, text):
    """Whether ``text`` (a number as the document prints it) is ``value`` at that precision."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{decimals}f}" == text


def _numbers(text):
    return re.findall(r"\d+(?:\.\d+)?", text)


README_COLUMNS = {"exact W4A16": "w4a16_sm90", "exact W4A4": "w4a4_sm90",
                  "fp8 W4A16": "w4a16_fp8", "fp8 W4A4": "w4a4_fp8"}
"""The README's performance table: column heading -> the benchmark's implementation."""


def test_readme_gemm_table_is_the_committed_json():
    perf = _section(README, "Performance")
    assert "`docs/bench-h200-fp8-api.json`" in perf
    ms = _gemm_ms("bench-h200-fp8-api.json")
    lines = [ln for ln in perf.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[0] == "case" and set(header[1:]) <= set(README_COLUMNS), header
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert {r[0] for r in rows} == {case for case, _ in ms}, "the table has every case"
    for case, *cells in rows:
        for col, cell in zip(header[1:], cells):
            want = ms[(case, README_COLUMNS[col])]
            assert _printed(want, cell), f"README {case} {col}: {cell}, the JSON has {want}"


def test_readme_layer_sentence_is_the_committed_json():
    """The layer's time and its overhead beyond its two GEMMs (layer / (gemm1 + gemm2) - 1),
    W4A4, per token count, as docs/bench-layer-h200.json has them."""
    m = re.search(r"The layer \(`python -m jax_nvfp4\.bench\.layer`, W4A4, weights prepared\) "
                  r"takes ([\d./ ]+) ms at ([\d/ ]+) tokens per GPU, ([\d./ ]+)% beyond its two "
                  r"GEMMs\s+\(`docs/bench-layer-h200\.json`", " ".join(README.split()))
    assert m, "README: the layer's sentence is not in the form this test reads"
    layer_ms, tokens, overhead = (_numbers(g) for g in m.groups())
    d = json.loads((ROOT / "docs/bench-layer-h200.json").read_text())
    rows = {r["tokens"]: r for r in d["results"] if r["activation"] == "w4a4"}
    assert [int(t) for t in tokens] == sorted(rows) and len(layer_ms) == len(overhead) == len(rows)
    for t, printed_ms, printed_pct in zip(tokens, layer_ms, overhead):
        r = rows[int(t)]
        assert _printed(r["layer_ms"], printed_ms), (t, printed_ms, r["layer_ms"])
        beyond = 100 * (r["layer_ms"] / (r["gemm1_ms"] + r["gemm2_ms"]) - 1)
        assert _printed(beyond, printed_pct), (t, printed_pct, beyond)


def _sweep_ms(name):
    d = json.loads((ROOT / "docs" / name).read_text())
    return {(r["case"], r["impl"]): r["ms"] for r in d["results"] if "ms" in r}


def test_readme_fp8_prepared_figures_are_the_committed_json():
    text = " ".join(_section(README, "Performance").split())
    ms = _sweep_ms("bench-h100-cutlass-fp8-sweep.json")
    ours = "cutlass_fp8_128_s5_c1_r1"
    m = re.search(r"\(`docs/bench-h100-cutlass-fp8-sweep\.json`, W4A16 / W4A4, `cutlass_fp8`\): (.+?)\. In "
                  r"the same run", text)
    assert m, "README: the fp8-prepared figures are not in the form this test reads"
    pairs = re.findall(r"(L[12]) (\d+)(?: rows)? ([\d.]+) / ([\d.]+)", m.group(1))
    assert len(pairs) == 4
    for layer, rows, a16, a4 in pairs:
        case = f"{layer} rows {rows}"
        assert _printed(ms[(case, f"w4a16_{ours}")], a16), (case, a16)
        assert _printed(ms[(case, f"w4a4_{ours}")], a4), (case, a4)
    cases = ["L1 rows 6144", "L1 rows 24576", "L2 rows 6144", "L2 rows 24576"]
    m = re.search(r"the GEMM alone\) took ([\d./ ]+) ms and cuBLAS's batched e4m3 GEMM on an even split "
                  r"of the rows \(a bound: no raggedness\) ([\d./ ]+)\.", text)
    assert m, "README: the peers' figures are not in the form this test reads"
    for impl, printed in (("torch_fp8_grouped", m.group(1)), ("cublas_fp8_uniform_bf16out", m.group(2))):
        for case, value in zip(cases, _numbers(printed), strict=True):
            assert _printed(ms[(case, impl)], value), (impl, case, value)
    m = re.search(r"\(L1 1536 rows: ([\d.]+) ms against ([\d.]+) on e4m3 weights\)", text)
    assert _printed(ms[("L1 rows 1536", "w4a16_wgmma_fp8")], m.group(1))
    assert _printed(ms[("L1 rows 1536", "w4a16_wgmma_fp8_prepared_128_s6_c1_r0")], m.group(2))
    m = re.search(r"\(L1 6144: ([\d.]+) against ([\d.]+) ms; L1 24576: ([\d.]+) against ([\d.]+)\)", text)
    for case, a, b in (("L1 rows 6144", m.group(1), m.group(2)), ("L1 rows 24576", m.group(3), m.group(4))):
        assert _printed(ms[(case, f"w4a16_{ours}")], a) and _printed(ms[(case, "w4a16_wgmma_fp8")], b)
    # 48 V4-Pro experts' w13 [2I, H] and w2 [H, I]: 1 byte per weight, NVFP4 0.5625
    weights = 48 * (2 * 3072 * 7168 + 7168 * 3072)
    assert f"i.e. {weights / 1e9:.2f} GB against {weights * 0.5625 / 1e9:.2f} for 48" in text


def test_readme_quick_tier_counts():
    """The README's "about N tests, M of them without a GPU" against this run's collection of
    the quick tier (neither slow nor multidevice), within 10%; skipped unless this run collected
    every test file."""
    files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    if not files <= {i.split("::", 1)[0] for i in COLLECTED}:
        pytest.skip("this run did not collect every test file")
    m = re.search(r"runs the quick tier \(about ([\d,]+) tests, ([\d,]+) of them without a GPU",
                  " ".join(README.split()))
    assert m, "README: the quick tier's counts are not in the form this test reads"
    said_all, said_cpu = (int(g.replace(",", "")) for g in m.groups())
    have_all, have_cpu = len(QUICK), sum(not gpu for gpu in QUICK.values())
    for said, have, what in ((said_all, have_all, "tests"), (said_cpu, have_cpu, "CPU tests")):
        assert abs(said - have) <= 0.1 * have, (
            f"README says about {said} quick-tier {what}; {have} are collected: update README.md")


def test_readme_states_the_quick_tier_budget():
    assert f"a quick test using more than {QUICK_BUDGET_S:g} s of CPU time fails" in " ".join(README.split())


# --- docs/design.md, README.md and the code's comments against the kernels the code defines ---

DESIGN = (ROOT / "docs/design.md").read_text()
CONTRACT = "\n".join((ROOT / "csrc" / h).read_text() for h in (   # the contract and what it includes
    "gemm_contract.h", "gemm_attributes.h", "kernel_table.h", "sm90_layout.h", "cutlass_fp8_workspace.h"))


def _cpp_enum(text, name):
    """{enumerator: value} of ``enum class name`` in C++ source text."""
    body = re.search(rf"enum class {name} : int32_t \{{(.*?)\}};", text, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"\b(k\w+)\s*=\s*(\d+)", re.sub(r"//[^\n]*", "", body))}


def cpp_family_table():
    """kFamilyTable of csrc/kernel_table.h: {name: dict(code, fp8, layouts, sm90a, file)}, in code
    order (the enum's value of each row's KernelFamily)."""
    body = re.search(r"kFamilyTable\[\] = \{(.*?)\n\};", CONTRACT, re.S).group(1)
    rows = re.findall(r"\{KernelFamily::(k\w+), \"(\w+)\", (true|false), ([^,]+?),\s*(true|false),\s*"
                      r"\"([^\"]+)\"", body)
    assert len(rows) == body.count("{KernelFamily::"), "a kFamilyTable row the pattern does not read"
    enum = _cpp_enum(CONTRACT, "KernelFamily")
    table = {}
    for enumerator, name, fp8, layouts, sm90a, file in rows:
        table[name] = dict(code=enum[enumerator], fp8=fp8 == "true", file=file, sm90a=sm90a == "true",
                           layouts={k[1:].lower() for k in re.findall(r"RhsLayout::(k\w+)", layouts)})
    assert set(enumerator for enumerator, *_ in rows) == set(enum), "one row per KernelFamily"
    return dict(sorted(table.items(), key=lambda kv: kv[1]["code"]))


def cpp_families():
    """{family name: kernel attribute code} from csrc/kernel_table.h's kFamilyTable."""
    return {name: row["code"] for name, row in cpp_family_table().items()}


def cpp_layouts():
    """{layout name: rhs_layout code} from the RhsLayout enum (kCheckpoint -> "checkpoint")."""
    return {k[1:].lower(): v for k, v in _cpp_enum(CONTRACT, "RhsLayout").items()}


def cpp_kernel_configs():
    """kKernelConfigs of csrc/kernel_table.h as (family, token_tile, stages, cluster, raster) tuples
    (raster 0 where an entry leaves it out)."""
    body = re.search(r"kKernelConfigs\[\] = \{(.*?)\};", CONTRACT, re.S).group(1)
    names = cpp_families()
    codes = _cpp_enum(CONTRACT, "KernelFamily")
    by_code = {v: k for k, v in names.items()}
    entries = re.findall(r"\{KernelFamily::(k\w+),\s*(\d+),\s*(\d+),\s*(\d+)(?:,\s*(\d+))?\}", body)
    assert len(entries) == body.count("{KernelFamily::"), "an entry the pattern does not read"
    return [(by_code[codes[f]], int(t), int(s), int(c), int(r or 0)) for f, t, s, c, r in entries]


def _table(text, first_heading):
    """The rows (lists of cells) of the Markdown table whose first column is ``first_heading``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_heading} |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def _names(cell):
    return {n for n in re.split(r"[,\s]+", cell.split("(")[0]) if n}


def test_python_families_and_layouts_are_the_cpp_enums():
    fams = cpp_families()
    assert kernel_config.FAMILIES == tuple(sorted(fams, key=fams.get))
    assert [fams[f] for f in kernel_config.FAMILIES] == list(range(len(fams)))
    assert set(kernel_config.FP8_FAMILIES) <= set(fams)
    assert kernel_config.LAYOUT_CODES == cpp_layouts()
    # the copies a package without the compiled module uses
    unbuilt_families, unbuilt_fp8, unbuilt_layouts = options.contract_codes(None)
    assert unbuilt_families == fams and unbuilt_layouts == cpp_layouts()
    assert unbuilt_fp8 == tuple(n for n, row in cpp_family_table().items() if row["fp8"])


def test_kernel_configs_are_the_headers_table():
    got = [(c.family, c.token_tile, c.stages, c.cluster, c.raster) for c in kernel_config.kernel_configs()]
    assert got == cpp_kernel_configs()


def test_design_md_attribute_table():
    rows = {r[0]: r[1] for r in _table(DESIGN, "attribute")}
    kernel = {n: int(c) for c, n in re.findall(r"(\d+) `(\w+)`", rows["`kernel`"])}
    assert kernel == cpp_families()
    layouts = {n: int(c) for c, n in re.findall(r"\b(\d+) ([a-z]\w*)", rows["`rhs_layout`"])}
    assert layouts == cpp_layouts()


def test_design_md_has_a_section_per_kernel_family():
    kernels = DESIGN.split("\n## The kernels\n", 1)[1].split("\n## ", 1)[0]
    heads = re.findall(r"^### `(\w+)` \(([^)]*)\)", kernels, re.M)
    assert sorted(name for name, _ in heads) == sorted(cpp_families())
    for name, where in heads:
        for path in re.findall(r"csrc/[\w./]+", where):
            assert (ROOT / path).is_file(), f"design.md's section on {name} names {path}"


def test_design_md_dispatch_table_names_every_family_and_real_tiles():
    tiles = {}
    for fam, tile, _, _, _ in cpp_kernel_configs():
        tiles.setdefault(fam, set()).add(tile)
    named = set()
    for _, config in _table(DESIGN, "condition"):
        fam = re.match(r"`(\w+)`", config).group(1)
        named.add(fam)
        said = {int(t) for t in re.findall(r"(\d+) (?:tokens|up to|above|\(cluster)", config)}
        assert said and said <= tiles[fam], f"design.md's dispatch rule: {fam} tiles {said}"
    assert named == set(cpp_families())


def test_family_lists_name_every_family():
    """design.md's builds table, the README's support matrix and kernel_config's docstring."""
    fams = set(cpp_families())
    builds = {r[0]: _names(r[1]) for r in _table(DESIGN, "image")}
    assert builds["sm_90a machine code"] == fams
    assert set().union(*builds.values()) == fams
    support = [_names(r[1]) for r in _table(README, "GPU") if r[1] != "none: a clear error at call time"
               and not r[1].startswith("the C++ handler")]
    assert support[0] == fams and set().union(*support) == fams
    assert set(re.findall(r'^\* ``"(\w+)"``', kernel_config.__doc__, re.M)) == fams
    ffi = (ROOT / "ffi/gemm_ffi.h").read_text()
    attrs = " ".join(re.search(r"//\s+kernel\s+i32 enum KernelFamily(.*?)//\s+token_tile", ffi,
                               re.S).group(1).replace("//", " ").split())
    assert {n: int(c) for c, n in re.findall(r"(?<!\w)(\d+) (\w+)", attrs)} == cpp_families()


def _benchmarked_gpus():
    """{model: [json files]} of the GPUs the committed benchmark JSONs under docs/ ran on ("gpu"
    or "device", e.g. "NVIDIA H100 80GB HBM3" -> "H100")."""
    seen = {}
    for path in sorted((ROOT / "docs").glob("*.json")):
        d = json.loads(path.read_text())
        name = d.get("gpu") or d.get("device") or ""
        m = re.match(r"NVIDIA (\w+)", name)
        if m:
            seen.setdefault(m.group(1), []).append(path.name)
    return seen


def test_support_matrix_status_is_the_committed_runs():
    """The README support matrix's status column says on which GPUs the kernels ran: the row that
    says "benchmarked on" names exactly the GPU models of the committed benchmark JSONs, and no
    GPU of a row that says "not run on such a GPU" appears in any of them."""
    runs = _benchmarked_gpus()
    assert {"H100", "H200"} <= set(runs), runs
    rows = {r[0]: r[2] for r in _table(README, "GPU")}
    [(gpus, status)] = [(g, s) for g, s in rows.items() if "benchmarked on" in s]
    claimed = set(re.findall(r"\b([A-Z]+\d+)\b", status))
    assert claimed == set(runs), f"status {status!r}; the committed JSONs ran on {sorted(runs)}"
    assert claimed <= set(re.findall(r"\b([A-Z]+\d+)\b", gpus))
    for gpus, status in rows.items():
        if "not run on such a GPU" in status:
            named = set(re.findall(r"\b([A-Z]+\d+)\b", gpus))
            assert named and not named & set(runs), (gpus, {g: runs[g] for g in named & set(runs)})


def test_family_facts_in_the_docs_are_the_table():
    """Where the docs state a family's file, architectures or mode, kFamilyTable says the same:
    design.md's section headings (file; "sm_90" for the sm_90a families; "the FP8 mode" for the
    FP8 ones), its builds table and the README's support matrix (the sm_80 rows name the families
    that run from sm_80), its dispatch table (FP8 conditions for the FP8 families), and
    kernel_config's docstring ("compute capability 9.0 only" for the sm_90a families)."""
    table = cpp_family_table()
    kernels = DESIGN.split("\n## The kernels\n", 1)[1].split("\n## ", 1)[0]
    previous_file = None
    for name, where, rest in re.findall(r"^### `(\w+)` \(([^)]*)\)(.*)$", kernels, re.M):
        row, where = table[name], where + rest
        files = re.findall(r"csrc/[\w./]+", where)
        assert files == [row["file"]] or ("same file" in where and row["file"] == previous_file), (
            f"design.md's section on {name} names {files or where!r}; kFamilyTable: {row['file']}")
        previous_file = row["file"]
        assert ("sm_90" in where) == row["sm90a"], f"design.md's section on {name}: {where!r}"
        assert ("FP8 mode" in where) == row["fp8"], f"design.md's section on {name}: {where!r}"
    from_sm80 = {n for n, row in table.items() if not row["sm90a"]}
    builds = {r[0]: _names(r[1]) for r in _table(DESIGN, "image")}
    assert builds["sm_80 machine code"] == builds["compute_80 PTX"] == from_sm80
    support = {r[0]: _names(r[1]) for r in _table(README, "GPU")}
    assert support["A100 (8.0), A10 / RTX 30xx (8.6), L40S / RTX 4090 (8.9)"] == from_sm80
    assert support["B200 / GB200 (10.0), RTX 50xx (12.0)"] == from_sm80
    for cond, config in _table(DESIGN, "condition"):
        fam = re.match(r"`(\w+)`", config).group(1)
        assert ("FP8 mode" in cond) == table[fam]["fp8"], f"design.md's dispatch rule for {fam}: {cond!r}"
    bullets = dict(re.findall(r'^\* ``"(\w+)"``: (.*?)(?=^\* |^  The three|\Z)', kernel_config.__doc__,
                              re.M | re.S))
    for name, text in bullets.items():
        assert ("compute capability 9.0 only" in " ".join(text.split())) == table[name]["sm90a"], name


def _design_headings():
    return [h.strip("`") for h in re.findall(r"^#+ (.+)$", DESIGN, re.M)]


def test_section_references_name_existing_sections():
    """Every ``design.md, "Section"`` / ``design.md "Section"`` in the code and docs names a
    heading of docs/design.md (or the first words of one of its paragraphs)."""
    heads = _design_headings()
    paragraphs = {" ".join(p.split()) for p in DESIGN.split("\n\n")}
    seen = 0
    files = [p for d in ("csrc", "ffi", "jax_nvfp4", "tools", "tests", "examples")
             for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".h", ".cu", ".cuh", ".cc", ".sh")
             and p.resolve() != pathlib.Path(__file__).resolve()]
    chain = r"design\.md(?:\]\([^)]*\))?,? ((?:\"[^\"]+\"(?: / | or | and )?)+)"   # "A" / "B"
    for path in files + [ROOT / "README.md", ROOT / "docs/usage.md"]:
        text = re.sub(r"\n\s*(?://|#)?\s*", " ", path.read_text())     # comments joined
        refs = [r for c in re.findall(chain, text) for r in re.findall(r"\"([^\"]+)\"", c)]
        for ref in refs:
            ok = any(h.startswith(ref) for h in heads) or any(p.startswith(ref) for p in paragraphs)
            assert ok, f"{path.relative_to(ROOT)} refers to design.md \"{ref}\", which has no such section"
        seen += len(refs)
    assert seen >= 5


def _layer_row(name, tokens, activation="w4a4"):
    d = json.loads((ROOT / "docs" / name).read_text())
    (row,) = [r for r in d["results"] if r["tokens"] == tokens and r["activation"] == activation]
    return row


def test_readme_fp8_layer_figures_are_the_committed_json():
    """The fp8 layer against the exact one (W4A4): 48 experts at 4096 tokens, and the whole
    V4-Pro layer (384 experts, 8192 tokens), with the speedups, as the committed H200 JSONs say."""
    text = " ".join(_section(README, "Performance").split())
    m = re.search(r"The layer \(W4A4, 4096 tokens per GPU, H200, `docs/bench-layer-h200-\{fp8-cutlass,"
                  r"exact-sm90\}\.json`\): ([\d.]+) ms on fp8-prepared weights against ([\d.]+) exact "
                  r"\(([\d.]+)x\); the whole V4-Pro layer on one GPU \(384 experts, 8192 tokens, "
                  r"`docs/bench-layer-h200-v4pro-8192-\{fp8,exact\}\.json`\): ([\d.]+) against ([\d.]+) "
                  r"ms \(([\d.]+)x\)", text)
    assert m, "README: the fp8 layer's figures are not in the form this test reads"
    pairs = (("bench-layer-h200-fp8-cutlass.json", "bench-layer-h200-exact-sm90.json", 4096),
             ("bench-layer-h200-v4pro-8192-fp8.json", "bench-layer-h200-v4pro-8192-exact.json", 8192))
    for (fp8_name, exact_name, tokens), (fp8_ms, exact_ms, speedup) in zip(
            pairs, (m.groups()[:3], m.groups()[3:]), strict=True):
        fp8 = _layer_row(fp8_name, tokens)["layer_ms"]
        exact = _layer_row(exact_name, tokens)["layer_ms"]
        assert _printed(fp8, fp8_ms) and _printed(exact, exact_ms), (tokens, fp8, exact)
        assert _printed(exact / fp8, speedup), (tokens, exact / fp8, speedup)


# --- docs/design.md's layers against the package's import graph ---

def _package_imports() -> dict:
    """{module: the package's modules it imports} for every module of jax_nvfp4 (dotted, without
    the ``jax_nvfp4.`` prefix; the package's ``__init__`` is ``__init__``), from the source's
    import statements, those inside functions too. ``from pkg import name`` of a name that is not
    a module is an import of ``pkg``'s ``__init__``; the compiled module ``_jax_nvfp4`` is none."""

    pkg_dir = ROOT / "jax_nvfp4"

    def dotted(path):               # jax_nvfp4/nn/frozen.py: nn.frozen; jax_nvfp4/nn/__init__.py: nn
        parts = list(path.relative_to(pkg_dir).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        return ".".join(parts)

    files = {dotted(p): p for p in pkg_dir.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = [] if mod == "__init__" else mod.split(".")
        package = here if is_pkg else here[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("jax_nvfp4")]
                bases = [n.split(".")[1:] for n in names]
                deps.update(".".join(b) or "__init__" for b in bases)
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".")
                                                                  if node.module else [])
            elif (node.module or "").split(".")[0] == "jax_nvfp4":
                base = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:
                sub = ".".join(base + [a.name])
                if sub in files:
                    deps.add(sub)
                elif a.name != "_jax_nvfp4":
                    deps.add(".".join(base) or "__init__")
        deps.discard(mod)
        graph[mod] = deps
    return graph


def _design_layers() -> dict:
    """{module: layer number} from docs/design.md's list "The Python package, bottom to top"."""
    section = _section(DESIGN, "The Python package, bottom to top")
    items = re.findall(r"^(\d+)\. (.+?)(?=^\d+\. |\Z)", section, re.M | re.S)
    layers = {}
    modules = set(_package_imports())
    for number, text in items:
        for name in re.findall(r"`([\w.]+)`", text):
            if name in modules:
                assert name not in layers, f"design.md lists `{name}` in two layers"
                layers[name] = int(number)
    return layers


def test_design_md_layers_are_the_import_graph():
    """Every module of the package has one layer in design.md's list, and every import (deferred
    ones too) points to the importer's layer or one below it."""
    graph = _package_imports()
    layers = _design_layers()
    assert len(graph) > 30 and {"maths.formats", "config.options", "ops.gemm", "layer.moe",
                                "checkpoint"} <= set(graph)
    missing = sorted(set(graph) - set(layers))
    assert not missing, f"docs/design.md's layer list does not name: {missing}"
    up = sorted(f"{m} (layer {layers[m]}) imports {d} (layer {layers[d]})"
                for m, deps in graph.items() for d in deps if layers[d] > layers[m])
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def test_the_import_graph_reader_sees_every_form_of_import():
    """The reader of the test above: relative, absolute, deferred, ``from . import module`` and
    ``from . import name`` (the package's ``__init__``) forms, against modules known to use them."""
    graph = _package_imports()
    assert {"_extension", "ops.autodiff", "maths.formats", "ops.gemm"} <= graph["__init__"]
    options = graph["config.options"]
    assert "maths.formats" in options and "_extension" in options
    assert {"nn", "nn.frozen", "layer.moe", "config.moe_params"} <= graph["nn.eqx"]
    assert {"__init__", "bench.common"} <= graph["bench.ep"]
    # `from . import _jax_nvfp4` (the compiled module) is not an edge; `from . import _jax_range` is
    assert graph["_extension"] == {"_jax_range"}
    assert "checkpoint.safetensors_io" in graph["checkpoint.hf_folder"]
    assert {"ops.autodiff", "ops.fp8", "config.kernel_config", "maths.qwix_interop"} <= graph["ops.gemm"]


FOLDER_LAYERS = {"maths": 1, "config": 2, "ops": 3, "layer": 4, "checkpoint": 5, "nn": 5, "bench": 5}


def test_the_folders_are_the_layers():
    """Every module sits in the folder of its layer: the package's top level holds only the
    compiled module's two layer-0 modules and ``__init__``; each subpackage's modules (and its
    ``__init__``) have the subpackage's layer in design.md's list, and the subpackages are the
    layers design.md names, each ``__init__`` opening with a docstring of one paragraph."""
    layers = _design_layers()
    top = sorted(m for m in _package_imports() if "." not in m and m not in FOLDER_LAYERS)
    assert top == ["__init__", "_extension", "_jax_range"], top
    assert {layers[m] for m in top if m != "__init__"} == {0}
    folders = {p.name for p in (ROOT / "jax_nvfp4").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FOLDER_LAYERS), folders
    for module, layer in layers.items():
        folder = module.split(".")[0]
        if folder in FOLDER_LAYERS:
            assert layer == FOLDER_LAYERS[folder], f"{module}: layer {layer}, folder {folder}"
    for folder in FOLDER_LAYERS:
        doc = ast.get_docstring(ast.parse((ROOT / "jax_nvfp4" / folder / "__init__.py").read_text()))
        assert doc and "\n\n" not in doc.strip() or folder in ("nn", "bench"), folder


def test_usage_md_names_the_kernel_of_fp8_prepared_weights():
    """docs/usage.md says which GPU kernel runs weights prepared as e4m3: the family the
    heuristic picks for them on sm_90, which the build can run there (not a refusal)."""
    fam = kernel_config.choose(64, 256, 256, 4, precision="fp8", rhs_layout="fp8", arch=90).family
    assert fam == "wgmma_fp8_prepared"
    # a build with the CUDA handler runs it there (a CPU-only build runs no family)
    assert fam in kernel_config.runnable_families(90) or not kernel_config.runnable_families(90)
    usage = (ROOT / "docs" / "usage.md").read_text()
    para = usage[usage.index('`load_moe(..., layout="fp8")` loads into them.'):][:400]
    assert f"`{fam}` runs them" in " ".join(para.split())
    assert "refuse them at trace" not in usage
