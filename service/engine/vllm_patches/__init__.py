"""Every place where hsx changes vLLM's behaviour (or CPython's, or OpenMP's), fenced.

Each patch module declares a ``PATCH`` (a :class:`~.registry.TouchPoint`): what it
replaces and why, the platforms it applies to, the vLLM versions it was checked on,
whether it is a correctness or a performance patch, and fingerprints of its target
(``fingerprints``). It installs itself only where ``registry.applies`` says so: a
CPU-only patch is never installed on a GPU host, a performance patch whose target
changed is left off with one warning line, and a correctness patch whose target changed
stops ``hsx serve`` at start-up naming it and the vLLM version.

- ``drafts``: the EngineCore skips fetching drafts no request takes (performance, CPU).
- ``mp_context``, ``forkserver``, ``openmp``: vLLM's engine processes start from a fork
  server that imported vLLM once, with vLLM's OpenMP settings applied after the fork
  (performance, CPU).
- ``polling``: vLLM's shared-memory queues sleep between polls (performance, CPU).
- ``cpu_mamba``: a correct CPU Mamba2 conv update under speculative decoding
  (correctness, CPU).
- ``mamba_padding``: no placeholder drafts on a Mamba model's first prompt chunk, whose
  prefill would store the placeholder's state (correctness, CPU).

``touchpoints`` lists what hsx only reads or builds on; ``catalog`` holds them all;
``version`` the vLLM releases hsx supports. ``python -m service.engine.vllm_patches``
prints docs/vllm-coupling.md, and ``python -m service.engine.vllm_patches.canary
--vllm X.Y.Z`` reads a vLLM release's wheel against every fingerprint (``make
vllm-canary``).
"""
