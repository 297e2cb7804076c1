"""Which shard a ``hsx dataset run`` process takes: its flags, else its launcher's environment.

Flags, in speculators' spelling or hsx's: ``--shard I/N``, or ``--world-size N --rank I``
(the same shard). Without them the launcher says: a Slurm job array
(``SLURM_ARRAY_TASK_ID`` minus ``SLURM_ARRAY_TASK_MIN``, of ``SLURM_ARRAY_TASK_COUNT``),
or a Kubernetes Indexed Job (``JOB_COMPLETION_INDEX``, of ``--world-size`` or
``WORLD_SIZE``: Kubernetes does not export the completions count). Explicit
flags win over the environment; contradictions and bad values are a
:class:`LaunchError` (a ValueError: one line, exit 2) naming the flag or variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SLURM_ID = "SLURM_ARRAY_TASK_ID"
SLURM_COUNT = "SLURM_ARRAY_TASK_COUNT"
SLURM_MIN = "SLURM_ARRAY_TASK_MIN"
SLURM_MAX = "SLURM_ARRAY_TASK_MAX"
SLURM_STEP = "SLURM_ARRAY_TASK_STEP"
K8S_INDEX = "JOB_COMPLETION_INDEX"
#: The shard count of a Kubernetes Indexed Job (its ``completions``), set by the user in
#: the pod template (torch's name, as ``--world-size`` is speculators'; ``HSX_`` names
#: are the server's settings).
SHARDS_ENV = "WORLD_SIZE"


class LaunchError(ValueError):
    """The shard flags or the launcher's environment contradict themselves."""


@dataclass(frozen=True)
class ShardChoice:
    """The shard a process takes (None: every row) and what chose it."""

    shard: tuple[int, int] | None
    source: str | None = None

    def describe(self) -> str | None:
        """``shard 3/8 from SLURM_ARRAY_TASK_ID``, or None without a shard."""
        if self.shard is None:
            return None
        return f"shard {self.shard[0]}/{self.shard[1]} from {self.source}"


def resolve_shard(
    shard: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ShardChoice:
    """The shard from ``--shard``, ``--world-size``/``--rank`` or the environment."""
    env = {} if environ is None else environ
    if shard is not None:
        if rank is not None:
            raise LaunchError(
                "--shard and --rank both given; use one: --shard I/N or --world-size N --rank I"
            )
        index, count = parse_shard(shard)
        if world_size is not None and world_size != count:
            raise LaunchError(f"--shard {shard} and --world-size {world_size} disagree")
        # Its range is RunOptions' check ("shard 4/4: need 0 <= I < N"), as before.
        return ShardChoice((index, count), "--shard")
    if rank is not None:
        if world_size is None:
            raise LaunchError("--rank needs --world-size (--world-size N --rank I)")
        where = f"--world-size {world_size} --rank {rank}"
        return ShardChoice(_checked(rank, world_size, where), "--world-size/--rank")
    if world_size is not None and world_size < 1:
        raise LaunchError(f"--world-size {world_size}: need N >= 1")
    return _from_environment(env, world_size)


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` as a pair; LaunchError otherwise."""
    index, sep, count = text.partition("/")
    try:
        if not sep:
            raise ValueError
        return int(index), int(count)
    except ValueError:
        raise LaunchError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None


def _checked(index: int, count: int, where: str) -> tuple[int, int]:
    if count < 1 or not 0 <= index < count:
        raise LaunchError(f"{where}: need 0 <= I < N (shard {index} of {count})")
    return index, count


def _from_environment(env: Mapping[str, str], world_size: int | None) -> ShardChoice:
    slurm, k8s = env.get(SLURM_ID), env.get(K8S_INDEX)
    if slurm is not None and k8s is not None:
        raise LaunchError(
            f"both {SLURM_ID} and {K8S_INDEX} are set; pass --shard I/N to choose the shard"
        )
    if slurm is not None:
        return _slurm(env, world_size)
    if k8s is not None:
        return _kubernetes(env, world_size)
    if world_size is not None:
        raise LaunchError(
            f"--world-size {world_size} without --rank, {SLURM_ID} or {K8S_INDEX}: "
            "which shard is this process?"
        )
    return ShardChoice(None)


def _slurm(env: Mapping[str, str], world_size: int | None) -> ShardChoice:
    task = _integer(env, SLURM_ID)
    first = _integer(env, SLURM_MIN) if SLURM_MIN in env else 0
    if SLURM_COUNT in env:
        count = _integer(env, SLURM_COUNT)
        if world_size is not None and world_size != count:
            raise LaunchError(f"--world-size {world_size} and {SLURM_COUNT}={count} disagree")
    elif world_size is not None:
        count = world_size
    else:
        raise LaunchError(f"{SLURM_ID} is set but {SLURM_COUNT} is not; pass --world-size N")
    if SLURM_STEP in env and _integer(env, SLURM_STEP) != 1:
        raise LaunchError(
            f"{SLURM_STEP}={env[SLURM_STEP]}: the array must be contiguous "
            f"(--array=0-{count - 1}), or pass --shard I/N"
        )
    if SLURM_MAX in env and _integer(env, SLURM_MAX) - first + 1 != count:
        raise LaunchError(
            f"{SLURM_MIN}={first}, {SLURM_MAX}={env[SLURM_MAX]} and {SLURM_COUNT}={count}: "
            f"the array must be contiguous (--array=0-{count - 1}), or pass --shard I/N"
        )
    index = task - first
    if count < 1 or not 0 <= index < count:
        raise LaunchError(
            f"{SLURM_ID}={task} (minus {SLURM_MIN}={first}) is not a shard of "
            f"{SLURM_COUNT}={count}: need 0 <= ID - MIN < COUNT"
        )
    return ShardChoice((index, count), SLURM_ID)


def _kubernetes(env: Mapping[str, str], world_size: int | None) -> ShardChoice:
    index = _integer(env, K8S_INDEX)
    if SHARDS_ENV in env:
        count = _integer(env, SHARDS_ENV)
        if world_size is not None and world_size != count:
            raise LaunchError(f"--world-size {world_size} and {SHARDS_ENV}={count} disagree")
        named = SHARDS_ENV
    elif world_size is not None:
        count, named = world_size, "--world-size"
    else:
        raise LaunchError(
            f"{K8S_INDEX}={index} is set but the shard count is not (Kubernetes does not "
            f"export completions): pass --world-size N or set {SHARDS_ENV}"
        )
    if count < 1 or not 0 <= index < count:
        raise LaunchError(f"{K8S_INDEX}={index} is not a shard of {named} {count}")
    return ShardChoice((index, count), K8S_INDEX)


def _integer(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None
