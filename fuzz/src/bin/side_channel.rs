//! Fuzz target: `kvrail::fuzzing::side_channel` (see ../../README.md).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvrail::fuzzing::side_channel(data);
    });
}
