"""kvrail's NIXL compat package: a ``nixl`` package on kvrail, for programs that import NIXL
by name (vLLM's NixlConnector, Dynamo, NIXL's own examples) and cannot swap the import.

It is opt-in, written on purpose into one environment::

    python -m kvrail.nixl_compat install      # into this interpreter's site-packages
    python -m kvrail.nixl_compat install --target DIR   # or a directory on PYTHONPATH
    python -m kvrail.nixl_compat status
    python -m kvrail.nixl_compat uninstall    # (or: pip uninstall kvrail-nixl-compat)

The package it writes has NIXL's module names — ``nixl._api`` (:mod:`kvrail.nixl`),
``nixl._bindings`` (:mod:`kvrail._nixl_bindings` itself: ``nixlAgent``, descriptor lists,
constants, exceptions, ``nixlXferTelemetry``),
``nixl._utils`` and ``nixl.logging`` — each re-exporting kvrail's. ``install`` refuses
where a real NIXL is installed (its ``nixl`` package or its distributions ``nixl``,
``nixl-cu12``, ``nixl-cu13``, ``nixl-rocm``), and the package refuses to import next to one:
two ``nixl`` packages in one environment would leave which one runs to the import order.
At import it logs, once, that this ``nixl`` is kvrail.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import logging
import os
import shutil
import sys
import sysconfig
from typing import Dict, List, Optional, Sequence, Tuple

from ._kvrail import __version__

logger = logging.getLogger("kvrail.nixl")

DIST = "kvrail-nixl-compat"
MARKER = "KVRAIL_NIXL_COMPAT"
# the distributions that install NIXL's own `nixl` package
NIXL_DISTS = ("nixl", "nixl-cu12", "nixl-cu13", "nixl-rocm")

_HEAD = '"""kvrail\'s NIXL compat package (python -m kvrail.nixl_compat): {what} on kvrail. Not NIXL."""\n\n'
SHIM: Dict[str, str] = {
    "__init__.py": _HEAD.format(what="NIXL's Python API")
    + "from kvrail.nixl_compat import guard as _guard\n\n"
    + "_guard(__file__)\n\n"
    + "from . import _api, _bindings, _utils, logging  # noqa: E402,F401\n"
    + "from ._bindings import *  # noqa: E402,F401,F403\n"
    + "from ._utils import *  # noqa: E402,F401,F403\n"
    + "from ._api import *  # noqa: E402,F401,F403\n",
    "_api.py": _HEAD.format(what="nixl._api (the agent and its config)") + "from kvrail.nixl import *  # noqa: F401,F403\n",
    "_bindings.py": _HEAD.format(what="nixl._bindings (the bindings-level agent, descriptor lists, constants, errors)")
    + "import sys\n\n"
    + "import kvrail._nixl_bindings\n\n"
    + "# this module is kvrail's: what a program sets on nixl._bindings, nixl_agent sees\n"
    + "sys.modules[__name__] = kvrail._nixl_bindings\n",
    "_utils.py": _HEAD.format(what="nixl._utils") + "from kvrail._nixl_utils import *  # noqa: F401,F403\n",
    "logging.py": _HEAD.format(what="nixl.logging")
    + "from kvrail._nixl_logging import *  # noqa: F401,F403\n",
}

_warned = False


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def real_nixl(paths: Optional[Sequence[str]] = None) -> List[Tuple[str, str, str]]:
    """NIXL's own distributions visible on ``paths`` (default ``sys.path``): (name,
    version, where) for each."""
    found = []
    for d in md.distributions(path=list(paths) if paths is not None else sys.path):
        name = d.metadata.get("Name") or ""
        if _norm(name) in NIXL_DISTS:
            found.append((name, d.version, str(d.locate_file(""))))
    return found


def _describe(found: List[Tuple[str, str, str]]) -> str:
    return ", ".join(f"{n} {v} in {w}" for n, v, w in found)


def guard(init_file: str) -> None:
    """Called by the compat package's ``__init__``: refuse to stand in for NIXL next to a
    real NIXL, and say once that this ``nixl`` is kvrail."""
    global _warned
    found = real_nixl()
    if found:
        raise ImportError(
            f"{os.path.dirname(init_file)} is kvrail's NIXL compat package, but NIXL itself is "
            f"installed too: {_describe(found)}. One `nixl` per environment: "
            f"`python -m kvrail.nixl_compat uninstall` to use NIXL, or "
            f"`pip uninstall {' '.join(n for n, _, _ in found)}` to use kvrail"
        )
    if not _warned:
        _warned = True
        logger.warning(
            "nixl: this is kvrail %s's NIXL compat package (%s), not NIXL: NIXL's Python API "
            "on kvrail's own transport (no libnixl, no UCX)",
            __version__,
            os.path.dirname(init_file),
        )


def _site(target: Optional[str]) -> str:
    return os.path.abspath(target) if target else sysconfig.get_paths()["purelib"]


def _ours(pkg: str) -> bool:
    return os.path.isfile(os.path.join(pkg, MARKER))


def _dist_infos(site: str) -> List[str]:
    prefix = DIST.replace("-", "_") + "-"
    return [os.path.join(site, e) for e in os.listdir(site) if e.startswith(prefix) and e.endswith(".dist-info")]


class Refused(Exception):
    """What ``install`` will not do, and why."""


def install(target: Optional[str] = None) -> str:
    """Write the compat package into ``target`` (default: this interpreter's site-packages);
    returns the package's directory. Raises :class:`Refused` where a real NIXL is there or
    visible to this interpreter."""
    site = _site(target)
    pkg = os.path.join(site, "nixl")
    if os.path.exists(pkg) and not _ours(pkg):
        owner = real_nixl([site])
        raise Refused(
            f"{pkg} is NIXL's ({_describe(owner) or 'owner unknown'}): kvrail does not write over it. "
            f"To run this environment on kvrail instead: pip uninstall {' '.join(NIXL_DISTS)}, then install again"
        )
    found = real_nixl(list(dict.fromkeys([site] + sys.path)))
    if found:
        raise Refused(
            f"NIXL is installed where this Python finds it: {_describe(found)}; a second `nixl` next to it "
            f"would leave which one runs to the import order. Uninstall it first (pip uninstall "
            f"{' '.join(n for n, _, _ in found)}) or use an environment without it"
        )
    os.makedirs(pkg, exist_ok=True)
    files = []
    for name, text in SHIM.items():
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
        files.append(f"nixl/{name}")
    with open(os.path.join(pkg, MARKER), "w") as f:
        f.write(f"kvrail {__version__}\n")
    files.append(f"nixl/{MARKER}")
    for old in _dist_infos(site):
        shutil.rmtree(old)
    info_name = f"{DIST.replace('-', '_')}-{__version__}.dist-info"
    info = os.path.join(site, info_name)
    os.makedirs(info)
    meta = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {__version__}\n"
            f"Summary: NIXL's Python module names on kvrail (written by python -m kvrail.nixl_compat)\n"
            f"Requires-Dist: kvrail=={__version__}\n"
        ),
        "INSTALLER": "kvrail.nixl_compat\n",
        "top_level.txt": "nixl\n",
    }
    for name, text in meta.items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
        files.append(f"{info_name}/{name}")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.writelines(f"{p},,\n" for p in files + [f"{info_name}/RECORD"])
    return pkg


def uninstall(target: Optional[str] = None) -> bool:
    """Remove the compat package from ``target``; False where it was not there. A ``nixl``
    that is not kvrail's is left alone."""
    site = _site(target)
    pkg = os.path.join(site, "nixl")
    removed = False
    if os.path.isdir(pkg) and _ours(pkg):
        shutil.rmtree(pkg)
        removed = True
    for info in _dist_infos(site):
        shutil.rmtree(info)
        removed = True
    return removed


def status(target: Optional[str] = None) -> str:
    """One line: what ``import nixl`` finds in ``target``."""
    site = _site(target)
    pkg = os.path.join(site, "nixl")
    if os.path.isdir(pkg) and _ours(pkg):
        with open(os.path.join(pkg, MARKER)) as f:
            return f"{pkg}: kvrail's NIXL compat package ({f.read().strip()})"
    found = real_nixl([site])
    if found:
        return f"{pkg}: NIXL ({_describe(found)})"
    return f"{site}: no nixl package"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvrail.nixl_compat", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["install", "uninstall", "status"])
    ap.add_argument("--target", help="a directory (on PYTHONPATH) instead of this interpreter's site-packages")
    a = ap.parse_args(argv)
    try:
        if a.action == "install":
            print(f"kvrail's NIXL compat package written to {install(a.target)}")
        elif a.action == "uninstall":
            print("removed" if uninstall(a.target) else f"no kvrail NIXL compat package in {_site(a.target)}")
        else:
            print(status(a.target))
    except (Refused, OSError) as e:
        print(f"python -m kvrail.nixl_compat {a.action}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
