"""The connector's scheduler half on its own: which finished requests it holds and saves.

Requests here are plain objects with the attributes vLLM's ``Request`` has; the real
engine runs this code in every engine test.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from service.engine.connector.common import FailedSave, PendingSave
from service.engine.connector.scheduler import HsxConnectorScheduler, Served, plan_save
from service.engine.wire import REQUEST_ARG, RequestParams, WriteFailure

KEY = "hsx/team/2026/01/01/" + "a" * 32 + ".safetensors"


def request(extra_args: Any, status: Any = RequestStatus.FINISHED_LENGTH_CAPPED) -> Any:
    return SimpleNamespace(
        request_id="r1",
        status=status,
        sampling_params=SimpleNamespace(extra_args=extra_args),
        prompt_token_ids=[5, 6, 7],
        all_token_ids=[5, 6, 7, 8, 9],
    )


def scheduler() -> HsxConnectorScheduler:
    return HsxConnectorScheduler(group=1, model_name="m", layer_ids=[1, 2], dtype="float32")


def test_ours_is_held_and_saved_with_the_hidden_state_groups_blocks() -> None:
    half = scheduler()
    params = RequestParams(key=KEY, include_output_tokens=True, metadata={"run": "r", "model": "x"})
    held, _ = half.request_finished_all_groups(request(params.to_extra_args()), ([1], [7, 8]))
    assert held
    assert half.has_pending_block_frees()
    (save,) = half.build_connector_meta().saves
    assert isinstance(save, PendingSave)
    assert (save.key, save.block_ids, save.token_ids) == (KEY, (7, 8), (5, 6, 7, 8))
    assert save.metadata["model"] == "m"  # ours win over the caller's
    assert save.metadata["run"] == "r"
    assert json.loads(save.metadata["layer_ids"]) == [1, 2]
    assert half.build_connector_meta().saves == []  # handed over once
    half.update_connector_output(SimpleNamespace(finished_sending={"r1"}))  # type: ignore[arg-type]
    assert not half.has_pending_block_frees()


def test_others_aborted_and_unscheduled_are_not_held() -> None:
    half = scheduler()
    ours = RequestParams(key=KEY).to_extra_args()
    assert half.request_finished_all_groups(request(None), ([1], [2])) == (False, None)
    aborted = request(ours, RequestStatus.FINISHED_ABORTED)
    assert half.request_finished_all_groups(aborted, ([1], [2])) == (False, None)
    assert half.request_finished_all_groups(request(ours), ([1], [])) == (False, None)
    assert half.request_finished_all_groups(request(ours), ([1],)) == (False, None)
    assert half.build_connector_meta().saves == []


def test_malformed_parameters_fail_the_prompt_not_the_engine() -> None:
    half = scheduler()
    bad = {REQUEST_ARG: {"key": KEY, "include_output_tokens": "perhaps"}}
    held, _ = half.request_finished_all_groups(request(bad), ([1], [3]))
    assert held  # its blocks come back once the worker reported the failure
    (save,) = half.build_connector_meta().saves
    assert isinstance(save, FailedSave)
    assert save.key == KEY
    assert "include_output_tokens" in save.failure.message


def test_loss_spans_cover_the_stored_tokens() -> None:
    half = scheduler()
    prompt_only = RequestParams(key=KEY, loss_spans=((1, 3),))
    with_output = RequestParams(key=KEY, include_output_tokens=True, loss_spans=((0, 1),))
    no_mask = RequestParams(key=KEY)
    for params in (prompt_only, with_output, no_mask):
        half.request_finished_all_groups(request(params.to_extra_args()), ([1], [2]))
    first, second, third = half.build_connector_meta().saves
    assert isinstance(first, PendingSave)  # none failed
    assert isinstance(second, PendingSave)
    assert isinstance(third, PendingSave)
    assert first.loss_spans == ((1, 3),)
    # The generated token with a state (8; 9 has none) is supervised too.
    assert (second.token_ids, second.loss_spans) == ((5, 6, 7, 8), ((0, 1), (3, 4)))
    assert third.loss_spans is None


def test_loss_spans_past_the_prompt_fail_the_prompt() -> None:
    half = scheduler()
    params = RequestParams(key=KEY, loss_spans=((2, 4),))  # the prompt has 3 tokens
    held, _ = half.request_finished_all_groups(request(params.to_extra_args()), ([1], [3]))
    assert held
    (save,) = half.build_connector_meta().saves
    assert isinstance(save, FailedSave)
    assert "past the prompt's 3 tokens" in save.failure.message


def test_a_mask_left_with_no_supervised_token_fails_the_prompt_as_invalid() -> None:
    # The API allows a prompt without supervised tokens when generated ones would count;
    # if generation stopped after one token (which never has states), the object would
    # carry an all-zero mask: the save fails instead, as the prompt's error.
    half = scheduler()
    params = RequestParams(key=KEY, include_output_tokens=True, loss_spans=())
    stopped = request(params.to_extra_args())
    stopped.all_token_ids = [5, 6, 7, 8]  # one generated token: the stored ids are the prompt
    assert half.request_finished_all_groups(stopped, ([1], [7]))[0]
    (save,) = half.build_connector_meta().saves
    assert isinstance(save, FailedSave)
    assert save.failure.type == "invalid_request"
    assert "no token is supervised" in save.failure.message
    assert "stopped after 1 token(s)" in save.failure.message
    # Two generated tokens: the first has states and is supervised, so it is stored.
    params = RequestParams(key=KEY, include_output_tokens=True, loss_spans=())
    assert half.request_finished_all_groups(request(params.to_extra_args()), ([1], [7]))[0]
    (save,) = half.build_connector_meta().saves
    assert isinstance(save, PendingSave)  # not failed
    assert save.loss_spans == ((3, 4),)


# ==============================
# plan_save: the save of a finished request, from its arguments alone
# ==============================

SERVED = Served(model="m", layer_ids=(1, 2, 4), dtype="float32")


def test_a_plan_stores_every_served_layer_by_default() -> None:
    params = RequestParams(key=KEY, codec="fp8", metadata={"run": "r"})
    save = plan_save(request(None), [7, 8], params, SERVED)
    assert isinstance(save, PendingSave)
    assert (save.req_id, save.key, save.codec) == ("r1", KEY, "fp8")
    assert (save.token_ids, save.block_ids) == ((5, 6, 7), (7, 8))  # the prompt's
    assert (save.layer_ids, save.layer_index, save.loss_spans) == ((1, 2, 4), None, None)
    assert dict(save.metadata) == {
        "format": "hsx.hidden_states",
        "format_version": "1",
        "model": "m",
        "layer_ids": "[1, 2, 4]",
        "dtype": "float32",
        "run": "r",
    }


def test_a_plan_of_some_layers_stores_them_at_their_positions() -> None:
    params = RequestParams(key=KEY, layers=(1, 4))
    save = plan_save(request(None), [3], params, SERVED)
    assert isinstance(save, PendingSave)
    assert (save.layer_ids, save.layer_index) == ((1, 4), (0, 2))
    assert json.loads(save.metadata["layer_ids"]) == [1, 4]


def test_a_callers_metadata_never_overrides_ours() -> None:
    mine = {"model": "x", "dtype": "int8", "layer_ids": "[9]", "hsx.codec": "raw", "split": "a"}
    save = plan_save(request(None), [3], RequestParams(key=KEY, metadata=mine), SERVED)
    assert isinstance(save, PendingSave)
    assert (save.metadata["model"], save.metadata["dtype"]) == ("m", "float32")
    assert save.metadata["layer_ids"] == "[1, 2, 4]"
    assert "hsx.codec" not in save.metadata  # the codec's key is the writer's to set
    assert save.metadata["split"] == "a"


def test_a_plan_that_cannot_be_kept_is_a_failure() -> None:
    unserved = plan_save(request(None), [3], RequestParams(key=KEY, layers=(3,)), SERVED)
    assert unserved == WriteFailure(
        type="internal_error", message="layers [3] are not served (served: [1, 2, 4])"
    )
    stopped = request(None)
    stopped.all_token_ids = [5, 6, 7, 8]
    params = RequestParams(key=KEY, include_output_tokens=True, loss_spans=())
    nothing = plan_save(stopped, [3], params, SERVED)
    assert isinstance(nothing, WriteFailure)
    assert nothing.type == "invalid_request"


def test_a_plan_is_a_pure_frozen_value_that_crosses_processes() -> None:
    finished = request(None)
    params = RequestParams(key=KEY, include_output_tokens=True, loss_spans=((0, 2),))
    save = plan_save(finished, [7, 8], params, SERVED)
    assert save == plan_save(finished, [7, 8], params, SERVED)
    assert (finished.prompt_token_ids, finished.all_token_ids) == ([5, 6, 7], [5, 6, 7, 8, 9])
    assert isinstance(save, PendingSave)
    assert save.loss_spans == ((0, 2), (3, 4))
    assert pickle.loads(pickle.dumps(save)) == save  # scheduler -> worker processes
    with pytest.raises(dataclasses.FrozenInstanceError):
        save.key = "other"  # type: ignore[misc]
