"""`moss-speech check-weights` and the loaders' start-up check on the tiny checkpoint layout and broken copies of it:
every problem named with what was expected, exit 1 on any, and the loaders refusing with the same words."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.lm.loader.checkpoint import CheckpointError, load_model
from engines.lm.loader.random_checkpoint import write_random_checkpoint
from engines.speech_in import SpeechEncoder
from engines.speech_out.checkpoint import CheckpointError as CodecCheckpointError
from engines.speech_out.decoder import CodecDecoder
from engines.speech_out.random_codec import write_random_codec
from engines.weights_check import WeightsError, problems_text, require_weights, weights_problems
from moss_speech.cli import main as cli_main
from tests.engines.speech_out.campplus_stand_in import write_campplus_stand_in


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("weights")
    model = write_random_checkpoint(root / "model", "tiny-random", seed=0, num_shards=2)
    codec = write_random_codec(root / "codec", "tiny-random", seed=0)
    write_campplus_stand_in(codec / "flow" / "campplus.onnx")
    return model, codec


@pytest.fixture
def copy(layout, tmp_path) -> tuple[Path, Path]:
    model, codec = layout
    return Path(shutil.copytree(model, tmp_path / "model")), Path(shutil.copytree(codec, tmp_path / "codec"))


def check(model: Path | None, codec: Path | None, capsys) -> tuple[int, str]:
    argv = ["check-weights"] + ([str(model)] if model else []) + (["--codec", str(codec)] if codec else [])
    rc = cli_main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_tiny_layout_passes(layout, capsys):
    model, codec = layout
    assert weights_problems(str(model), str(codec)) == []
    rc, out = check(model, codec, capsys)
    assert rc == 0 and out.startswith("ok:")
    require_weights(str(model), str(codec))  # no error
    require_weights("tiny-random", "tiny-random")  # presets have no files to check


def test_nothing_to_check_is_a_usage_error(capsys):
    assert cli_main(["check-weights"]) == 2


def _rewrite_shard(model: Path, change) -> str:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    key = "model.text_norm.weight"
    shard = model / index["weight_map"][key]
    tensors = load_file(str(shard))
    tensors[key] = change(tensors[key])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return key


def test_a_wrong_lm_dtype_is_named_and_the_loader_refuses_with_the_same_words(copy, capsys):
    model, _ = copy
    key = _rewrite_shard(model, lambda t: t.to(torch.float16))
    rc, out = check(model, None, capsys)
    assert rc == 1 and f"{key}: dtype F16, expected float32 (config torch_dtype)" in out
    with pytest.raises(CheckpointError) as e:
        load_model(model)
    assert str(e.value) in out
    with pytest.raises(WeightsError) as w:
        require_weights(str(model), None)
    assert str(w.value) == problems_text(weights_problems(str(model), None)) and str(e.value) in str(w.value)


def test_a_wrong_lm_shape_and_a_missing_shard_are_named(copy, capsys):
    model, _ = copy
    key = _rewrite_shard(model, lambda t: t[:-1].clone())
    rc, out = check(model, None, capsys)
    assert rc == 1 and f"{key}: shape [63], expected [64]" in out
    index = json.loads((model / "model.safetensors.index.json").read_text())
    other = sorted(set(index["weight_map"].values()))[0]
    (model / other).unlink()
    rc, out = check(model, None, capsys)
    assert rc == 1 and f"shard file {other} does not exist" in out


@pytest.mark.parametrize("key,value,words", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_scaling {'type': 'yarn', 'factor': 4.0} unsupported"),
    ("tie_word_embeddings", True, "tie_word_embeddings True unsupported (expected False)"),
    ("modality_pad_token_id", 151666, "modality_pad_token_id 151666 unsupported (expected 151667)"),
    ("layer_types", ["sliding_attention"] * 4, "layer_types ['sliding_attention'] unsupported"),
])
def test_config_values_the_model_does_not_implement_are_refused(copy, capsys, key, value, words):
    model, _ = copy
    raw = json.loads((model / "config.json").read_text())
    raw[key] = value
    (model / "config.json").write_text(json.dumps(raw))
    rc, out = check(model, None, capsys)
    assert rc == 1 and words in out
    with pytest.raises(Exception, match="unsupported"):
        load_model(model)


def test_unknown_config_keys_are_named_not_refused(copy, capsys):
    model, _ = copy
    raw = json.loads((model / "config.json").read_text())
    raw["some_new_setting"] = 3
    (model / "config.json").write_text(json.dumps(raw))
    rc, out = check(model, None, capsys)
    assert rc == 0 and "keys not read ['some_new_setting']" in out


def test_a_missing_or_foreign_tokenizer_is_named(copy, capsys):
    model, _ = copy
    tok = json.loads((model / "tokenizer.json").read_text())  # another model's: no <|im_end|>
    for added in tok["added_tokens"]:
        if added["content"] == "<|im_end|>":
            added["content"] = "<|eot|>"
    tok["model"]["vocab"]["<|eot|>"] = tok["model"]["vocab"].pop("<|im_end|>")
    (model / "tokenizer.json").write_text(json.dumps(tok))
    rc, out = check(model, None, capsys)
    assert rc == 1 and "<|im_end|> has id None, expected 151645" in out
    (model / "tokenizer.json").unlink()
    rc, out = check(model, None, capsys)
    assert rc == 1 and "tokenizer.json: missing" in out


def test_codec_decoder_files_are_checked_and_the_loader_refuses_with_the_same_words(copy, capsys):
    _, codec = copy
    hift = torch.load(codec / "flow" / "hift.pt", weights_only=True)
    key = "conv_post.bias"
    hift[key] = hift[key][:-1].clone()
    torch.save(hift, codec / "flow" / "hift.pt")
    flow = torch.load(codec / "flow" / "flow-chunk-5.pt", weights_only=True)
    fkey = next(iter(flow))
    flow[fkey] = flow[fkey].double()
    torch.save(flow, codec / "flow" / "flow-chunk-5.pt")
    rc, out = check(None, codec, capsys)
    assert rc == 1
    assert f"hift.pt: wrong shape 1: ['{key}: " in out
    assert f"flow-chunk-5.pt: wrong dtype 1: ['{fkey}: torch.float64 != expected torch.float32']" in out
    with pytest.raises(CodecCheckpointError) as e:
        CodecDecoder.load(str(codec), vocoder="hift")
    assert str(e.value) in out


@pytest.mark.parametrize("name", ["flow/flow.pt", "flow/flow-chunk-5.pt", "flow/hift.pt", "flow/campplus.onnx",
                                  "model.safetensors"])
def test_each_missing_codec_file_is_named(copy, capsys, name):
    _, codec = copy
    (codec / name).unlink()
    rc, out = check(None, codec, capsys)
    assert rc == 1 and str(codec / name) in out


def test_encoder_tensors_are_checked_and_the_loader_refuses_with_the_same_words(copy, capsys):
    _, codec = copy
    tensors = load_file(str(codec / "model.safetensors"))
    del tensors["encoder.conv1.bias"]
    tensors["encoder.conv2.bias"] = tensors["encoder.conv2.bias"].to(torch.bfloat16)
    save_file(tensors, str(codec / "model.safetensors"))
    rc, out = check(None, codec, capsys)
    assert rc == 1 and "missing 1: ['encoder.conv1.bias']" in out
    assert "encoder.conv2.bias: BF16 != expected F32" in out
    with pytest.raises(Exception) as e:
        SpeechEncoder.load(str(codec))
    assert all(part in out for part in str(e.value).split("; "))


def test_a_campplus_with_another_interface_is_named(copy, capsys, tmp_path):
    from onnx import TensorProto, helper, save  # dev dependency

    _, codec = copy
    graph = helper.make_graph([helper.make_node("Identity", ["input"], ["output"])], "wrong",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, None, 40])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, None, 40])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8),
         str(codec / "flow" / "campplus.onnx"))
    rc, out = check(None, codec, capsys)
    assert rc == 1 and "expected one [1, frames, 80] fbank" in out and "expected one [1, 192] embedding" in out
