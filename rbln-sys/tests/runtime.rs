//! rbln-sys against kvrail's test runtime (compiled here from C): loading, the typed
//! errors for an absent library and absent symbols, device memory round trips, range
//! checks, the runtime's own refusal of bad device addresses, the optional ABI, and leaks.
#![allow(unsafe_code)] // reads the test runtime's leak counter through libloading

use std::path::PathBuf;
use std::sync::Arc;

use rbln_sys::{test_runtime, DeviceAlloc, LoadError, RblnError, RblnLib};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rbln-test-runtime")
}

fn runtime(defines: &[&str]) -> (PathBuf, Arc<RblnLib>) {
    let p = test_runtime::build(&dir(), defines).expect("building the test runtime");
    let lib = RblnLib::load_from(p.to_str().unwrap()).expect("loading the test runtime");
    (p, lib)
}

fn live_allocs(path: &PathBuf) -> i32 {
    // SAFETY: the test runtime defines `int rbln_test_live_allocs(void)`; the library stays
    // loaded (dlopen is reference counted) while the symbol is called.
    unsafe {
        let lib = libloading::Library::new(path).unwrap();
        let f: libloading::Symbol<'_, unsafe extern "C" fn() -> i32> =
            lib.get(b"rbln_test_live_allocs\0").unwrap();
        f()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 9) as u8)
        .collect()
}

#[test]
fn device_memory_round_trip_is_byte_exact_and_freed() {
    let (path, lib) = runtime(&[]);
    assert_eq!(lib.device_count().unwrap(), 2);
    let before = live_allocs(&path);
    {
        let a = DeviceAlloc::new(&lib, 1, 1 << 20).unwrap();
        assert_eq!(a.len(), 1 << 20);
        assert_eq!(a.device(), 1);
        let data = pattern(300_000, 7);
        a.copy_from_host(4096, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        a.copy_to_host(4096, &mut back).unwrap();
        assert!(back == data, "bytes changed on the way through the device");
        // bytes around the copy stay zero
        let mut edge = [0xffu8; 16];
        a.copy_to_host(4096 - 16, &mut edge).unwrap();
        assert_eq!(edge, [0u8; 16]);
        assert_eq!(live_allocs(&path), before + 1);
    }
    assert_eq!(live_allocs(&path), before, "drop frees the allocation");
}

#[test]
fn ranges_are_checked_and_the_runtime_refuses_what_is_not_device_memory() {
    let (_, lib) = runtime(&[]);
    let a = DeviceAlloc::new(&lib, 0, 4096).unwrap();
    let e = a.copy_from_host(4000, &[0u8; 200]).unwrap_err();
    assert_eq!(
        e,
        RblnError::OutOfRange {
            offset: 4000,
            len: 200,
            size: 4096
        }
    );
    assert!(e.to_string().contains("4096-byte device allocation"), "{e}");
    let mut out = [0u8; 1];
    assert!(matches!(
        a.copy_to_host(u64::MAX, &mut out),
        Err(RblnError::OutOfRange { .. })
    ));
    // the runtime itself rejects what it did not allocate
    let e = DeviceAlloc::new(&lib, 9, 64).unwrap_err();
    assert_eq!(
        e,
        RblnError::Call {
            call: "rbln_malloc",
            code: 2
        }
    );
    assert!(e.to_string().contains("RBLN_INVALID"), "{e}");
    assert!(DeviceAlloc::new(&lib, 0, 0).is_err(), "zero bytes");
}

#[test]
fn dmabuf_export_is_absent_and_says_so() {
    let (_, lib) = runtime(&[]);
    assert_eq!(lib.rdma_abi(), None);
    assert_eq!(lib.numa_node(0), None);
    let e = lib.dmabuf_export().unwrap_err();
    assert!(
        e.to_string().contains("rbln_rdma_export_dmabuf") && e.to_string().contains("host bounce"),
        "{e}"
    );
    let a = DeviceAlloc::new(&lib, 0, 4096).unwrap();
    assert!(matches!(
        a.export_dmabuf(),
        Err(RblnError::Unsupported {
            symbol: "rbln_rdma_export_dmabuf",
            ..
        })
    ));
}

#[test]
fn optional_abi_is_resolved_when_present() {
    let (_, lib) = runtime(&["WITH_RDMA_ABI"]);
    assert_eq!(lib.rdma_abi(), Some(1));
    assert_eq!(lib.numa_node(1), Some(1));
    assert_eq!(lib.numa_node(5), None, "an unknown device has no node");
    assert!(lib.dmabuf_export().is_err(), "export is still absent");
}

#[test]
fn a_missing_required_symbol_is_a_typed_error() {
    for (define, symbol) in [
        ("OMIT_rbln_memcpy", "rbln_memcpy"),
        ("OMIT_rbln_get_device_count", "rbln_get_device_count"),
    ] {
        let p = test_runtime::build(&dir(), &[define]).unwrap();
        let e = RblnLib::load_from(p.to_str().unwrap()).unwrap_err();
        assert_eq!(
            e,
            LoadError::MissingSymbol {
                library: p.to_str().unwrap().to_owned(),
                symbol
            }
        );
        assert!(e.to_string().contains(symbol), "{e}");
    }
}

/// All environment handling in one test (the environment is process-wide).
#[test]
fn an_absent_library_is_a_typed_error_naming_every_candidate() {
    let e = RblnLib::load_from("/nonexistent/librbln.so.1").unwrap_err();
    let LoadError::NotFound { tried } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(tried.len(), 1);
    assert!(e.to_string().contains("/nonexistent/librbln.so.1"), "{e}");

    std::env::set_var(rbln_sys::ENV_LIB, "/nonexistent/librbln_custom.so");
    let e = RblnLib::load().unwrap_err();
    assert!(
        e.to_string().contains("librbln_custom.so") && e.to_string().contains("RBLN_RUNTIME_LIB"),
        "{e}"
    );

    let (p, _) = runtime(&[]);
    std::env::set_var(rbln_sys::ENV_LIB, &p);
    let lib = RblnLib::load().expect("RBLN_RUNTIME_LIB names the test runtime");
    assert_eq!(lib.path(), p.to_str().unwrap());

    std::env::remove_var(rbln_sys::ENV_LIB);
    match RblnLib::load() {
        Err(LoadError::NotFound { tried }) => {
            let names: Vec<&str> = tried.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, rbln_sys::SEARCH);
        }
        Ok(lib) => eprintln!(
            "an RBLN runtime is installed here ({}); search-list case not checked",
            lib.path()
        ),
        Err(e) => panic!("{e}"),
    }
}
