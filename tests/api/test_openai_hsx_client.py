"""``service.client``: HsxClient and the hs_connectors-compatible HsxTransfer, with keys."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from service.client import HsxClient, HsxError, HsxTransfer
from tests.api.conftest import KEY_A, KEY_B, ServerThread
from tests.api.openai_helpers import served_name
from tests.engine.conftest import random_prompts

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_client_extract_get_delete(local_url: str, local_engine: ServerThread) -> None:
    ids = random_prompts([9], seed=61)[0]
    with HsxClient(local_url, KEY_A) as client:
        answer = client.extract([ids, "The quick brown fox"], metadata={"run": "client"})
        keys = [o["key"] for o in answer["objects"]]
        tensors = client.get(keys[0])
        assert tensors["token_ids"].tolist() == ids
        assert tensors["hidden_states"].shape == (9, len(local_engine.extractor.layer_ids), 128)
        assert client.get_bytes(keys[1]) == (local_engine.root / keys[1]).read_bytes()  # type: ignore[attr-defined]
        client.delete(keys[0])
        with pytest.raises(HsxError) as missing:
            client.get(keys[0])
        assert missing.value.status == 404
        assert missing.value.type == "not_found"
    with HsxClient(local_url, KEY_B) as other, pytest.raises(HsxError) as foreign:
        other.delete(keys[1])  # another namespace's object does not exist for team-b
    assert foreign.value.status == 404
    with HsxClient(local_url) as anonymous, pytest.raises(HsxError) as denied:
        anonymous.extract(["x"])
    assert denied.value.status == 401


def test_transfer_reads_and_deletes_what_a_completion_names(
    local_url: str, local_engine: ServerThread
) -> None:
    from hs_connectors import HiddenStatesTransfer

    transfer: Any = HsxTransfer(local_url, KEY_A)
    # Every method speculators calls on an hs_connectors transfer is there.
    assert HiddenStatesTransfer.__abstractmethods__ <= set(dir(transfer))
    assert transfer.get_cached(0) is None  # no cache directory: generate every sample
    ids = random_prompts([21], seed=62)[0]
    with openai.OpenAI(base_url=f"{local_url}/v1", api_key=KEY_A, max_retries=0) as oai:
        done = oai.completions.create(model=served_name(local_engine), prompt=ids, max_tokens=1)
    params = done.model_extra["kv_transfer_params"]
    transfer.setup()
    tensors = transfer.get_generated(params)
    assert tensors["token_ids"].tolist() == ids
    assert torch.isfinite(tensors["hidden_states"]).all()
    # speculators deletes with the path it read (hidden_states_path): mapped to the key.
    transfer.delete(params["hidden_states_path"])
    assert not (local_engine.root / params["handle"]).exists()  # type: ignore[attr-defined]
