"""EAGLE-3's aux-hidden-state interface for vLLM model classes that lack it.

vLLM's ``extract_hidden_states`` asks the served model for the hidden states of the
layer ids it is given (``SupportsEagle3.set_aux_hidden_state_layers``) and expects its
forward to return ``(hidden_states, [one tensor per id])``. vLLM's own classes that
implement it (Llama, Qwen3-Next, Nemotron-H, ...) add, for id ``i``, the input of
decoder layer ``i`` and, for id ``L``, the last layer's output before the final norm,
as ``hidden_states + residual`` where the layers pass the residual beside the states
(``EagleModelMixin._maybe_add_hidden_state``). Falcon-H1 and Gemma 3 have no such
interface in vLLM 0.32-0.33, so the engine refuses them ("Model does not support EAGLE3
interface").

:class:`AuxHiddenStates` adds the interface to a vLLM class without changing it: a
subclass captures the same tensors with forward hooks on the decoder layers (a pre-hook
on layer ``i`` for id ``i``, a hook on the last layer for id ``L``), only for the ids
set, and returns them beside the model's output. ``service.engine.families.register``
registers each with vLLM's public ``ModelRegistry`` in place of vLLM's class, by name:
this module (and vLLM's model modules it imports) loads only where such a model is
built. Hooks run in Python, so these models run eagerly (``service.engine.builder``
sets ``enforce_eager``): a compiled or CUDA-graph-replayed forward would not call them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from vllm.model_executor.models.falcon_h1 import FalconH1ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.interfaces import SupportsEagle3
from vllm.sequence import IntermediateTensors


class AuxHiddenStates:
    """Mixed in before a vLLM ``*ForCausalLM`` class whose decoder layers are
    ``self.model.layers``: EAGLE-3's aux hidden states captured by hooks. The class
    lists ``SupportsEagle3`` last, as vLLM's own models do: a Protocol earlier in the
    bases would put its ``__init__`` before the model's."""

    _hsx_layers: tuple[int, ...] = ()
    _hsx_hooks: list[Any]
    _hsx_captured: dict[int, torch.Tensor]

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Capture the states of ``layers`` (ids 0..L) from the next forward on."""
        for hook in getattr(self, "_hsx_hooks", []):
            hook.remove()
        self._hsx_layers = tuple(sorted(set(layers)))
        self._hsx_hooks, self._hsx_captured = [], {}
        decoder = self.model.layers  # type: ignore[attr-defined]
        for layer_id in self._hsx_layers:
            if layer_id < len(decoder):
                hook = decoder[layer_id].register_forward_pre_hook(
                    _keep_input(self._hsx_captured, layer_id), with_kwargs=True
                )
            else:
                hook = decoder[-1].register_forward_hook(_keep_output(self._hsx_captured, layer_id))
            self._hsx_hooks.append(hook)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """EAGLE-3's usual choice, as vLLM's own models make it: [2, L//2, L-3]."""
        num_layers = len(self.model.layers)  # type: ignore[attr-defined]
        return (2, num_layers // 2, num_layers - 3)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; with ids set, ``(hidden_states, [states per id])``."""
        output = super().forward(*args, **kwargs)  # type: ignore[misc]
        if not self._hsx_layers or isinstance(output, IntermediateTensors):
            return output
        captured = [self._hsx_captured.pop(layer_id) for layer_id in self._hsx_layers]
        return output, captured


def _keep_input(into: dict[int, torch.Tensor], layer_id: int) -> Any:
    """A forward pre-hook keeping a decoder layer's input (``hidden_states`` plus the
    ``residual`` beside it, where the family passes one)."""
    signatures: dict[type, inspect.Signature] = {}

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        signature = signatures.setdefault(type(module), inspect.signature(module.forward))
        given = signature.bind_partial(*args, **kwargs).arguments
        into[layer_id] = _stream(given["hidden_states"], given.get("residual"))

    return hook


def _keep_output(into: dict[int, torch.Tensor], layer_id: int) -> Any:
    """A forward hook keeping the last decoder layer's output, before the final norm."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        states, residual = output if isinstance(output, tuple) else (output, None)
        into[layer_id] = _stream(states, residual)

    return hook


def _stream(states: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream: ``states + residual`` (a new tensor), else a copy of
    ``states``: layers that take no residual keep their input as one, and a later
    fused add-and-norm may write into it in place."""
    return states + residual if residual is not None else states.clone()


class HsxFalconH1ForCausalLM(AuxHiddenStates, FalconH1ForCausalLM, SupportsEagle3):
    """vLLM's Falcon-H1 (Mamba2 and attention side by side) with aux hidden states."""


class HsxGemma3ForCausalLM(AuxHiddenStates, Gemma3ForCausalLM, SupportsEagle3):
    """vLLM's Gemma 3 (sliding-window and global attention) with aux hidden states."""
