"""What hsx knows of model families before an engine starts: which it can extract from,
and the dtypes this platform runs them in.

vLLM's ``extract_hidden_states`` takes a model's states through EAGLE-3's
aux-hidden-state interface (``SupportsEagle3``); its worker refuses a class without it
once the model is built ("Model does not support EAGLE3 interface"). For the
architectures in ``WRAPPED`` hsx has a subclass that adds the interface
(``service.engine.models``), which :func:`register` puts in vLLM's ``ModelRegistry``;
any other class without it is refused at start-up (:func:`extraction_refusal`). And
some of vLLM's CPU kernels run one dtype only (``CPU_DTYPES``): a family served in
another would start, then fail its first request (:func:`dtype_refusal`).

Importable without vLLM: the functions that need it import it.
"""

from __future__ import annotations

from typing import Protocol

from service.engine.parallel import Refusal


class ModelInfo(Protocol):
    """What a family check reads of ``builder.ModelInfo`` (a protocol, so that the
    builder, which imports this module, is not imported back)."""

    @property
    def architecture(self) -> str: ...
    @property
    def model_type(self) -> str: ...
    @property
    def config_dtype(self) -> str | None: ...


#: Architectures whose vLLM class lacks ``SupportsEagle3`` -> hsx's subclass that adds
#: it (``service.engine.models``).
WRAPPED = {
    "FalconH1ForCausalLM": "HsxFalconH1ForCausalLM",
    "Gemma3ForCausalLM": "HsxGemma3ForCausalLM",
}
#: The families this project's suite runs end to end (docs/models.md).
TESTED = "Llama, Nemotron-H, Qwen3-Next (bfloat16 on CPU), Falcon-H1 and Gemma 3"
#: model_type -> (the dtypes vLLM runs it in on CPU, why). Checked by hand on vLLM 0.32.
CPU_DTYPES = {
    "qwen3_next": (
        ("bfloat16",),
        "vLLM's CPU GatedDeltaNet kernel takes bfloat16 only (it asserts 'CPU GDN "
        "attention requires BF16.' at the first request, after start-up)",
    ),
}


def register() -> None:
    """Register hsx's class for each architecture in ``WRAPPED`` with vLLM's
    ``ModelRegistry``, in place of vLLM's own. By name (``module:class``): the module,
    and vLLM's model modules it imports, load only where vLLM builds such a model.
    Idempotent; a no-op where vLLM is not installed."""
    try:
        from vllm import ModelRegistry
    except ImportError:
        return
    for architecture, cls in WRAPPED.items():
        ModelRegistry.register_model(architecture, f"service.engine.models:{cls}")


def served_dtype(setting: str, config_dtype: str | None, preferred: str) -> str:
    """The dtype vLLM serves a model in: ``setting``, or for ``auto`` the config's, with
    float32 (or none) taken down to the platform's ``preferred`` dtype, as vLLM's
    ``_resolve_auto_dtype`` does (bfloat16 on x86 and Arm CPUs)."""
    if setting != "auto":
        return setting
    if config_dtype in (None, "float32"):
        return preferred
    return config_dtype


def dtype_refusal(info: ModelInfo, setting: str, on_cpu: bool, preferred: str) -> Refusal | None:
    """The refusal of a dtype this platform cannot run ``info``'s family in, or None."""
    if not on_cpu or info.model_type not in CPU_DTYPES:
        return None
    allowed, why = CPU_DTYPES[info.model_type]
    dtype = served_dtype(setting, info.config_dtype, preferred)
    if dtype in allowed:
        return None
    given = f"{dtype}" if setting == dtype else f"{setting!r}, which serves this model in {dtype},"
    return Refusal(
        "engine.dtype",
        f"{info.architecture or info.model_type} cannot run in {given} on CPU: {why}",
        f"set it to {' or '.join(allowed)}",
    )


def extraction_refusal(architecture: str) -> Refusal | None:
    """The refusal of an architecture hsx cannot extract from, or None.

    Refused: a class vLLM has, without ``SupportsEagle3`` and not in ``WRAPPED``.
    Architectures vLLM does not list are left to vLLM (its Transformers backend
    implements the interface, or vLLM says why it cannot serve them).
    """
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    if not architecture or architecture in WRAPPED:
        return None
    if architecture not in ModelRegistry.get_supported_archs():
        return None
    try:
        cls = ModelRegistry.models[architecture].load_model_cls()
    except Exception:  # its module does not import here (Qwen3.5 on CPU): vLLM says why
        return None
    if supports_eagle3(cls):
        return None
    return Refusal(
        "engine.model",
        f"hsx cannot extract hidden states from {architecture}: vLLM's class has no "
        "EAGLE-3 aux-hidden-state interface (SupportsEagle3), which extract_hidden_states "
        "reads them through, and hsx has no wrapper for it",
        f"serve a model of a family that works: {TESTED} were run; any architecture "
        "whose vLLM class implements SupportsEagle3, or one of hsx's wrapped ones "
        f"({', '.join(WRAPPED)}) (docs/models.md)",
    )
