"""Tests of jax_nvfp4.checkpoint.hf_folder and the folder/index paths of load_moe / load_model_moe:
Hugging Face checkpoints as they ship (``model-0000k-of-0000n.safetensors`` + index + config.json),
built here as a 3-shard folder, and the real AMD Quark export in tests/fixtures/."""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import re
import sys
import types

import jax
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import checkpoint as ckpt
from jax_nvfp4.checkpoint import hf_folder
from oracles import rel_err
from test_checkpoint import E, H, I, TOPK, cfg, check_loaded, load_quiet, raw, reference, tensors_from

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                       "quark-nvfp4-tiny-deepseek-v3")
L1, L2 = "model.layers.1.mlp", "model.layers.2.mlp"
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def shard_of(name: str) -> int:
    """Where each tensor lives: layers straddle shard boundaries, as in real checkpoints."""
    if name.startswith(L1):
        return 1 if ".experts.3." not in name and ".shared_experts." not in name else 2
    if name.startswith(L2):
        return 3 if ".experts.2." in name or ".experts.3." in name else 2
    return 3 if name.startswith("lm_head") else 1


HF_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
    "moe_intermediate_size": I, "intermediate_size": 4 * H, "n_routed_experts": E,
    "num_experts_per_tok": TOPK, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "hidden_act": "silu", "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
}
CONFIG = cfg(scoring_func="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
             activation_scale="static")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 3-shard ModelOpt checkpoint with two MoE layers, a dense layer, index and configs."""
    d = tmp_path_factory.mktemp("ckpt")
    lin1, extra1 = reference(seed=20)
    lin2, extra2 = reference(seed=21)
    tensors = {"model.embed_tokens.weight": np.ones((8, H), np.float32),
               "model.layers.0.mlp.gate_proj.weight": np.ones((I, H), np.float32),
               "lm_head.weight": np.ones((8, H), np.float32)}
    tensors.update(tensors_from(lin1, extra1, prefix=L1))
    tensors.update(tensors_from(lin2, extra2, prefix=L2))
    parts = {i: {} for i in (1, 2, 3)}
    for k, v in tensors.items():
        parts[shard_of(k)][k] = v
    for i, name in enumerate(SHARDS, 1):
        ckpt.save_safetensors(d / name, parts[i], metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(np.asarray(v).nbytes for v in tensors.values())},
             "weight_map": {k: SHARDS[shard_of(k) - 1] for k in tensors}}
    (d / hf_folder.INDEX_NAME).write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    (d / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.29"},
         "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    return d, {L1: (lin1, extra1), L2: (lin2, extra2)}


@pytest.fixture
def opened(monkeypatch):
    """Record every safetensors file opened (headers and memory maps both go through open)."""
    seen: list[str] = []
    real_open = builtins.open

    def recording_open(file, *a, **kw):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(".safetensors"):
            seen.append(os.path.basename(os.fspath(file)))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", recording_open)
    return seen


def same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(raw(x), raw(y))


def test_two_calls_load_a_sharded_folder(folder, opened):
    """MoEConfig.from_hf_config(folder) + load_moe(folder, prefix, config) equals loading from the
    explicit shard list, and opens only the shards holding the layer."""
    d, ref = folder
    config = jn.MoEConfig.from_hf_config(d)
    assert config == CONFIG
    opened.clear()
    w = load_quiet(d, L1, config)
    assert sorted(set(opened)) == SHARDS[:2]
    check_loaded(w, *ref[L1])
    same_tree(w, load_quiet([d / s for s in SHARDS], L1, config))
    opened.clear()
    w2 = load_quiet(d / hf_folder.INDEX_NAME, L2, config, experts=[1, 0])
    assert sorted(set(opened)) == [SHARDS[1]]
    full2 = load_quiet([str(d / s) for s in SHARDS], L2, config)
    np.testing.assert_array_equal(np.asarray(w2.w13.data), np.asarray(full2.w13.data)[[1, 0]])
    assert w2.expert_ids == (1, 0)
    opened.clear()
    check_loaded(load_quiet(str(d), L2, config), *ref[L2])
    assert sorted(set(opened)) == SHARDS[1:]


def test_sharded_checkpoint_mapping(folder, opened):
    d, _ = folder
    src = hf_folder.open_checkpoint(d)
    assert isinstance(src, hf_folder.ShardedCheckpoint)
    assert f"{L2}.experts.3.down_proj.weight" in src and len(src) == len(list(src))
    assert src.shard_of(f"{L2}.experts.3.down_proj.weight") == str(d / SHARDS[2])
    assert src.opened == [] and opened == []          # names come from the index alone
    assert src.dtype_of(f"{L1}.experts.0.up_proj.weight_scale") == "F8_E4M3"
    assert src.opened == [str(d / SHARDS[0])]


def test_missing_tensor_names_it_and_the_shards(folder, tmp_path):
    d, _ = folder
    index = json.loads((d / hf_folder.INDEX_NAME).read_text())
    name = f"{L2}.experts.2.up_proj.weight_scale"
    del index["weight_map"][name]
    for s in SHARDS:
        os.symlink(d / s, tmp_path / s)
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(KeyError, match=rf"{name}.*weight_map.*{SHARDS[0]}.*{SHARDS[2]}"):
        ckpt.load_moe(tmp_path, L2, CONFIG)
    # one shard passed alone: the error says which file was searched and what to pass instead
    with pytest.raises(KeyError, match=rf"{L2}\.gate\.weight.*looked in {SHARDS[0]}.*one shard.*folder"):
        ckpt.load_moe(d / SHARDS[0], L2, CONFIG)
    with pytest.raises(KeyError, match=rf"looked in {SHARDS[0]}, {SHARDS[1]}\)"):
        ckpt.load_moe([d / SHARDS[0], d / SHARDS[1]], L2, CONFIG)
    # the index names a shard that is not on disk
    os.unlink(tmp_path / SHARDS[2])
    index["weight_map"][name] = SHARDS[2]
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=SHARDS[2]):
        ckpt.load_moe(tmp_path, L2, CONFIG)


def test_paths_that_are_not_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        ckpt.load_moe(tmp_path / "nope", L1, CONFIG)
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json"):
        ckpt.load_moe(tmp_path, L1, CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(ValueError, match="not a safetensors index"):
        ckpt.load_moe(tmp_path / "config.json", L1, CONFIG)
    with pytest.raises(FileNotFoundError, match="pass it alone"):
        ckpt.load_moe([tmp_path], L1, CONFIG)
    missing = tmp_path / "missing.safetensors"   # a missing file in a list is not a folder
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(missing))}: no such "
                                                "safetensors file$"):
        hf_folder.open_checkpoint([missing])
    (tmp_path / "bad.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(ValueError, match="inside the index's folder"):
        hf_folder.open_checkpoint(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="source"):
        ckpt.load_moe(3, L1, CONFIG)


def test_load_model_moe_every_layer(folder, opened, capsys, monkeypatch):
    d, ref = folder
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)     # the fallback, tqdm installed or not
    opened.clear()
    layers = ckpt.load_model_moe(d, progress=False)           # config from config.json
    assert list(layers) == [L1, L2]
    assert sorted(set(opened)) == SHARDS and all(opened.count(s) <= 2 for s in SHARDS)
    for p in (L1, L2):
        check_loaded(layers[p], *ref[p])
    assert capsys.readouterr().err == ""
    # the fallback progress line on stderr
    got = dict(ckpt.iter_model_moe(d, CONFIG, prefixes=[L2], check=False))
    assert list(got) == [L2]
    err = capsys.readouterr().err
    assert "loading MoE layers: 1/1" in err and err.endswith("\n")
    assert ckpt.moe_layer_prefixes(hf_folder.open_checkpoint(d)) == [L1, L2]
    with pytest.raises(ValueError, match="config: required"):
        ckpt.load_model_moe([d / s for s in SHARDS])


def test_load_model_moe_uses_tqdm_when_installed(folder, monkeypatch):
    d, _ = folder
    calls = []

    class FakeTqdm:
        def __init__(self, total, desc, unit):
            calls.append(("init", total))

        def set_postfix_str(self, s):
            calls.append(("postfix", s))

        def update(self, n):
            calls.append(("update", n))

        def close(self):
            calls.append(("close",))

    mod = types.ModuleType("tqdm")
    auto = types.ModuleType("tqdm.auto")
    auto.tqdm = FakeTqdm
    mod.auto = auto
    monkeypatch.setitem(sys.modules, "tqdm", mod)
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto)
    ckpt.load_model_moe(d, CONFIG)
    assert calls == [("init", 2), ("postfix", L1), ("update", 1), ("postfix", L2), ("update", 1),
                     ("close",)]


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_quark_fixture_from_folder_matches_quark(backend):
    """The real Quark export: two calls from its folder, then the layer against Quark's own
    quantized forward (golden data we did not write). ``auto`` is the custom call where built
    (the CUDA handler on a GPU machine)."""
    config = jn.MoEConfig.from_hf_config(FIXTURE)
    assert config == jn.MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                                  scoring_func="sigmoid", n_group=2, topk_group=1,
                                  norm_topk_prob=True, routed_scaling_factor=2.5,
                                  n_shared_experts=1, activation="w4a4", activation_scale="static")
    w = load_quiet(FIXTURE, "model.layers.1.mlp", config)
    same_tree(w, load_quiet(os.path.join(FIXTURE, "model.safetensors"), "model.layers.1.mlp", config))
    assert list(ckpt.load_model_moe(FIXTURE, progress=False)) == ["model.layers.1.mlp"]
    x = np.load(os.path.join(FIXTURE, "x.npy"))
    quark = np.load(os.path.join(FIXTURE, "quark_layer1_moe_out.npy"))
    # jitted: one compile (op-by-op, the reference layer took 20 s here on CPU); both row dtypes
    f32_rows = dataclasses.replace(config, row_dtype="float32")
    out, out16 = (np.asarray(o, np.float32) for o in jax.jit(lambda x, w: (
        jn.moe(x, w, f32_rows, backend=backend), jn.moe(x, w, config, backend=backend)))(x, w))
    # Quark's forward is float32 math on the same quantized values: with float32 rows, equal up
    # to rounding order (about 1e-7 relative here; the quantization error itself is about 0.2)
    np.testing.assert_allclose(out, quark, rtol=0, atol=1e-5 * np.abs(quark).max())
    # The default bf16 rows: the activation rounded to bf16 before its requantization moves the
    # codes that lie within a bf16 step of a rounding boundary (0.019 relative L2 measured)
    assert rel_err(out16, quark) <= 0.03 and rel_err(out16, out) <= 0.03


def test_index_naming_the_wrong_shard_says_so(folder, tmp_path):
    """The index places a tensor in a shard that does not hold it: the error names the index,
    the tensor and the shard (not 'missing from the weight_map', which would be untrue)."""
    d, _ = folder
    index = json.loads((d / hf_folder.INDEX_NAME).read_text())
    name = f"{L2}.experts.2.up_proj.weight_scale"
    assert index["weight_map"][name] == SHARDS[2]
    index["weight_map"][name] = SHARDS[0]
    for s in SHARDS:
        os.symlink(d / s, tmp_path / s)
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps(index))
    pattern = rf"{hf_folder.INDEX_NAME}.*places tensor '{name}' in {SHARDS[0]}, which does not hold it"
    with pytest.raises(ValueError, match=pattern):
        ckpt.load_moe(tmp_path, L2, CONFIG)
    src = hf_folder.open_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=pattern):
        src.dtype_of(name)


@pytest.mark.parametrize("shard", ["..x.safetensors", "...safetensors", "sub/..x.safetensors"])
def test_shard_names_starting_with_dots_are_plain_names(tmp_path, shard):
    """Only a '..' path component leaves the folder; '..x.safetensors' is an ordinary file."""
    (tmp_path / shard).parent.mkdir(exist_ok=True)
    ckpt.save_safetensors(tmp_path / shard, {"a": np.arange(3, dtype=np.int32)})
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps({"weight_map": {"a": shard}}))
    src = hf_folder.open_checkpoint(tmp_path)
    np.testing.assert_array_equal(src["a"], [0, 1, 2])
    assert src.shard_of("a") == os.path.join(str(tmp_path), shard)


@pytest.mark.parametrize("shard", ["../x.safetensors", "sub/../../x.safetensors", "/x.safetensors",
                                   "..", "", "sub/", "a\0b.safetensors", ".", "sub/."])
def test_shard_names_that_leave_the_folder_are_refused(tmp_path, shard):
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/{hf_folder.INDEX_NAME}: shard .* is not a "
                                         "file name inside the index's folder"):
        hf_folder.open_checkpoint(tmp_path)


@pytest.mark.parametrize("value", [-0.05, np.nan, 0.0])
def test_quark_fixture_with_a_bad_gate_input_scale_2_is_refused(value):
    """The real Quark export with one gate input_scale_2 made negative, NaN or zero: the up
    projection's larger scale would have hidden it in max(gate, up)."""
    tensors = dict(ckpt.read_safetensors(os.path.join(FIXTURE, "model.safetensors")))
    name = "model.layers.1.mlp.experts.3.gate_proj.input_scale_2"
    up = tensors[name.replace("gate_proj", "up_proj")]
    assert float(np.asarray(up).reshape(())) > 0
    tensors[name] = np.full(np.shape(tensors[name]), value, np.float32)
    config = jn.MoEConfig.from_hf_config(FIXTURE)
    with pytest.raises(ValueError, match=rf"{name}: expected a finite scale >= 2\^-126"):
        ckpt.load_moe(tensors, "model.layers.1.mlp", config)


def test_index_naming_a_tensor_twice_is_refused(tmp_path):
    """A weight_map that names a tensor twice (JSON allows repeated keys; the last would win
    silently): a ValueError naming the index and the tensor, as a repeated key inside a
    safetensors header is."""
    for s in ("a.safetensors", "b.safetensors"):
        ckpt.save_safetensors(tmp_path / s, {"w": np.arange(3, dtype=np.int32)})
    (tmp_path / hf_folder.INDEX_NAME).write_text(
        '{"metadata": {}, "weight_map": {"w": "a.safetensors", "v": "a.safetensors", '
        '"w": "b.safetensors"}}')
    with pytest.raises(ValueError, match=rf"{hf_folder.INDEX_NAME}: its weight_map names "
                                         r"tensor 'w' twice \(a.safetensors, b.safetensors\)"):
        hf_folder.open_checkpoint(tmp_path)
    (tmp_path / hf_folder.INDEX_NAME).write_text(
        '{"weight_map": {"w": "a.safetensors"}, "weight_map": {"w": "b.safetensors"}}')
    with pytest.raises(ValueError, match=rf"{hf_folder.INDEX_NAME}: key 'weight_map' appears "
                                         "twice"):
        hf_folder.open_checkpoint(tmp_path / hf_folder.INDEX_NAME)


def test_folder_with_an_index_and_model_safetensors_reads_the_index(tmp_path):
    """docs/usage.md / open_checkpoint: a folder's index takes precedence over a
    model.safetensors beside it (which then is not read)."""
    ckpt.save_safetensors(tmp_path / "shard.safetensors", {"w": np.arange(3, dtype=np.int32)})
    ckpt.save_safetensors(tmp_path / hf_folder.SINGLE_FILE_NAME,
                          {"w": np.full(3, 7, np.int32), "only_here": np.zeros(1, np.int32)})
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "shard.safetensors"}}))
    src = hf_folder.open_checkpoint(tmp_path)
    np.testing.assert_array_equal(src["w"], [0, 1, 2])
    assert "only_here" not in src and set(src) == {"w"}
    os.remove(tmp_path / hf_folder.INDEX_NAME)               # without the index: the file
    np.testing.assert_array_equal(hf_folder.open_checkpoint(tmp_path)["w"], [7, 7, 7])



@pytest.mark.parametrize("text,why", [
    ("[1, 2]", "expected a JSON object"), ('{"weight_map": {"a": 3}}', "expected a JSON object"),
    ('{"weight_map": {"a": ["x.safetensors"]}}', "expected a JSON object"),
    ('{"weight_map": ["a"]}', "expected a JSON object"), ('{"metadata": {}}', "expected a JSON"),
    ('{"weight_map": {"a": "x.safetensors"', "unreadable JSON"),
    (b"\xff\xfe{}", "unreadable JSON")])
def test_files_that_are_not_an_index(tmp_path, text, why):
    """A .json that is not {"weight_map": {name: file}}: a ValueError naming the file."""
    path = tmp_path / "x.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=rf"^{path}: not a safetensors index \({why}"):
        hf_folder.open_checkpoint(path)


def test_index_metadata_and_listing(tmp_path):
    """The index's "metadata" object is kept (an empty dict without one); error listings name at
    most six shards, then the count."""
    ckpt.save_safetensors(tmp_path / "a.safetensors", {"w": np.arange(3, dtype=np.int32)})
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps(
        {"metadata": {"total_size": 12}, "weight_map": {"w": "a.safetensors"}}))
    src = hf_folder.open_checkpoint(tmp_path)
    assert src.metadata == {"total_size": 12}
    assert src.file_of("w") == src.shard_of("w") == os.path.join(str(tmp_path), "a.safetensors")
    (tmp_path / hf_folder.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
    assert hf_folder.open_checkpoint(tmp_path).metadata == {}
    names = [f"s{i}.safetensors" for i in range(7)]
    assert hf_folder._listing(names[:6]) == ", ".join(names[:6])
    assert hf_folder._listing(names) == ", ".join(names[:6]) + ", ... (7 in all)"
    assert hf_folder._listing(["d/x", "y"], limit=1) == "x, ... (2 in all)"
    assert hf_folder.where_looked({"w": 1}) == ""


def test_repeated_keys_nested_in_the_index_are_refused(tmp_path):
    """A repeated key anywhere in the index (inside "metadata", inside a list), not only in the
    weight_map."""
    for text in ('{"metadata": {"a": 1, "a": 2}, "weight_map": {}}',
                 '{"metadata": {"l": [{"k": 1, "k": 1}]}, "weight_map": {}}'):
        (tmp_path / hf_folder.INDEX_NAME).write_text(text)
        with pytest.raises(ValueError, match=r"key '[ak]' appears twice in one JSON object"):
            hf_folder.open_checkpoint(tmp_path)


def test_folder_without_an_index_or_model_safetensors_reads_every_safetensors_file(tmp_path):
    """The documented last resort: every ``*.safetensors`` of the folder (sorted, headers read
    up front); other files ignored; model.safetensors, when present, is the only file read."""
    ckpt.save_safetensors(tmp_path / "b.safetensors", {"y": np.arange(2, dtype=np.int32)})
    ckpt.save_safetensors(tmp_path / "a.safetensors", {"x": np.ones(3, np.float32)})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "notes.safetensors.txt").write_text("not a checkpoint")
    src = hf_folder.open_checkpoint(tmp_path)
    assert src.paths == [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert sorted(src) == ["x", "y"] and src.file_of("y") == str(tmp_path / "b.safetensors")
    np.testing.assert_array_equal(src["x"], np.ones(3, np.float32))
    np.testing.assert_array_equal(src["y"], [0, 1])
    ckpt.save_safetensors(tmp_path / hf_folder.SINGLE_FILE_NAME, {"z": np.zeros(1, np.uint8)})
    src = hf_folder.open_checkpoint(tmp_path)
    assert src.paths == [str(tmp_path / hf_folder.SINGLE_FILE_NAME)] and list(src) == ["z"]
    for f in os.listdir(tmp_path):
        os.remove(tmp_path / f)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(tmp_path))}: folder has no "
                                                r"model\.safetensors\.index\.json, no "
                                                r"model\.safetensors and no \*\.safetensors file$"):
        hf_folder.open_checkpoint(tmp_path)
