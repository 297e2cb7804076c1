"""Engine construction from settings, checked without starting an engine."""

from __future__ import annotations

from typing import Any

import pytest

from service.config import Settings
from service.engine.builder import (
    default_layer_ids,
    engine_args,
    read_model_info,
    resolve_layer_ids,
)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [(32, [2, 16, 29, 32]), (36, [2, 18, 33, 36]), (4, [1, 2, 4]), (2, [0, 1, 2])],
)
def test_default_layer_ids_follow_eagle3(layers: int, expected: list[int]) -> None:
    assert default_layer_ids(layers) == expected


def test_out_of_range_layer_ids_say_what_the_model_allows() -> None:
    with pytest.raises(ValueError, match=r"\[5, 9\].*4 decoder layers.*0\.\.4"):
        resolve_layer_ids([0, 5, 9], 4)
    assert resolve_layer_ids([4, 0], 4) == [4, 0]


def test_model_info_of_dense_and_hybrid(model_dir: Any) -> None:
    dense = read_model_info(str(model_dir("llama")))
    hybrid = read_model_info(str(model_dir("nemotron-h")))
    assert (dense.num_layers, dense.hidden_size, dense.hybrid) == (4, 128, False)
    assert (hybrid.num_layers, hybrid.hidden_size, hybrid.hybrid) == (4, 128, True)


def test_engine_args_wire_our_connector_and_defaults(model_dir: Any) -> None:
    model = str(model_dir("nemotron-h"))
    settings = Settings(engine={"model": model, "extra_args": {"enforce_eager": True}})
    info = read_model_info(model)
    args = engine_args(settings, info, [1, 2, 4], "ipc:///tmp/x.sock")
    assert args.speculative_config["method"] == "extract_hidden_states"
    hf = args.speculative_config["draft_model_config"]["hf_config"]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    transfer = args.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_connector_module_path) == (
        "HsxConnector",
        "service.engine.connector",
    )
    assert transfer.kv_connector_extra_config["completion_address"] == "ipc:///tmp/x.sock"
    assert args.enable_prefix_caching is False  # hybrid on CPU: no Triton align path
    assert args.enforce_eager is True
    dense = read_model_info(str(model_dir("llama")))
    assert engine_args(settings, dense, [1], "ipc:///x").enable_prefix_caching is True
