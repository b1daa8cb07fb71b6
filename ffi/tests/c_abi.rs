//! The C ABI from the outside: the committed header matches a fresh cbindgen generation; a
//! C program (compiled here with `cc` against include/kvrail.h and the cdylib) moves a
//! buffer between two agents and checks every byte; a second C program checks the error
//! codes for bad input; the Python ctypes check; and the library loading where no
//! libibverbs exists (TCP backend). Inside the lab the C transfer runs on verbs.

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where the cdylib this test was built with lies: the test binary's own directory
/// (target/<profile>/deps/). Cargo builds the library with all its crate types for its
/// tests, so `libkvrail_ffi.so` there is the one of this build, with this build's features
/// (a separate `cargo build -p kvrail-ffi` resolved other features: it built kvrail and its
/// dependencies again, and the two builds took turns overwriting the same file).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().to_path_buf();
    assert!(
        dir.join("libkvrail_ffi.so").is_file(),
        "no libkvrail_ffi.so beside {}: build this test with cargo",
        exe.display()
    );
    dir
}

fn generate() -> String {
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir())
        .with_config(cbindgen::Config::from_file(crate_dir().join("cbindgen.toml")).unwrap())
        .generate()
        .expect("cbindgen")
        .write(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn header_matches_a_fresh_generation() {
    let path = crate_dir().join("include/kvrail.h");
    let fresh = generate();
    if std::env::var_os("KVRAIL_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "ffi/include/kvrail.h is stale: regenerate with \
         `KVRAIL_BLESS=1 cargo test -p kvrail-ffi --test c_abi header` and commit it"
    );
}

/// The soname link next to the cdylib (what a program linked against it loads), as an
/// installation makes it (see `ffi/install.sh`).
fn soname_link() {
    let link = lib_dir().join(env!("KVRAIL_SONAME"));
    let target = Path::new("libkvrail_ffi.so");
    if std::fs::read_link(&link).is_ok_and(|t| t == target) {
        return;
    }
    let _ = std::fs::remove_file(&link);
    match std::os::unix::fs::symlink(target, &link) {
        // another test made it meanwhile
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        r => r.expect("the soname link"),
    }
}

/// Compile `examples/<name>.c` against the header and the cdylib; returns the binary.
fn compile(name: &str) -> PathBuf {
    soname_link();
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("c-{name}"));
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&out)
        .arg(crate_dir().join(format!("examples/{name}.c")))
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg("-I")
        .arg(crate_dir().join("examples"))
        .arg("-L")
        .arg(lib_dir())
        .arg("-lkvrail_ffi")
        .arg(format!("-Wl,-rpath,{}", lib_dir().display()))
        .status()
        .expect("running cc");
    assert!(st.success(), "cc failed for {name}.c");
    out
}

/// The backend arguments the C transfer takes: verbs with the lab's devices inside the lab.
fn lab_config() -> (String, String) {
    if std::env::var_os("LAB_GUEST").is_some() {
        let devs = |k: &str| {
            let v: Vec<String> = std::env::var(k)
                .unwrap_or_default()
                .split_whitespace()
                .map(|d| format!("\"{d}\""))
                .collect();
            format!(
                r#"{{"backend":"verbs","listen":"127.0.0.1:0","devices":[{}]}}"#,
                v.join(",")
            )
        };
        (devs("LAB_A_DEVS"), devs("LAB_B_DEVS"))
    } else {
        let tcp = r#"{"backend":"tcp","listen":"127.0.0.1:0"}"#.to_owned();
        (tcp.clone(), tcp)
    }
}

fn run(bin: &Path, args: &[&str]) -> String {
    run_env(bin, args, &[])
}

fn run_env(bin: &Path, args: &[&str], env: &[(&str, &Path)]) -> String {
    let mut c = Command::new(bin);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    eprintln!("{text}");
    assert!(o.status.success(), "{} failed: {text}", bin.display());
    text
}

#[test]
fn c_example_moves_bytes_between_two_agents() {
    let bin = compile("transfer");
    let (a, b) = lab_config();
    let out = run(&bin, &[&a, &b]);
    let want = if std::env::var_os("LAB_GUEST").is_some() {
        "backend verbs"
    } else {
        "backend tcp"
    };
    assert!(out.contains(want), "{out}");
    assert!(out.contains("all bytes match"), "{out}");
}

#[test]
fn c_connector_pull_and_push() {
    let bin = compile("connector");
    let (a, b) = lab_config();
    for mode in ["pull", "push"] {
        let out = run(&bin, &[mode, &a, &b]);
        assert!(out.contains(&format!("connector ({mode}): KV")), "{out}");
        assert!(out.contains("turn 2 read them back from D"), "{out}");
    }
}

#[test]
fn c_error_codes_for_bad_input() {
    let bin = compile("errors");
    // NPU memory is checked against kvrail's RBLN test runtime
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c-rbln");
    let rt = rbln_sys::test_runtime::build(&dir, &[]).expect("building the RBLN test runtime");
    let out = run_env(&bin, &[], &[("RBLN_RUNTIME_LIB", &rt)]);
    assert!(out.contains("all error checks passed"), "{out}");
}

fn python() -> Option<&'static str> {
    Command::new("python3")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| "python3")
}

#[test]
fn python_ctypes_loopback_and_notification() {
    let Some(py) = python() else {
        panic!("python3 is required (tools/lab/setup.sh installs it)");
    };
    let lib = lib_dir().join("libkvrail_ffi.so");
    let mut cmd = Command::new(py);
    cmd.arg(crate_dir().join("python/check.py")).arg(&lib);
    if std::env::var_os("LAB_GUEST").is_some() {
        // both agents on host A's rails: verbs loopback through the rxe devices
        cmd.env("KVRAIL_CONFIG", lab_config().0)
            .env("KVRAIL_EXPECT_BACKEND", "verbs");
    }
    let o = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    eprintln!("{text}");
    assert!(
        o.status.success() && text.contains("python check passed"),
        "{text}"
    );
}

#[test]
fn the_library_does_not_link_libibverbs() {
    let lib = lib_dir().join("libkvrail_ffi.so");
    let o = Command::new("readelf").arg("-d").arg(&lib).output();
    let Ok(o) = o else {
        panic!("readelf is required (binutils)");
    };
    let text = String::from_utf8_lossy(&o.stdout);
    let needed: Vec<&str> = text.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(!needed.is_empty(), "{text}");
    assert!(
        needed
            .iter()
            .all(|l| !l.contains("ibverbs") && !l.contains("rdmacm")),
        "links rdma-core: {needed:?}"
    );
}

/// Run the Python check with libibverbs hidden: a private mount namespace where every
/// libibverbs.so* is bind-mounted over by an empty file, so dlopen fails as on a host with no
/// rdma-core. The agent must come up on TCP.
#[test]
fn loads_and_runs_on_tcp_where_libibverbs_is_absent() {
    let Some(py) = python() else {
        panic!("python3 is required");
    };
    let lib = lib_dir().join("libkvrail_ffi.so");
    let script = format!(
        "set -e; for f in $(ls /usr/lib/*/libibverbs.so* /lib/*/libibverbs.so* 2>/dev/null); do \
         mount --bind /dev/null \"$f\"; done; \
         if {py} -c 'import ctypes; ctypes.CDLL(\"libibverbs.so.1\")' 2>/dev/null; then \
         echo 'libibverbs is still loadable'; exit 3; fi; echo 'libibverbs hidden'; \
         KVRAIL_EXPECT_BACKEND=tcp KVRAIL_CONFIG='{{\"listen\":\"127.0.0.1:0\"}}' {py} {} {}",
        crate_dir().join("python/check.py").display(),
        lib.display()
    );
    let o = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .output();
    let o = match o {
        Ok(o) if !String::from_utf8_lossy(&o.stderr).contains("unshare failed") => o,
        other => {
            eprintln!("SKIPPED: cannot make a mount namespace here ({other:?}); CI runs as root");
            return;
        }
    };
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    eprintln!("{text}");
    assert!(
        o.status.success() && text.contains("libibverbs hidden") && text.contains("backend tcp"),
        "{text}"
    );
}

/// `ffi/install.sh PREFIX` with the library cargo built, into a fresh `prefix`.
fn install(prefix: &Path) {
    let _ = std::fs::remove_dir_all(prefix);
    let st = Command::new("bash")
        .arg(crate_dir().join("install.sh"))
        .arg(prefix)
        .arg(lib_dir())
        .status()
        .expect("install.sh");
    assert!(st.success(), "install.sh failed");
}

/// The program `bin` records the library's versioned soname (as a distribution's would).
fn assert_needs_soname(bin: &Path) {
    let needed = Command::new("readelf").arg("-d").arg(bin).output().unwrap();
    let needed = String::from_utf8_lossy(&needed.stdout);
    let soname = env!("KVRAIL_SONAME");
    assert!(
        needed.contains(&format!("Shared library: [{soname}]")),
        "{needed}"
    );
}

/// The library installs like a distribution's (`ffi/install.sh`): a versioned soname, its
/// links, the header and a generated pkg-config file; a program built with
/// `pkg-config --cflags --libs kvrail` against the installation records the soname and runs.
#[test]
fn installed_with_a_versioned_soname_and_pkg_config() {
    let prefix = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c-prefix");
    install(&prefix);
    let lib = prefix.join("lib");
    let soname = env!("KVRAIL_SONAME");
    assert_eq!(
        std::fs::read_link(lib.join("libkvrail_ffi.so")).unwrap(),
        PathBuf::from(soname)
    );
    let pc = std::fs::read_to_string(lib.join("pkgconfig/kvrail.pc")).unwrap();
    assert!(
        pc.contains(&format!("Version: {}", env!("CARGO_PKG_VERSION"))),
        "{pc}"
    );
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "kvrail"])
        .env("PKG_CONFIG_PATH", lib.join("pkgconfig"))
        .output()
        .expect("pkg-config (tools/lab/setup.sh installs it)");
    assert!(
        flags.status.success(),
        "{}",
        String::from_utf8_lossy(&flags.stderr)
    );
    let flags = String::from_utf8(flags.stdout).unwrap();
    assert!(
        flags.contains("-lkvrail_ffi") && flags.contains("/include"),
        "{flags}"
    );
    let bin = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c-installed");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(crate_dir().join("examples/transfer.c"))
        .arg("-I")
        .arg(crate_dir().join("examples"))
        .args(flags.split_whitespace())
        .status()
        .expect("cc");
    assert!(st.success(), "cc with pkg-config's flags failed");
    assert_needs_soname(&bin);
    let (a, b) = lab_config();
    let out = run_env(&bin, &[&a, &b], &[("LD_LIBRARY_PATH", &lib)]);
    assert!(out.contains("all bytes match"), "{out}");
}

/// CMake's `find_package(kvrail 0.1)` finds the installed copy (ffi/install.sh's
/// kvrailConfig.cmake): the README's C example builds against `kvrail::kvrail`, records the
/// soname and moves its bytes; a version of another ABI (0.2) is not found.
#[test]
fn cmake_finds_the_installed_package_and_builds_the_readme_example() {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let prefix = tmp.join("cmake-prefix");
    install(&prefix);
    let configure = |want: &str, build: &Path| {
        let _ = std::fs::remove_dir_all(build);
        Command::new("cmake")
            .arg("-S")
            .arg(crate_dir().join("examples/cmake"))
            .arg("-B")
            .arg(build)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display()))
            .arg(format!("-DKVRAIL_WANT={want}"))
            .output()
            .expect("cmake (tools/lab/setup.sh installs it)")
    };
    let build = tmp.join("cmake-build");
    let o = configure("0.1", &build);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new("cmake")
        .arg("--build")
        .arg(&build)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let bin = build.join("readme");
    assert_needs_soname(&bin);
    let out = run_env(&bin, &[], &[("LD_LIBRARY_PATH", &prefix.join("lib"))]);
    assert!(
        out.contains("README example: 1048576 bytes written"),
        "{out}"
    );
    let o = configure("0.2", &tmp.join("cmake-build-0.2"));
    assert!(
        !o.status.success(),
        "find_package(kvrail 0.2) accepted a 0.1 library"
    );
}
