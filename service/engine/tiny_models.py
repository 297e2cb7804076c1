"""Tiny random-weight models with their own tokenizer, made locally (no download).

Tests and the demo use them in place of a hub model; both vLLM and transformers load
them through their ordinary loading code. The same seed gives the same weights.

Kinds: a dense Llama; three hybrids, Nemotron-H (Mamba2 + attention), Qwen3-Next
(GatedDeltaNet linear attention + full attention, mixture of experts; vLLM runs its CPU
GatedDeltaNet in bfloat16 only) and Falcon-H1 (Mamba2 and attention in parallel in each
layer); and Gemma 3 (sliding-window and global attention). docs/models.md says what each
was tested for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

Kind = Literal["llama", "nemotron-h", "qwen3-next", "falcon-h1", "gemma3"]
KINDS: tuple[Kind, ...] = ("llama", "nemotron-h", "qwen3-next", "falcon-h1", "gemma3")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them.",
    "Hidden states are the inputs of each decoder layer of a transformer.",
    "Mamba layers keep a recurrent state; attention layers keep a key-value cache.",
    "0123456789 !?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~`",
]
# A plain chat template so `messages` prompts work on the demo model too.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]


def make_tokenizer(out: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on a few sentences and save it to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",  # noqa: S106 - token names, not passwords
        eos_token="</s>",  # noqa: S106
        pad_token="<pad>",  # noqa: S106
    )
    wrapped.chat_template = _CHAT_TEMPLATE
    wrapped.save_pretrained(out)


def _config(
    kind: Kind, vocab_size: int, max_len: int, hidden_size: int = 128, num_layers: int = 4
) -> object:
    heads = max(4, hidden_size // 64)  # head dim 32 for the tiny model, 64 above 256
    common: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size if hidden_size == 128 else 3 * hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "max_position_embeddings": max_len,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=num_layers, **common)
    return _FAMILIES[kind](common)


def _nemotron_h(common: dict[str, object]) -> object:
    from transformers import NemotronHConfig

    # Mamba2, MLP, Mamba2, attention: the pattern checked on CPU (docs/cpu.md).
    return NemotronHConfig(
        layers_block_type=["mamba", "mlp", "mamba", "attention"],
        head_dim=32,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=64,
        expand=1,
        conv_kernel=4,
        **common,
    )


def _qwen3_next(common: dict[str, object]) -> object:
    from transformers import Qwen3NextConfig

    # Hidden 256 and head dims of 64: vLLM's CPU GatedDeltaNet rejected head dim 32.
    # Every layer a mixture of 4 experts (top 2): vLLM's class needs at least one.
    return Qwen3NextConfig(
        **{**common, "hidden_size": 256, "intermediate_size": 512},
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
    )


def _falcon_h1(common: dict[str, object]) -> object:
    from transformers import FalconH1Config

    # Attention and Mamba2 side by side in each layer; 8 Mamba heads of 16.
    return FalconH1Config(
        **common,
        num_hidden_layers=4,
        head_dim=32,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=64,
        mamba_expand=1,
    )


def _gemma3(common: dict[str, object]) -> object:
    from transformers import Gemma3TextConfig

    # A 16-token window on three of four layers: prompts of the tests run past it.
    return Gemma3TextConfig(
        **common,
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )


_FAMILIES = {
    "nemotron-h": _nemotron_h,
    "qwen3-next": _qwen3_next,
    "falcon-h1": _falcon_h1,
    "gemma3": _gemma3,
}


def tiny_config(kind: Kind, *, max_len: int = 2048) -> Any:
    """The transformers config of the tiny ``kind`` model, its architecture named, as
    ``make_model`` writes it: for checks that read a model's config and no weight."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config: Any = _config(kind, 512, max_len)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


def make_model(
    out: Path,
    kind: Kind = "llama",
    *,
    seed: int = 0,
    max_len: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 4,
) -> Path:
    """Write a deterministic random-weight ``kind`` model and its tokenizer to ``out``.

    Returns ``out``. Weights are float32 safetensors; vLLM casts to the served dtype.
    ``hidden_size`` and ``num_layers`` size a Llama for benchmarks (hidden 1024 and 8
    layers: about 100M parameters); the other kinds keep their tested shapes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; choose from {', '.join(KINDS)}")
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = 512
    make_tokenizer(out, vocab_size)
    torch.manual_seed(seed)
    config = (
        _config(kind, vocab_size, max_len, hidden_size, num_layers)
        if kind == "llama"
        else _config(kind, vocab_size, max_len)
    )
    model = AutoModelForCausalLM.from_config(config)
    if kind == "llama":
        with torch.no_grad():
            # Larger than the default init so layers differ visibly from one another.
            # The other kinds keep their own init: larger weights make the Mamba
            # recurrence amplify float32 rounding (kernel vs reference) past 1e-5.
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.08)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out
