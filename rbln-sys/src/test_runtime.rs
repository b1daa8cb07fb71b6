//! kvrail's test runtime: the public RBLN C functions implemented on host memory, compiled
//! from C by the tests that use it (with the system `cc`), so transfers of "NPU memory" are
//! tested where no NPU exists. Its `rbln_memcpy` refuses any copy whose device side is not
//! inside a live allocation, and `rbln_test_live_allocs()` counts allocations for leak checks.
//! Test support only; never loaded unless a test points [`crate::ENV_LIB`] or
//! [`crate::RblnLib::load_from`] at it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C source.
pub const SOURCE: &str = include_str!("../testlib/rbln_test_runtime.c");

/// Compile the test runtime into `dir` and return the library's path. `defines` are C
/// macros: `OMIT_rbln_memcpy` / `OMIT_rbln_get_device_count` leave a required symbol out,
/// `WITH_RDMA_ABI` adds the optional `rbln_rdma_abi_version` and
/// `rbln_rdma_device_numa_node`. The file name encodes the defines, so variants coexist.
///
/// # Errors
/// The compiler's failure, with its output.
pub fn build(dir: &Path, defines: &[&str]) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let tag = if defines.is_empty() {
        "plain".to_owned()
    } else {
        defines.join("-")
    };
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pid = format!("{}-{n}", std::process::id());
    let lib = dir.join(format!("librbln_test_{tag}.so"));
    // per-process temporaries: concurrent builders never read or load a half-written file
    let src = dir.join(format!(".rbln_test_runtime.{tag}.{pid}.c"));
    let tmp = dir.join(format!(".librbln_test_{tag}.{pid}.so"));
    std::fs::write(&src, SOURCE)?;
    let mut cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.args([
        "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread", "-o",
    ])
    .arg(&tmp)
    .arg(&src);
    for d in defines {
        cc.arg(format!("-D{d}"));
    }
    let out = cc.output();
    let _ = std::fs::remove_file(&src);
    let out = out?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "cc failed building the RBLN test runtime: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    std::fs::rename(&tmp, &lib)?;
    Ok(lib)
}
