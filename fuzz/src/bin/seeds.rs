//! Writes the seed inputs (`kvrail::fuzzing::seeds`) to `corpus/<target>/seed-<n>`.
fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "corpus".into());
    for (n, (target, bytes)) in kvrail::fuzzing::seeds().into_iter().enumerate() {
        let d = std::path::Path::new(&dir).join(target);
        std::fs::create_dir_all(&d).expect("corpus directory");
        std::fs::write(d.join(format!("seed-{n:02}")), bytes).expect("seed file");
    }
}
