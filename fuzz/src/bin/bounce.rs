//! Fuzz target: `kvrail::fuzzing::bounce` (see ../../README.md).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvrail::fuzzing::bounce(data);
    });
}
