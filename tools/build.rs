//! The build's name for `--version`: the commit it was built from (`git describe --always
//! --dirty`), or "not from git" for a build from a published package.

fn main() {
    let describe = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty());
    let build = describe.map_or_else(|| "not from git".to_owned(), |d| format!("commit {d}"));
    println!("cargo:rustc-env=KVRAIL_BUILD={build}");
    println!("cargo:rerun-if-changed=build.rs");
    for head in ["../.git/HEAD", "../.git/index"] {
        if std::path::Path::new(head).exists() {
            println!("cargo:rerun-if-changed={head}");
        }
    }
}
