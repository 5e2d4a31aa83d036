"""A stand-in campplus.onnx with the real file's interface (fbank [1, T, 80] -> x-vector [1, 192]): the maximum over
time of the fbank, then a fixed 80 x 192 matrix. The real CAM++ network is not available here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, save  # (a dev dependency)

WEIGHT = np.random.default_rng(0).standard_normal((80, 192)).astype(np.float32)  # [fbank bins, x-vector]


def write_campplus_stand_in(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["input"], ["m"], axes=[1], keepdims=0),
         helper.make_node("MatMul", ["m", "w"], ["output"])],
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, None, 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        [helper.make_tensor("w", TensorProto.FLOAT, [80, 192], WEIGHT.reshape(-1).tolist())])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))
    return path
