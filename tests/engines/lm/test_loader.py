"""Checkpoint loader, random checkpoint writer and their errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.config import PRESETS, ConfigError, ModelConfig
from engines.lm.loader.checkpoint import INDEX_FILE, CheckpointError, load_model, random_model
from engines.lm.loader.keys import checkpoint_shapes, serving_sources
from engines.lm.loader.random_checkpoint import write_random_checkpoint
from engines.lm.model.moss import MossSpeechModel
from engines.tokens import ENDOFTEXT, IM_END, IM_START, OBJECT_REF_START
from moss_speech.cli import main as cli_main
from tests.reference.dense_model import read_checkpoint_tensors

QPROJ = "model.shared_block.layers.1.self_attn.q_proj.weight"
UPPROJ = "model.audio_block.layers.1.mlp.up_proj.weight"


def test_tiny_checkpoint_loads_and_matches(tiny_checkpoint, tiny_config):
    model = load_model(tiny_checkpoint, "cpu", torch.float32)
    tensors = read_checkpoint_tensors(tiny_checkpoint)
    assert set(tensors) == set(checkpoint_shapes(tiny_config))
    params = dict(model.named_parameters())
    assert set(params) == set(serving_sources(tiny_config))
    for name, keys in serving_sources(tiny_config).items():
        torch.testing.assert_close(params[name], torch.cat([tensors[k] for k in keys]), rtol=0, atol=0)
    # Fusion order spot checks: text tail layer 0 is flat layer S, audio tail layer 1 is S + M + 1.
    s, m = tiny_config.num_shared_layers, tiny_config.num_modality_layers
    kv = tiny_config.num_key_value_heads * tiny_config.head_dim
    k_rows = model.layers[s].qkv_proj.weight[-2 * kv:-kv]
    torch.testing.assert_close(k_rows, tensors["model.text_block.layers.0.self_attn.k_proj.weight"], rtol=0, atol=0)
    up_rows = model.layers[s + m + 1].gate_up_proj.weight[tiny_config.intermediate_size:]
    torch.testing.assert_close(up_rows, tensors[UPPROJ], rtol=0, atol=0)


def test_load_casts_to_requested_dtype(tiny_checkpoint):
    model = load_model(tiny_checkpoint, "cpu", "bfloat16")
    tensors = read_checkpoint_tensors(tiny_checkpoint)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    torch.testing.assert_close(model.text_lm_head.weight, tensors["text_lm_head.weight"].bfloat16(), rtol=0, atol=0)


def test_single_file_checkpoint_without_index(tiny_checkpoint, tmp_path):
    tensors = read_checkpoint_tensors(tiny_checkpoint)
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    torch.testing.assert_close(model.audio_embed.weight, tensors["model.audio_embed.weight"], rtol=0, atol=0)


def test_full_size_layout_has_446_keys():
    config = PRESETS["full-random"]
    shapes = checkpoint_shapes(config)
    assert len(shapes) == 446
    assert shapes["model.embed_tokens.weight"] == (151680, 4096)
    assert shapes["model.audio_embed.weight"] == (16512, 4096)
    assert shapes["text_lm_head.weight"] == (151680, 4096)
    assert shapes["audio_lm_head.weight"] == (16512, 4096)
    assert shapes["model.shared_block.layers.31.self_attn.o_proj.weight"] == (4096, 4096)
    assert shapes["model.audio_block.layers.3.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.text_block.layers.3.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.text_block.layers.0.mlp.down_proj.weight"] == (4096, 12288)
    assert "model.shared_block.layers.32.input_layernorm.weight" not in shapes
    # Every checkpoint key feeds exactly one serving parameter, whose shape is the concatenation.
    sources = serving_sources(config)
    used = [k for keys in sources.values() for k in keys]
    assert sorted(used) == sorted(shapes)
    with torch.device("meta"):
        model = MossSpeechModel(config, device="meta", dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        ks = sources[name]
        assert p.shape == (sum(shapes[k][0] for k in ks), *shapes[ks[0]][1:]), name


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard_of(ckpt, key, edit):
    """Apply `edit(tensors)` to the shard holding `key` and keep the index consistent with the shard."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    file = index["weight_map"][key]
    tensors = load_file(str(ckpt / file))
    edit(tensors)
    save_file(tensors, str(ckpt / file))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file or k in tensors}
    index["weight_map"].update({k: file for k in tensors})
    (ckpt / INDEX_FILE).write_text(json.dumps(index))


def _error(ckpt) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    return str(e.value)


def test_missing_key(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    _rewrite_shard_of(ckpt, QPROJ, lambda t: t.pop(QPROJ))
    assert f"{QPROJ}: missing" in _error(ckpt)


def test_unexpected_key(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    _rewrite_shard_of(ckpt, QPROJ, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    assert "model.extra.weight: unexpected key" in _error(ckpt)


def test_wrong_shape(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    _rewrite_shard_of(ckpt, QPROJ, lambda t: t.update({QPROJ: t[QPROJ][:-1].contiguous()}))
    assert f"{QPROJ}: shape [63, 64], expected [64, 64]" in _error(ckpt)


def test_wrong_dtype(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    _rewrite_shard_of(ckpt, UPPROJ, lambda t: t.update({UPPROJ: t[UPPROJ].half()}))
    assert f"{UPPROJ}: dtype F16, expected float32" in _error(ckpt)


def test_all_problems_in_one_error(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    _rewrite_shard_of(ckpt, QPROJ, lambda t: t.pop(QPROJ))
    _rewrite_shard_of(ckpt, UPPROJ, lambda t: t.update({UPPROJ: t[UPPROJ].half()}))
    msg = _error(ckpt)
    assert f"{QPROJ}: missing" in msg and f"{UPPROJ}: dtype F16" in msg


def test_missing_shard_file(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    gone = weight_map["text_lm_head.weight"]
    (ckpt / gone).unlink()
    msg = _error(ckpt)
    lost = [k for k, f in weight_map.items() if f == gone]
    assert lost and all(f"{k}: shard file {gone} does not exist" in msg for k in lost)


def test_key_listed_in_index_but_not_in_shard(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    index = json.loads((ckpt / INDEX_FILE).read_text())
    file = index["weight_map"][QPROJ]
    tensors = load_file(str(ckpt / file))
    del tensors[QPROJ]
    save_file(tensors, str(ckpt / file))
    assert f"{QPROJ}: listed in the index for {file} but not stored in it" in _error(ckpt)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}'])
def test_bad_index_json(tiny_checkpoint, tmp_path, text):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / INDEX_FILE).write_text(text)
    assert INDEX_FILE in _error(ckpt)


def test_no_weights_at_all(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    assert "model.safetensors" in _error(tmp_path)


def test_config_missing_key_is_config_error(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["num_modality_layers"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="num_modality_layers"):
        ModelConfig.from_json(ckpt)
    with pytest.raises(ConfigError, match="num_modality_layers"):
        load_model(ckpt)


def test_writer_layout_and_config(tiny_checkpoint, tiny_config):
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    assert raw["num_hidden_layers"] == tiny_config.num_shared_layers + tiny_config.num_modality_layers
    assert ModelConfig.from_json(tiny_checkpoint) == tiny_config
    files = sorted(set(json.loads((tiny_checkpoint / INDEX_FILE).read_text())["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_writer_dtype_override_and_seed(tmp_path):
    a = write_random_checkpoint(tmp_path / "a", "tiny-random", seed=1, num_shards=1, dtype="bfloat16")
    b = write_random_checkpoint(tmp_path / "b", "tiny-random", seed=1, num_shards=3, dtype="bfloat16")
    assert ModelConfig.from_json(a).torch_dtype == "bfloat16"
    ta, tb = read_checkpoint_tensors(a), read_checkpoint_tensors(b)
    assert ta["model.text_norm.weight"].dtype == torch.bfloat16
    assert all(torch.equal(ta[k], tb[k]) for k in ta)  # sharding does not change the values
    assert load_model(b).dtype == torch.bfloat16


def test_stand_in_tokenizer_has_real_special_ids(tiny_checkpoint):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    for name, id_ in (("<|endoftext|>", ENDOFTEXT), ("<|im_start|>", IM_START), ("<|im_end|>", IM_END),
                      ("<|object_ref_start|>", OBJECT_REF_START)):
        assert tok.token_to_id(name) == id_
    text = "<|im_start|>user\nHello, World! 0123 ~{}|\t<|im_end|>\n"
    ids = tok.encode(text).ids
    assert ids[0] == IM_START and IM_END in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    plain = "".join(chr(c) for c in range(32, 127))
    assert tok.decode(tok.encode(plain).ids) == plain


def test_write_checkpoint_command(tmp_path):
    out = tmp_path / "cli"
    assert cli_main(["write-checkpoint", "--preset", "tiny-random", "--out", str(out), "--seed", "3",
                     "--shards", "1"]) == 0
    assert (out / "model-00001-of-00001.safetensors").exists()
    assert load_model(out).config == PRESETS["tiny-random"]


def test_random_model_is_seeded(tiny_config):
    a = random_model(tiny_config, "cpu", seed=5)
    b = random_model(tiny_config, "cpu", seed=5)
    c = random_model(tiny_config, "cpu", seed=6)
    assert torch.equal(a.layers[1].qkv_proj.weight, b.layers[1].qkv_proj.weight)
    assert not torch.equal(a.layers[1].qkv_proj.weight, c.layers[1].qkv_proj.weight)
    norm = a.layers[0].k_norm.weight
    assert 0.8 < norm.mean() < 1.2 and norm.std() > 0.01  # ~1 with noise so the QK-norm scale matters
    assert a.text_lm_head.weight.std() < 0.05
