//! Fuzz target: `kvrail::fuzzing::notif` (see ../../README.md).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvrail::fuzzing::notif(data);
    });
}
