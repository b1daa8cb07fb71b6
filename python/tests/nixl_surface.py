"""NIXL's Python surface against kvrail's, name by name and parameter by parameter.

    python nixl_surface.py dump OUT.json    # where NIXL 1.5.1 is installed (nixl_cu12/13)
    python nixl_surface.py check IN.json    # where kvrail is installed

``dump`` lists every public name of NIXL's ``nixl._api``, ``nixl._bindings`` and
``nixl._utils``, the public members of each class, and each callable's parameters (from
``inspect`` for Python code, from pybind11's signature line for the bindings, every
overload). ``check`` fails, naming each, on a name kvrail's modules (:mod:`kvrail.nixl`,
:mod:`kvrail._nixl_bindings`, :mod:`kvrail._nixl_utils`) lack or a call NIXL allows that
kvrail's signature refuses (a parameter name, or more positional arguments) — unless it is
in ``ABSENT`` below with the reason it stands. Exit status 1 on any."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from typing import Any, Dict, List, Optional

MODULES = ("_api", "_bindings", "_utils")
KVRAIL = {"_api": "kvrail.nixl", "_bindings": "kvrail._nixl_bindings", "_utils": "kvrail._nixl_utils"}

#: What kvrail leaves out on purpose, and why (module, dotted name) -> reason.
ABSENT: Dict[tuple, str] = {}

# names NIXL's modules import for themselves, not API
_IMPORTS = {"annotations", "logger", "get_logger", "nixlBind", "np", "pickle", "sys", "torch", "TYPE_CHECKING"}


def _split_args(s: str) -> List[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _pybind_overloads(obj: Any) -> Optional[List[List[dict]]]:
    """Each overload's parameters, from pybind11's docstring signature lines."""
    doc = getattr(obj, "__doc__", None) or ""
    name = getattr(obj, "__name__", "")
    sigs = re.findall(rf"^(?:\d+\. )?{re.escape(name)}\((.*)\) -> ", doc, re.M)
    if not sigs:
        return None
    out = []
    for sig in sigs:
        params = []
        for a in _split_args(sig):
            if a.startswith(("*args", "**kwargs")):
                params.append({"name": a.split(":")[0], "default": True, "star": True})
                continue
            pname = a.split(":", 1)[0].strip()
            if pname == "self":
                continue
            params.append({"name": pname, "default": "=" in a})
        out.append(params)
    return out


def _params(obj: Any) -> Optional[List[List[dict]]]:
    """The overloads of a callable, each a list of parameters (self left out)."""
    ov = _pybind_overloads(obj)
    if ov is not None:
        return ov
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    ps = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        star = p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ps.append({"name": p.name, "default": p.default is not p.empty or star, "star": star})
    return [ps]


def _public(obj: Any) -> List[str]:
    return sorted(n for n in dir(obj) if not n.startswith("_"))


def dump(out: str) -> None:
    pkg = None
    for cand in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            importlib.import_module(f"{cand}._bindings")
            pkg = cand
            break
        except ImportError:
            continue
    if pkg is None:
        sys.exit("no NIXL installed here (nixl_cu13, nixl_cu12 or nixl)")
    surface: Dict[str, Any] = {"package": pkg, "version": _version(pkg), "modules": {}}
    for m in MODULES:
        mod = importlib.import_module(f"{pkg}.{m}")
        names = {}
        for n in _public(mod):
            if n in _IMPORTS:
                continue
            o = getattr(mod, n)
            if inspect.ismodule(o) or getattr(o, "__module__", "") in ("typing", "enum", "__future__"):
                continue
            entry: Dict[str, Any] = {"kind": "class" if inspect.isclass(o) else ("callable" if callable(o) else "value")}
            if inspect.isclass(o):
                members = {}
                for mn in _public(o):
                    if mn in ("mro",):
                        continue
                    mo = getattr(o, mn, None)
                    members[mn] = _params(mo) if callable(mo) and not inspect.isclass(mo) else None
                entry["members"] = members
                entry["init"] = _params(o.__init__)
            elif callable(o):
                entry["params"] = _params(o)
            names[n] = entry
        surface["modules"][m] = names
    with open(out, "w") as f:
        json.dump(surface, f, indent=1, sort_keys=True)
    print(f"{pkg} {surface['version']}: " + ", ".join(f"{m} {len(v)} names" for m, v in surface["modules"].items()))


def _version(pkg: str) -> str:
    import importlib.metadata as md

    for d in (pkg.replace("_", "-"), "nixl"):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return "?"


def _accepts(theirs: List[dict], ours: Optional[List[List[dict]]]) -> Optional[str]:
    """None where kvrail's signature takes every call NIXL's overload ``theirs`` takes."""
    if ours is None:
        return "kvrail's is not inspectable"
    mine = ours[0]
    names = {p["name"] for p in mine}
    var_kw = any(p.get("star") and p["name"].startswith("**") or (p.get("star") and p["name"] == "kwargs") for p in mine)
    var_pos = any(p.get("star") and p["name"] in ("args", "*args") for p in mine)
    positional = [p for p in mine if not p.get("star")]
    if len(theirs) > len(positional) and not var_pos:
        return f"NIXL takes {len(theirs)} arguments, kvrail {len(positional)}"
    for p in theirs:
        if p.get("star") or re.fullmatch(r"arg\d+", p["name"]):
            continue
        if p["name"] not in names and not var_kw:
            return f"no parameter {p['name']!r}"
    need = sum(1 for p in positional if not p["default"])
    if need > len(theirs):
        return f"kvrail needs {need} arguments, NIXL's call gives {len(theirs)}"
    return None


def check(path: str) -> int:
    with open(path) as f:
        surface = json.load(f)
    problems, checked = [], 0
    for m, names in surface["modules"].items():
        mod = importlib.import_module(KVRAIL[m])
        for n, entry in names.items():
            checked += 1
            if (m, n) in ABSENT:
                continue
            if not hasattr(mod, n):
                problems.append(f"{m}.{n}: missing")
                continue
            ours = getattr(mod, n)
            if entry["kind"] == "callable" and entry.get("params"):
                for ov in entry["params"]:
                    why = _accepts(ov, _params(ours))
                    if why:
                        problems.append(f"{m}.{n}: {why}")
            if entry["kind"] != "class":
                continue
            if entry.get("init"):
                for ov in entry["init"]:
                    why = _accepts(ov, _params(ours.__init__) if "__init__" in vars(ours) or not _is_enum(ours) else None)
                    if why and not _is_enum(ours):
                        problems.append(f"{m}.{n}(): {why}")
            for mn, params in entry["members"].items():
                checked += 1
                if (m, f"{n}.{mn}") in ABSENT:
                    continue
                if not _has(ours, mn):
                    problems.append(f"{m}.{n}.{mn}: missing")
                    continue
                if params:
                    for ov in params:
                        why = _accepts(ov, _params(getattr(ours, mn)))
                        if why:
                            problems.append(f"{m}.{n}.{mn}: {why}")
    for p in problems:
        print("MISSING " + p)
    print(
        f"NIXL {surface['version']} ({surface['package']}): {checked} names and members checked against kvrail, "
        f"{len(problems)} missing, {len(ABSENT)} absent on purpose"
    )
    return 1 if problems else 0


def _is_enum(cls: Any) -> bool:
    import enum

    return isinstance(cls, type) and issubclass(cls, enum.Enum)


def _has(cls: Any, name: str) -> bool:
    if hasattr(cls, name):
        return True
    try:  # an attribute each instance has (a config's fields)
        if hasattr(cls(), name):
            return True
    except Exception:
        pass
    # an enum's members answer name and value
    return _is_enum(cls) and name in ("name", "value")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "dump":
        dump(sys.argv[2])
    else:
        sys.exit(check(sys.argv[2]))
