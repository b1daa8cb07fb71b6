//! The Prometheus endpoint (`metrics_listen`), on both backends: the text parses as the
//! exposition format (0.0.4: every sample after its `# TYPE`, names and labels well formed,
//! counters named `_total`), its transfer and byte counters move with a READ, other paths
//! and methods are refused, and it stops with the agent.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvrail::agent::{Agent, AgentConfig, Desc, RemoteAccess, XferOp, XferStatus};

use super::{cfg, load, pattern, wait, Host};

type Series = HashMap<(String, Vec<(String, String)>), f64>;

fn get(at: SocketAddr, request: &str) -> (String, String) {
    let mut s = TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("a header and a body");
    (head.to_owned(), body.to_owned())
}

fn name_ok(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

/// Parse the text format strictly; every violation panics with the line.
fn parse(text: &str) -> Series {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut out = Series::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(name_ok(name), "{line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(line);
            assert!(
                name_ok(name) && ["counter", "gauge"].contains(&kind),
                "{line}"
            );
            assert!(
                types.insert(name.into(), kind.into()).is_none(),
                "TYPE twice: {line}"
            );
            if kind == "counter" {
                assert!(
                    name.ends_with("_total"),
                    "a counter not named _total: {line}"
                );
            }
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "stray line {line:?}"
        );
        let (series, value) = line.rsplit_once(' ').expect(line);
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value: {line}"));
        let (name, labels) = match series.split_once('{') {
            None => (series, Vec::new()),
            Some((n, l)) => {
                let l = l.strip_suffix('}').expect(line);
                let mut v = Vec::new();
                let mut rest = l;
                while !rest.is_empty() {
                    let (k, r) = rest.split_once("=\"").expect(line);
                    assert!(name_ok(k), "{line}");
                    // the value runs to the first unescaped quote
                    let mut val = String::new();
                    let mut it = r.char_indices();
                    let end = loop {
                        match it.next().expect(line) {
                            (_, '\\') => match it.next().expect(line).1 {
                                'n' => val.push('\n'),
                                c => val.push(c),
                            },
                            (i, '"') => break i,
                            (_, c) => val.push(c),
                        }
                    };
                    v.push((k.to_owned(), val));
                    rest = r[end + 1..].strip_prefix(',').unwrap_or(&r[end + 1..]);
                }
                (n, v)
            }
        };
        assert!(types.contains_key(name), "sample before its TYPE: {line}");
        assert!(
            out.insert((name.into(), labels), value).is_none(),
            "twice: {line}"
        );
    }
    out
}

fn sum(s: &Series, name: &str, want: &[(&str, &str)]) -> f64 {
    s.iter()
        .filter(|((n, l), _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.iter().any(|(a, b)| a == k && b == v))
        })
        .map(|(_, v)| v)
        .sum()
}

#[test]
fn the_prometheus_endpoint_parses_and_moves_with_a_read() {
    let p = Agent::new("prefill-0", cfg(Host::B)).unwrap();
    let d = Agent::new(
        "decode-0",
        AgentConfig {
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            ..cfg(Host::A)
        },
    )
    .unwrap();
    let at = d.metrics_addr().expect("the endpoint runs");
    assert!(p.metrics_addr().is_none());
    let len = 1 << 20;
    let src = p.register(len, RemoteAccess::READ, vec![]).unwrap();
    p.write_region(src, 0, &pattern(9, len)).unwrap();
    let dst = d.register(len, RemoteAccess::NONE, vec![]).unwrap();
    let peer = load(&d, &p);
    let scrape = || {
        let (head, body) = get(at, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.contains("Content-Type: text/plain; version=0.0.4"),
            "{head}"
        );
        parse(&body)
    };
    let before = scrape();
    let done = [("agent", "decode-0"), ("op", "read"), ("outcome", "done")];
    let x = d
        .create_xfer(
            XferOp::Read,
            vec![Desc::new(dst, 0, len as u64)],
            &peer,
            vec![Desc::new(src, 0, len as u64)],
            None,
        )
        .unwrap();
    d.post(x).unwrap();
    assert_eq!(wait(&d, x), XferStatus::Done);
    let after = scrape();
    let moved = |name: &str, l: &[(&str, &str)]| sum(&after, name, l) - sum(&before, name, l);
    assert_eq!(moved("kvrail_transfers_total", &done), 1.0);
    // the bytes, on the backend that moved them: TCP, or the rails of verbs
    let read = [("agent", "decode-0"), ("op", "read")];
    let bytes = moved("kvrail_tcp_bytes_total", &read) + moved("kvrail_rail_bytes_total", &read);
    assert_eq!(bytes, len as f64);
    assert_eq!(sum(&after, "kvrail_peers", &[("agent", "decode-0")]), 1.0);
    assert_eq!(sum(&after, "kvrail_regions", &[("agent", "decode-0")]), 1.0);
    // the same numbers from Rust
    let m = d.metrics();
    assert_eq!(m.value("kvrail_transfers_total", &done), Some(1.0));
    // other paths and methods
    let (head, _) = get(at, "GET / HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let (head, _) = get(at, "POST /metrics HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");
    // it stops with the agent
    drop(d);
    let t = std::time::Instant::now();
    while TcpStream::connect_timeout(&at, Duration::from_millis(200)).is_ok() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the endpoint outlived its agent"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
