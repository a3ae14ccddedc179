"""dlm_client's gRPC request: the contract tensors as raw contents, as tritonclient sends them."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from dlm_client import build_inputs
from dlm_client.grpc_stream import infer_request

from dlm_protocol import tensors


def test_request_carries_each_tensor_with_its_contract_datatype_and_bytes() -> None:
    messages = [{"role": "user", "content": "héllo"}]
    arrays = build_inputs(messages=messages, stream=True, sampling={"max_tokens": 8})
    request = infer_request(
        "tiny-dlm", arrays, tensors.OUTPUT_NAMES, "r1", {"priority": 2, "tag": "x", "f": True}
    )
    assert (request.model_name, request.id) == ("tiny-dlm", "r1")
    assert [o.name for o in request.outputs] == list(tensors.OUTPUT_NAMES)
    pairs = zip(request.inputs, request.raw_input_contents, strict=True)
    by_name = {t.name: (t, raw) for t, raw in pairs}
    assert set(by_name) == {"messages", "stream", "sampling_parameters"}
    spec, raw = by_name["messages"]
    assert (spec.datatype, list(spec.shape)) == ("BYTES", [1, 1])
    (length,) = struct.unpack("<I", raw[:4])  # Triton's BYTES layout: length, then the bytes
    assert json.loads(raw[4 : 4 + length].decode("utf-8")) == messages
    spec, raw = by_name["stream"]
    assert spec.datatype == "BOOL" and np.frombuffer(raw, dtype=bool).tolist() == [True]
    params = request.parameters
    assert params["priority"].int64_param == 2
    assert params["tag"].string_param == "x"
    assert params["f"].bool_param is True


def test_token_ids_go_as_int64() -> None:
    request = infer_request("m", build_inputs(input_ids=[5, 6, 7]), ())
    (spec,), (raw,) = request.inputs, request.raw_input_contents
    assert (spec.name, spec.datatype, list(spec.shape)) == ("input_ids", "INT64", [1, 3])
    assert np.frombuffer(raw, dtype=np.int64).tolist() == [5, 6, 7]


def test_a_parameter_of_another_type_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="parameters: bad:"):
        infer_request("m", build_inputs("x"), (), parameters={"bad": [1]})
