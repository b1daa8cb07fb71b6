use super::*;
use std::io::Read;

/// One connection of a group ending closes them all: the flag drops, and the far end of
/// every connection reads its end (their readers and writers stop).
#[test]
fn a_group_closes_every_connection() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let g = Group::default();
    let mut far = Vec::new();
    for _ in 0..3 {
        let near = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        far.push(l.accept().unwrap().0);
        lock(&g.socks).push(near);
    }
    assert!(g.is_open());
    g.clone().close();
    assert!(!g.is_open());
    for mut f in far {
        f.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(f.read(&mut b).unwrap(), 0, "a connection left open");
    }
}
