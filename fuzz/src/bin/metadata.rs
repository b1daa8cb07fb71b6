//! Fuzz target: `kvrail::fuzzing::metadata` (see ../../README.md).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvrail::fuzzing::metadata(data);
    });
}
