"""``python -m service.engine.vllm_patches``: print docs/vllm-coupling.md."""

from service.engine.vllm_patches.doc import render

print(render(), end="")
