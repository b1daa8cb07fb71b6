//! Fuzz target: `kvrail::fuzzing::json` (see ../../README.md).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvrail::fuzzing::json(data);
    });
}
