"""Moved to ``service.engine.vllm_patches`` (``forkserver``, ``mp_context``, ``polling``).

The benchmarks and experiments still import these three names from here; new code
imports them from the package.
"""

from service.engine.vllm_patches.mp_context import fork_server_here, use_preloaded_processes
from service.engine.vllm_patches.polling import QueuePolling

__all__ = ["QueuePolling", "fork_server_here", "use_preloaded_processes"]
