//! The layer map of `src/lib.rs`, kept by a test: every `crate::…`, `super::…` and `self::…`
//! path in `src/` (tests aside) is resolved to the module it names, and
//! 1. a top-level module uses only modules of a lower layer (`LAYERS`), so the top-level
//!    modules form no circle;
//! 2. files form no import circle: the only circle allowed is one module split over files —
//!    a `mod.rs` (or `name.rs`) and its own child files, which implement the parent's types
//!    and use its private items — and even there the child files form no circle among
//!    themselves (two sibling files that import each other are two modules tangled, whether
//!    or not their parent is in the circle too). Files of different modules in a circle (a
//!    driver naming the agent's facade again) fail. Each failure names the arrows that close
//!    the circle: where to cut it. `KNOWN_CIRCLES` lists circles left to take apart (shrink
//!    it, never grow it; it is empty).
//!
//! A new top-level module fails the test until it is given a layer.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level modules and their layers (a module may use only lower layers).
const LAYERS: &[(&str, u32)] = &[
    ("idhash", 0),
    ("threads", 0),
    ("metrics", 0),
    ("proto", 1),
    ("mem", 1),
    ("rails", 1),
    ("transport", 2),
    ("store", 3),
    ("agent", 4),
    ("connector", 5),
];

/// Outside the layers: the crate root (it declares and re-exports) and the fuzz entry points.
const OUTSIDE: &[&str] = &["", "fuzzing"];

/// Circles not taken apart yet (their files, sorted): none.
const KNOWN_CIRCLES: &[&[&str]] = &[];

type Mod = Vec<String>;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().unwrap() != "tests" {
                sources(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") && p.file_name().unwrap() != "tests.rs" {
            out.push(p);
        }
    }
}

/// `src/agent/verbs/mod.rs` → `["agent", "verbs"]`; `src/lib.rs` → `[]`.
fn module_of(src: &Path, file: &Path) -> Mod {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut m: Mod = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib")) {
        m.pop();
    }
    m
}

/// The text without its `#[cfg(test)] mod … { … }` blocks (a unit test module's `use
/// super::*` is the test's, not the file's).
fn without_test_mods(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(") {
        let Some(close) = rest[at..].find(")]").map(|c| at + c + 2) else {
            break;
        };
        let cond = &rest[at + 6..close - 2];
        let after = rest[close..].trim_start();
        if !(cond == "test" || cond.starts_with("all(test,")) {
            out.push_str(&rest[..close]);
            rest = &rest[close..];
            continue;
        }
        let Some(body) = after
            .strip_prefix("mod ")
            .and_then(|b| b.find(['{', ';']).map(|i| (b, i)))
            .filter(|&(b, i)| b.as_bytes()[i] == b'{')
        else {
            out.push_str(&rest[..close]);
            rest = &rest[close..];
            continue;
        };
        out.push_str(&rest[..at]);
        let (b, open) = body;
        let mut depth = 0;
        let mut end = b.len();
        for (i, c) in b[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &b[end..];
    }
    out.push_str(rest);
    out
}

/// The code of a file without comments, string contents and unit test modules (what `use`
/// and paths are in).
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("");
        out.push_str(line);
        out.push('\n');
    }
    let out = without_test_mods(&out);
    // drop string literals ("…", escapes inside them) and the character literal '"'
    let mut s = String::new();
    let mut in_str = false;
    let mut chars = out.chars().peekable();
    while let Some(c) = chars.next() {
        if in_str {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => in_str = false,
                _ => {}
            }
        } else if c == '\'' && chars.peek() == Some(&'"') {
            chars.next(); // '"' itself
            chars.next(); // its closing quote
        } else if c == '"' {
            in_str = true;
        } else {
            s.push(c);
        }
    }
    s
}

/// Every path the code names from `crate`, `super` or `self` (braced `use` lists expanded one
/// level), and the first segments of `use` paths that name a child module.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let text = code;
    // `use a::b::{c, d::e}` statements
    for stmt in text.split(';') {
        let b = stmt.as_bytes();
        let Some(at) = stmt
            .match_indices("use ")
            .map(|(i, _)| i)
            .find(|&i| i == 0 || matches!(b[i - 1], b' ' | b'\n' | b'\t' | b'{' | b'}' | b')'))
        else {
            continue;
        };
        let body: String = stmt[at + 4..]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let body = body.trim_start_matches("::");
        match body.find("::{") {
            Some(b) => {
                let prefix: Vec<String> = body[..b].split("::").map(str::to_owned).collect();
                let inner = body[b + 3..].trim_end_matches('}');
                let mut depth = 0;
                let mut item = String::new();
                for c in inner.chars().chain(std::iter::once(',')) {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 && item.is_empty() => continue, // `{a, b,}`
                        ',' if depth == 0 => {
                            let first: String = item.split("::{").next().unwrap().to_owned();
                            let mut p = prefix.clone();
                            p.extend(
                                first
                                    .split("::")
                                    .filter(|s| !s.is_empty())
                                    .map(str::to_owned),
                            );
                            out.push(p);
                            item.clear();
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
            }
            None => out.push(body.split("::").map(str::to_owned).collect()),
        }
    }
    // inline paths: crate::x::y, super::x
    for (i, _) in text
        .match_indices("crate::")
        .chain(text.match_indices("super::"))
    {
        if i > 0
            && (text.as_bytes()[i - 1].is_ascii_alphanumeric() || text.as_bytes()[i - 1] == b'_')
        {
            continue;
        }
        out.extend(path_at(text, i));
    }
    // inline paths from a name: `control::Work` (a child module, if one is called so)
    let b = text.as_bytes();
    for (i, _) in text.match_indices("::") {
        let start = text[..i]
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |s| s + 1);
        if start == i || (start > 0 && b[start - 1] == b':') {
            continue;
        }
        if let Some(p) = path_at(text, start) {
            if !matches!(p[0].as_str(), "crate" | "super" | "self") {
                out.push(p);
            }
        }
    }
    out
}

/// The path that starts at `at`, as segments; none where it ends in `::` (a `use` list
/// follows: `crate::agent::{…}` names what is inside the braces, read with the `use`).
fn path_at(text: &str, at: usize) -> Option<Vec<String>> {
    let raw = text[at..]
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .next()?;
    if raw.ends_with("::") {
        return None;
    }
    Some(raw.split("::").map(str::to_owned).collect())
}

/// The module a path names, from module `cur` (the longest known prefix).
fn resolve(cur: &Mod, path: &[String], known: &BTreeSet<Mod>) -> Option<Mod> {
    let (mut base, rest): (Mod, &[String]) = match path.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &path[1..]),
        Some("self") => (cur.clone(), &path[1..]),
        Some("super") => {
            let mut b = cur.clone();
            let mut rest = path;
            while rest.first().map(String::as_str) == Some("super") {
                b.pop();
                rest = &rest[1..];
            }
            (b, rest)
        }
        Some(first) => {
            let mut child = cur.clone();
            child.push(first.to_owned());
            if !known.contains(&child) {
                return None;
            }
            (cur.clone(), path)
        }
        None => return None,
    };
    let mut best = known.contains(&base).then(|| base.clone());
    for seg in rest {
        base.push(seg.clone());
        if known.contains(&base) {
            best = Some(base.clone());
        }
    }
    best
}

struct Graph {
    edges: BTreeMap<Mod, BTreeSet<Mod>>,
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let known: BTreeSet<Mod> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut edges: BTreeMap<Mod, BTreeSet<Mod>> = BTreeMap::new();
    for f in &files {
        let m = module_of(&src, f);
        let text = std::fs::read_to_string(f).unwrap();
        let e = edges.entry(m.clone()).or_default();
        for p in paths(&code(&text)) {
            if let Some(t) = resolve(&m, &p, &known) {
                if t != m {
                    e.insert(t);
                }
            }
        }
    }
    Graph { edges }
}

/// Strongly connected components (Tarjan), each as a sorted list.
fn circles(nodes: &BTreeSet<Mod>, edges: &BTreeMap<Mod, BTreeSet<Mod>>) -> Vec<Vec<Mod>> {
    struct T<'a> {
        edges: &'a BTreeMap<Mod, BTreeSet<Mod>>,
        nodes: &'a BTreeSet<Mod>,
        index: BTreeMap<Mod, usize>,
        low: BTreeMap<Mod, usize>,
        stack: Vec<Mod>,
        on: BTreeSet<Mod>,
        out: Vec<Vec<Mod>>,
    }
    fn visit(t: &mut T<'_>, v: &Mod) {
        let i = t.index.len();
        t.index.insert(v.clone(), i);
        t.low.insert(v.clone(), i);
        t.stack.push(v.clone());
        t.on.insert(v.clone());
        let next: Vec<Mod> = t
            .edges
            .get(v)
            .into_iter()
            .flatten()
            .filter(|w| t.nodes.contains(*w))
            .cloned()
            .collect();
        for w in next {
            if !t.index.contains_key(&w) {
                visit(t, &w);
                let l = t.low[&w].min(t.low[v]);
                t.low.insert(v.clone(), l);
            } else if t.on.contains(&w) {
                let l = t.index[&w].min(t.low[v]);
                t.low.insert(v.clone(), l);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(&w);
                comp.push(w.clone());
                if &w == v {
                    break;
                }
            }
            comp.sort();
            t.out.push(comp);
        }
    }
    let mut t = T {
        edges,
        nodes,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for n in nodes {
        if !t.index.contains_key(n) {
            visit(&mut t, n);
        }
    }
    t.out
}

fn top(m: &Mod) -> &str {
    m.first().map_or("", String::as_str)
}

fn layer(name: &str) -> Option<u32> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|&(_, l)| l)
}

/// The parent when the files of circle `c` are one module split over files: one of them is
/// the parent of all the others.
fn parent_of(c: &[Mod]) -> Option<&Mod> {
    c.iter().find(|parent| {
        c.iter().all(|m| {
            m == *parent
                || m.split_last()
                    .is_some_and(|(_, up)| up == parent.as_slice())
        })
    })
}

/// True when the files of circle `c` are one module split over files.
fn one_module(c: &[Mod]) -> bool {
    parent_of(c).is_some()
}

/// The arrows inside circle `c` (`a -> b, c` per file): where to cut it.
fn arrows(c: &[Mod], edges: &BTreeMap<Mod, BTreeSet<Mod>>) -> String {
    let set: BTreeSet<&Mod> = c.iter().collect();
    c.iter()
        .map(|m| {
            let tos: Vec<String> = (edges.get(m).into_iter().flatten())
                .filter(|t| set.contains(t))
                .map(|t| t.join("::"))
                .collect();
            format!("{} -> {}", m.join("::"), tos.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The checks, as messages (empty: the layering holds).
fn violations(g: &Graph) -> Vec<String> {
    let mut bad = Vec::new();
    for (from, tos) in &g.edges {
        let a = top(from);
        if OUTSIDE.contains(&a) {
            continue;
        }
        let Some(la) = layer(a) else {
            bad.push(format!(
                "src/{a}: a top-level module without a layer in tests/layers.rs"
            ));
            continue;
        };
        for to in tos {
            let b = top(to);
            if b == a || OUTSIDE.contains(&b) {
                continue;
            }
            match layer(b) {
                Some(lb) if lb < la => {}
                Some(lb) => bad.push(format!(
                    "{} (layer {la}) imports {} (layer {lb}): a module uses only lower layers",
                    from.join("::"),
                    to.join("::")
                )),
                None => bad.push(format!(
                    "src/{b}: a top-level module without a layer in tests/layers.rs"
                )),
            }
        }
    }
    let nodes: BTreeSet<Mod> = (g.edges.keys())
        .filter(|m| !OUTSIDE.contains(&top(m)))
        .cloned()
        .collect();
    for c in circles(&nodes, &g.edges) {
        if c.len() < 2 {
            continue;
        }
        let names: Vec<String> = c.iter().map(|m| m.join("::")).collect();
        if KNOWN_CIRCLES.iter().any(|k| *k == names.as_slice()) {
            continue;
        }
        let Some(parent) = parent_of(&c) else {
            bad.push(format!(
                "{} files import each other in a circle across modules: {} ({})",
                c.len(),
                names.join(", "),
                arrows(&c, &g.edges)
            ));
            continue;
        };
        // one module over its files: the children may use the parent and the parent them,
        // but sibling files that close a circle among themselves are two modules tangled
        let children: BTreeSet<Mod> = c.iter().filter(|m| *m != parent).cloned().collect();
        for s in circles(&children, &g.edges) {
            if s.len() > 1 {
                let names: Vec<String> = s.iter().map(|m| m.join("::")).collect();
                bad.push(format!(
                    "{} sibling files of {} import each other in a circle: {} ({})",
                    s.len(),
                    parent.join("::"),
                    names.join(", "),
                    arrows(&s, &g.edges)
                ));
            }
        }
    }
    bad
}

#[test]
fn every_module_uses_only_lower_layers_and_no_circle_crosses_modules() {
    let g = graph();
    assert!(
        g.edges.len() > 50,
        "read only {} modules of src/",
        g.edges.len()
    );
    let bad = violations(&g);
    assert!(
        bad.is_empty(),
        "the layering of src/lib.rs is broken:\n{}",
        bad.join("\n")
    );
}

/// The test can fail: an import from a higher layer (the store naming the agent, as it did
/// before the store's errors stopped mapping to the agent's faults) is caught, and so is a
/// file added to a circle.
#[test]
fn a_wrong_import_is_caught() {
    let mut g = graph();
    let store: Mod = vec!["store".into()];
    g.edges
        .entry(store)
        .or_default()
        .insert(vec!["agent".into()]);
    let bad = violations(&g);
    assert!(
        bad.iter().any(
            |b| b == "store (layer 3) imports agent (layer 4): a module uses only lower layers"
        ),
        "{bad:?}"
    );
    let mut g = graph();
    let wire: Mod = vec!["proto".into(), "wire".into()];
    let handshake: Mod = vec!["proto".into(), "handshake".into()];
    let kvmsg: Mod = vec!["proto".into(), "kvmsg".into()];
    g.edges
        .entry(wire.clone())
        .or_default()
        .insert(handshake.clone());
    g.edges.entry(handshake).or_default().insert(kvmsg.clone());
    g.edges.entry(kvmsg).or_default().insert(wire);
    assert_circle_caught(&g, &["proto::wire", "proto::handshake"]);
    // a driver that names the facade again (the TCP data path using the agent's state, as
    // it did before it took the core): the facade reaches it, so the two close a circle
    let mut g = graph();
    g.edges
        .entry(vec!["agent".into(), "tcp".into()])
        .or_default()
        .insert(vec!["agent".into()]);
    assert_circle_caught(&g, &["agent::tcp", "agent::control"]);
    // sibling files that import each other fail even with their parent in the circle (the
    // side channel's driven connections and its I/O did, through `control`)
    let mut g = graph();
    let (control, io, driven): (Mod, Mod, Mod) = (
        vec!["agent".into(), "control".into()],
        vec!["agent".into(), "control".into(), "io".into()],
        vec!["agent".into(), "control".into(), "driven".into()],
    );
    g.edges
        .entry(control.clone())
        .or_default()
        .insert(io.clone());
    g.edges.entry(io.clone()).or_default().insert(control);
    g.edges
        .entry(io.clone())
        .or_default()
        .insert(driven.clone());
    g.edges.entry(driven).or_default().insert(io);
    let bad = violations(&g);
    assert!(
        bad.iter()
            .any(|b| b.contains("sibling files of agent::control")
                && b.contains("agent::control::driven -> agent::control::io")),
        "a circle of sibling files unseen: {bad:?}"
    );
    // a module split over its own files is one module, not a circle across modules
    assert!(one_module(&[
        vec!["agent".into(), "verbs".into()],
        vec!["agent".into(), "verbs".into(), "notif".into()],
        vec!["agent".into(), "verbs".into(), "poster".into()],
    ]));
    assert!(!one_module(&[
        vec!["agent".into(), "region".into()],
        vec!["agent".into(), "table".into()],
    ]));
}

/// `violations` names a circle across modules with all of `files` in it.
fn assert_circle_caught(g: &Graph, files: &[&str]) {
    let bad = violations(g);
    assert!(
        bad.iter()
            .any(|b| b.contains("a circle across modules") && files.iter().all(|f| b.contains(f))),
        "a circle of {files:?} unseen: {bad:?}"
    );
}
