//! Fuzz target: `kvrail::fuzzing::kvmsg` (see ../../README.md).
fn main() {
    afl::fuzz!(|data: &[u8]| {
        kvrail::fuzzing::kvmsg(data);
    });
}
