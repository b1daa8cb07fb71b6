#!/usr/bin/env python3
"""The front door's static checks (tools/check-front-door.sh runs them, CI too):
README.md at most 200 lines; every relative link in the project's Markdown resolves (the
file, and the heading an anchor names); each code example in the README is, line by line
and in order, in the program CI runs (comments aside); every fuzz target fuzz/run.sh runs is
named in the wire-format page (docs/contributors/wire.md). Prints what is wrong; exit 1 if
anything is."""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX = 200
EXAMPLES = {"rust": "examples/readme.rs", "c": "ffi/examples/readme.c", "python": "python/tests/readme_example.py"}


def markdown_files():
    for top in ("README.md", "CHANGELOG.md", "SECURITY.md", "rbln-sys/README.md", "ffi/README.md", "tools/README.md",
                "tools/lab/README.md"):
        if os.path.exists(os.path.join(ROOT, top)):
            yield top
    for d, _, fs in os.walk(os.path.join(ROOT, "docs")):
        for f in sorted(fs):
            if f.endswith(".md"):
                yield os.path.relpath(os.path.join(d, f), ROOT)


def slug(heading):
    """GitHub's anchor for a heading."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def prose(path):
    """The lines of a Markdown file outside its code fences."""
    fence = False
    for line in open(os.path.join(ROOT, path), encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            yield line


def anchors(path):
    return {slug(line.lstrip("#")) for line in prose(path) if line.startswith("#")}


def check_links(problems):
    link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
    for md in markdown_files():
        for target in link.findall("".join(prose(md))):
            if re.match(r"^[a-z]+:", target):
                continue  # absolute URLs are not fetched (no network in CI)
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(os.path.join(ROOT, md)), path)) if path else os.path.join(ROOT, md)
            if not os.path.exists(full):
                problems.append(f"{md}: link to {target}: {os.path.relpath(full, ROOT)} does not exist")
            elif anchor and full.endswith(".md") and anchor not in anchors(os.path.relpath(full, ROOT)):
                problems.append(f"{md}: link to {target}: no heading #{anchor} there")


def code_lines(text, lang):
    comment = {"rust": r"\s*//.*$", "c": r"\s*/\*.*?\*/\s*$", "python": r"\s+#.*$"}[lang]
    out = []
    for line in text.splitlines():
        line = re.sub(comment, "", line).strip()
        if line and not re.fullmatch(r"(//|#|/\*).*", line):
            out.append(re.sub(r"\s+", " ", line))
    return out


def check_examples(problems):
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", readme, re.S | re.M)
    seen = set()
    for lang, body in blocks:
        if lang not in EXAMPLES:
            continue
        seen.add(lang)
        program = code_lines(open(os.path.join(ROOT, EXAMPLES[lang]), encoding="utf-8").read(), lang)
        at = 0
        for line in code_lines(body, lang):
            try:
                at = program.index(line, at) + 1
            except ValueError:
                problems.append(f"README.md: the {lang} example's line {line!r} is not in {EXAMPLES[lang]} (in order)")
                break
    for lang in EXAMPLES:
        if lang not in seen:
            problems.append(f"README.md: no {lang} example")


def check_wire_page(problems):
    """Each fuzz target (fuzz/run.sh's default list, and fuzz/src/bin/) is listed against the
    format it decodes in docs/contributors/wire.md."""
    run = open(os.path.join(ROOT, "fuzz", "run.sh"), encoding="utf-8").read()
    m = re.search(r"TARGETS=\(([a-z_ ]+)\)", run)
    targets = set(m.group(1).split()) if m else set()
    bins = {f[:-3] for f in os.listdir(os.path.join(ROOT, "fuzz", "src", "bin")) if f.endswith(".rs")} - {"seeds"}
    if not targets or targets != bins:
        problems.append(f"fuzz/run.sh runs {sorted(targets)}, fuzz/src/bin has {sorted(bins)}")
    page = open(os.path.join(ROOT, "docs", "contributors", "wire.md"), encoding="utf-8").read()
    for t in sorted(targets | bins):
        if f"`{t}`" not in page:
            problems.append(f"docs/contributors/wire.md: fuzz target {t} is not listed against a format")


def main():
    problems = []
    n = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().count("\n")
    if n > README_MAX:
        problems.append(f"README.md: {n} lines, more than {README_MAX}")
    check_links(problems)
    check_examples(problems)
    check_wire_page(problems)
    for p in problems:
        print(p)
    print(f"front door: README {n} lines; {len(list(markdown_files()))} Markdown files' links; "
          f"{len(EXAMPLES)} README examples: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
