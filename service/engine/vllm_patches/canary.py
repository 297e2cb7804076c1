"""The vLLM canary: a vLLM release's source read against every fingerprint hsx declares.

``python -m service.engine.vllm_patches.canary --vllm 0.33.0`` (``make vllm-canary``)
fetches that release's wheel without its dependencies (``pip download --no-deps``) into
``var/vllm-wheels/`` once, unpacks its Python source into ``var/vllm-src/`` once, and
reads it: nothing of it is imported, so a CUDA release is checked on any machine, and
later runs work offline. Every vLLM fingerprint of every touch point is observed there
(the patches' targets, the connector base's hooks and hsx's overrides of them, every
name hsx imports from vLLM, the start-up messages hsx matches) and compared with the
value declared for that version, or, for a version not declared, with the values known.

It prints each fingerprint whose value differs from the oldest checked release, and
exits 1 when one differs from what is declared (a new release: review the code, then
declare its value in the touch point; docs/vllm-coupling.md says how). ``--installed``
reads the vLLM installed here instead of a wheel.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from service.engine.vllm_patches.catalog import TOUCH_POINTS
from service.engine.vllm_patches.doc import change
from service.engine.vllm_patches.fingerprints import Fingerprint
from service.engine.vllm_patches.registry import TouchPoint, installed_tree
from service.engine.vllm_patches.sources import HSX_ROOT, SourceTree
from service.vllm_version import installed_vllm

WHEELS = HSX_ROOT / "var" / "vllm-wheels"
SOURCES = HSX_ROOT / "var" / "vllm-src"


class CanaryError(Exception):
    """The release's wheel could not be fetched or read."""


def fetch_wheel(version: str, cache: Path = WHEELS) -> Path:
    """vLLM ``version``'s wheel in ``cache``, downloaded there first if absent (into a
    directory of its own, then moved: a concurrent run never reads half a wheel)."""
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps"]
        done = subprocess.run(  # noqa: S603 - our own interpreter's pip, fixed arguments
            [*command, "-d", scratch, "--quiet"], capture_output=True, text=True, check=False
        )
        fetched = sorted(Path(scratch).glob(f"vllm-{version}-*.whl"))
        if done.returncode != 0 or not fetched:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise CanaryError(f"pip download vllm=={version} failed: {last}")
        os.replace(fetched[-1], cache / fetched[-1].name)
    return cache / fetched[-1].name


def unpack(wheel: Path, version: str, into: Path = SOURCES) -> SourceTree:
    """The wheel's ``vllm`` package source, unpacked under ``into/version`` once (into a
    directory of its own, then renamed: a concurrent run never reads half of it)."""
    target = into / version
    if not target.exists():
        into.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=into, prefix=f".{version}-"))
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            archive.extractall(scratch, names)
        try:
            scratch.rename(target)
        except OSError:  # another run unpacked it first
            shutil.rmtree(scratch, ignore_errors=True)
    return SourceTree(target / "vllm", "vllm")


def requirements_of(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's metadata."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return metadata.get_all("Requires-Dist") or []


@dataclass(frozen=True)
class Finding:
    """One fingerprint observed in a release."""

    point: TouchPoint
    fingerprint: Fingerprint
    observed: str
    #: The value declared for this release (None: the release is not declared).
    declared: str | None

    @property
    def baseline(self) -> tuple[str, str]:
        """The oldest release checked and its value."""
        return next(iter(self.fingerprint.accepted.items()))

    @property
    def expected(self) -> bool:
        """Declared for this release, or (undeclared release) one of the known values."""
        if self.declared is not None:
            return self.observed == self.declared
        return self.fingerprint.holds(self.observed)

    def line(self) -> str:
        """How it differs from the oldest release checked, on one line."""
        old_version, old = self.baseline
        status = "declared" if self.expected else "DIFFERS"
        subject = f"{self.point.name}: {self.fingerprint.describes} {self.fingerprint.subject}"
        if ", " in old and ", " in self.observed:  # lists: what was added, what removed
            how = f"{change(old, self.observed)} since {old_version}"
        else:
            how = f"`{self.observed}`, was `{old}` in {old_version}"
        if not self.expected and self.declared is not None:
            how += f", declared `{self.declared}`"
        return f"  {status:8} {subject}: {how}"


def observe(tree: SourceTree, version: str) -> list[Finding]:
    """Every vLLM fingerprint of every touch point, observed in ``tree``."""
    return [
        Finding(point, fingerprint, fingerprint.observe(tree), fingerprint.accepted.get(version))
        for point in TOUCH_POINTS
        for fingerprint in point.fingerprints
        if fingerprint.package == "vllm"
    ]


def report(findings: list[Finding], version: str, source: str) -> tuple[str, int]:
    """The canary's printout and exit status: 1 when a finding is not as declared."""
    changed = [f for f in findings if f.observed != f.baseline[1] or not f.expected]
    failed = [f for f in changed if not f.expected]
    lines = [f"vllm-canary: vLLM {version} ({source}): {len(findings)} fingerprints"]
    lines += [finding.line() for finding in changed]
    notes = {f.point.name: f.point.notes[version] for f in changed if version in f.point.notes}
    lines += [f"  note     {name}: {note}" for name, note in notes.items()]
    lines.append(
        f"vllm-canary: {len(findings) - len(changed)} same as before, "
        f"{len(changed) - len(failed)} changed as declared for {version}, "
        f"{len(failed)} not declared"
    )
    return "\n".join(lines), 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the canary; 0 when every fingerprint is as declared."""
    parser = argparse.ArgumentParser(prog="vllm-canary", description=__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--vllm", metavar="VERSION", help="a vLLM release on PyPI, e.g. 0.33.0")
    which.add_argument("--installed", action="store_true", help="the vLLM installed here")
    parser.add_argument("--cache", type=Path, default=WHEELS, help="where wheels are kept")
    args = parser.parse_args(argv)
    try:
        if args.installed:
            found, tree = installed_vllm(), installed_tree("vllm")
            if found is None or tree is None:
                raise CanaryError("vLLM is not installed here")
            version, source = found[1].split("+")[0], f"installed {found[0]}"
        else:
            version = args.vllm
            wheel = fetch_wheel(version, args.cache)
            tree, source = unpack(wheel, version), wheel.name
    except (CanaryError, OSError, zipfile.BadZipFile) as exc:
        print(f"vllm-canary: {exc}", file=sys.stderr)
        return 2
    text, status = report(observe(tree, version), version, source)
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
