//! The region's gate without sockets or a peer: a peer's READ served (or WRITE received) is
//! a run of chunks, each inside the gate while its bytes move; a deregistration closes the
//! gate, waits for the chunk inside, and no later chunk enters.

use super::*;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// A peer's READ in flight: chunk after chunk through the gate, each copying for `copy`.
/// Returns (chunks moved, chunks that moved after `given_back` was set — the deregistration
/// had returned: each one would have touched memory given back).
fn serve_read(
    gate: Arc<Gate>,
    copy: Duration,
    given_back: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(usize, usize)> {
    std::thread::spawn(move || {
        let (mut moved, mut after) = (0, 0);
        loop {
            let Some(_inside) = gate.enter() else {
                return (moved, after); // the region was given back: the READ fails here
            };
            if given_back.load(Ordering::Acquire) {
                after += 1;
            }
            std::thread::sleep(copy);
            if given_back.load(Ordering::Acquire) {
                after += 1;
            }
            moved += 1;
        }
    })
}

#[test]
fn a_deregistration_waits_for_the_chunks_inside_and_none_enters_after_it() {
    for readers in [1, 4] {
        let gate = Arc::new(Gate::default());
        let given_back = Arc::new(AtomicBool::new(false));
        let copy = Duration::from_millis(if readers == 1 { 20 } else { 1 });
        let rs: Vec<_> = (0..readers)
            .map(|_| serve_read(gate.clone(), copy, given_back.clone()))
            .collect();
        std::thread::sleep(Duration::from_millis(30)); // chunks are moving
        assert_eq!(gate.close(Duration::from_secs(10)), Ok(()));
        given_back.store(true, Ordering::Release); // the memory is reused from here on
        for r in rs {
            let (moved, after) = r.join().unwrap();
            assert!(
                moved >= 1,
                "{readers} reader(s): a chunk moved before the deregistration"
            );
            assert_eq!(
                after, 0,
                "{readers} reader(s): a chunk ran after the deregistration returned"
            );
        }
        assert!(gate.enter().is_none(), "a closed gate lets no chunk in");
    }
}

#[test]
fn a_chunk_that_never_leaves_times_the_deregistration_out_and_the_gate_reopens() {
    let gate = Gate::default();
    let stuck = gate.enter().unwrap();
    assert_eq!(gate.close(Duration::from_millis(50)), Err(1));
    // the region stays registered: the gate lets chunks in again
    let again = gate.enter();
    assert!(again.is_some());
    drop((again, stuck));
    assert_eq!(gate.close(Duration::from_millis(50)), Ok(()));
    assert!(gate.enter().is_none());
    gate.reopen();
    assert!(
        gate.enter().is_some(),
        "reopened after a deregistration that could not finish"
    );
}
