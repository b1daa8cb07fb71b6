//! The shared library's soname: `libkvrail_ffi.so.<major>` from 1.0 on, and
//! `libkvrail_ffi.so.0.<minor>` before (under 1.0 a minor release may break the ABI), so a
//! program linked against one release does not load an incompatible one.

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap_or_else(|_| "0".into());
    let abi = if major == "0" {
        format!("0.{minor}")
    } else {
        major
    };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvrail_ffi.so.{abi}");
    println!("cargo:rustc-env=KVRAIL_SONAME=libkvrail_ffi.so.{abi}");
    println!("cargo:rerun-if-changed=build.rs");
}
