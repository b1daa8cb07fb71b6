//! Loading the runtime and resolving its symbols.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::Arc;

use libloading::Library;

/// The environment variable that names the runtime library to load (a path or a file name).
pub const ENV_LIB: &str = "RBLN_RUNTIME_LIB";

/// The library names tried, in order, when [`ENV_LIB`] is unset.
pub const SEARCH: &[&str] = &["librbln.so.1", "librbln.so", "librbln_rt.so"];

/// The runtime could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate library could be opened.
    #[error("no RBLN runtime library could be loaded (set {ENV_LIB} to its path); tried: {}",
        tried.iter().map(|(n, e)| format!("{n} ({e})")).collect::<Vec<_>>().join("; "))]
    NotFound {
        /// Each candidate and why it failed.
        tried: Vec<(String, String)>,
    },
    /// The library opened but lacks a required symbol.
    #[error("{library} has no symbol {symbol}, which kvrail requires (is it the RBLN runtime?)")]
    MissingSymbol {
        /// The library file.
        library: String,
        /// The missing symbol.
        symbol: &'static str,
    },
}

/// A runtime call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RblnError {
    /// The runtime returned a non-zero code.
    #[error("{call} failed with code {code} ({})", match code { 1 => "RBLN_FAILURE", 2 => "RBLN_INVALID", _ => "unknown code" })]
    Call {
        /// The function.
        call: &'static str,
        /// Its return value.
        code: i32,
    },
    /// A byte range outside a device allocation (checked before calling the runtime).
    #[error("range [{offset}, {offset}+{len}) is outside the {size}-byte device allocation")]
    OutOfRange {
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// Allocation size.
        size: u64,
    },
    /// An optional entry point the loaded runtime does not provide.
    #[error("the RBLN runtime at {library} does not provide {symbol}: {why}")]
    Unsupported {
        /// The library file.
        library: String,
        /// The absent symbol.
        symbol: &'static str,
        /// What that means for the caller.
        why: &'static str,
    },
}

type GetDeviceCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type Malloc = unsafe extern "C" fn(c_int, u64, *mut *mut c_void) -> c_int;
type Free = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;
type Memcpy = unsafe extern "C" fn(c_int, *mut c_void, *const c_void, u64, c_int) -> c_int;
type AbiVersion = unsafe extern "C" fn() -> c_int;
type NumaNode = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type ExportDmabuf =
    unsafe extern "C" fn(c_int, *mut c_void, u64, *mut c_int, *mut u64, *mut u64) -> c_int;

/// The resolved entry points (function pointers stay valid while the library is loaded).
pub(crate) struct Table {
    pub(crate) get_device_count: GetDeviceCount,
    pub(crate) malloc: Malloc,
    pub(crate) free: Free,
    pub(crate) memcpy: Memcpy,
    pub(crate) numa_node: Option<NumaNode>,
    pub(crate) export_dmabuf: Option<ExportDmabuf>,
}

/// A loaded RBLN runtime. Share it in an `Arc`: device allocations hold one.
pub struct RblnLib {
    pub(crate) t: Table,
    path: String,
    abi: Option<i32>,
    // Last: dropped after nothing can call through the table any more.
    _lib: Library,
}

impl fmt::Debug for RblnLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RblnLib")
            .field("path", &self.path)
            .field("rdma_abi", &self.abi)
            .field("dmabuf_export", &self.t.export_dmabuf.is_some())
            .finish()
    }
}

fn required<T: Copy>(lib: &Library, path: &str, name: &'static str) -> Result<T, LoadError> {
    optional(lib, name).ok_or_else(|| LoadError::MissingSymbol {
        library: path.to_owned(),
        symbol: name,
    })
}

fn optional<T: Copy>(lib: &Library, name: &str) -> Option<T> {
    let mut cname = name.as_bytes().to_vec();
    cname.push(0);
    // SAFETY: every `T` used here is the `extern "C"` function type this crate documents for
    // `name`; the pointer is copied out and used only while `RblnLib` keeps `lib` loaded.
    unsafe { lib.get::<T>(&cname).ok().map(|s| *s) }
}

impl RblnLib {
    /// Load the runtime: the file [`ENV_LIB`] names when it is set (and only that), otherwise
    /// the first of [`SEARCH`] that opens.
    ///
    /// # Errors
    /// [`LoadError::NotFound`] listing every candidate and its `dlopen` error;
    /// [`LoadError::MissingSymbol`].
    pub fn load() -> Result<Arc<Self>, LoadError> {
        let candidates: Vec<String> = match std::env::var(ENV_LIB) {
            Ok(p) if !p.is_empty() => vec![p],
            _ => SEARCH.iter().map(|s| (*s).to_owned()).collect(),
        };
        let mut tried = Vec::new();
        for c in candidates {
            match Self::load_from(&c) {
                Err(LoadError::NotFound { tried: t }) => tried.extend(t),
                other => return other,
            }
        }
        Err(LoadError::NotFound { tried })
    }

    /// The process's runtime: [`RblnLib::load`] once, the same handle (or the same error)
    /// for every caller afterwards.
    ///
    /// # Errors
    /// As [`RblnLib::load`], from its first call.
    pub fn shared() -> Result<Arc<Self>, LoadError> {
        static LIB: std::sync::OnceLock<Result<Arc<RblnLib>, LoadError>> =
            std::sync::OnceLock::new();
        LIB.get_or_init(Self::load).clone()
    }

    /// Load the runtime from `path` (a path, or a file name the dynamic loader searches for).
    ///
    /// # Errors
    /// [`LoadError::NotFound`], [`LoadError::MissingSymbol`].
    pub fn load_from(path: &str) -> Result<Arc<Self>, LoadError> {
        // SAFETY: loading runs the library's initializers; the RBLN runtime (or a library
        // standing in for it) is trusted code, as any linked library would be.
        let lib = unsafe { Library::new(path) }.map_err(|e| LoadError::NotFound {
            tried: vec![(path.to_owned(), e.to_string())],
        })?;
        let t = Table {
            get_device_count: required(&lib, path, "rbln_get_device_count")?,
            malloc: required(&lib, path, "rbln_malloc")?,
            free: required(&lib, path, "rbln_free")?,
            memcpy: required(&lib, path, "rbln_memcpy")?,
            numa_node: optional(&lib, "rbln_rdma_device_numa_node"),
            export_dmabuf: optional(&lib, "rbln_rdma_export_dmabuf"),
        };
        let abi = optional::<AbiVersion>(&lib, "rbln_rdma_abi_version").map(|f| {
            // SAFETY: `rbln_rdma_abi_version` takes nothing and returns an int.
            unsafe { f() }
        });
        let mut t = t;
        if abi.is_some_and(|v| v != 1) {
            // an ABI we do not know: use none of the optional entry points
            t.numa_node = None;
            t.export_dmabuf = None;
        }
        Ok(Arc::new(Self {
            t,
            path: path.to_owned(),
            abi,
            _lib: lib,
        }))
    }

    /// The library file it was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `rbln_rdma_abi_version()`, when the runtime has kvrail's optional ABI.
    pub fn rdma_abi(&self) -> Option<i32> {
        self.abi
    }

    /// Number of NPUs.
    ///
    /// # Errors
    /// [`RblnError::Call`].
    pub fn device_count(&self) -> Result<u32, RblnError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the duration of the call.
        let rc = unsafe { (self.t.get_device_count)(&mut n) };
        check("rbln_get_device_count", rc)?;
        Ok(n.max(0) as u32)
    }

    /// The NUMA node the runtime reports for `dev` (`None` without the optional entry point,
    /// or when it does not know).
    pub fn numa_node(&self, dev: i32) -> Option<i32> {
        let f = self.t.numa_node?;
        let mut node: c_int = -1;
        // SAFETY: `node` is a valid out-pointer for the duration of the call.
        let rc = unsafe { f(dev, &mut node) };
        (rc == 0 && node >= 0).then_some(node)
    }

    /// Whether NPU memory can be exported as a dma-buf: `Err` says why not.
    ///
    /// # Errors
    /// [`RblnError::Unsupported`] when `rbln_rdma_export_dmabuf` is absent.
    pub fn dmabuf_export(&self) -> Result<(), RblnError> {
        match self.t.export_dmabuf {
            Some(_) => Ok(()),
            None => Err(self.no_export()),
        }
    }

    pub(crate) fn no_export(&self) -> RblnError {
        RblnError::Unsupported {
            library: self.path.clone(),
            symbol: "rbln_rdma_export_dmabuf",
            why: "NPU memory cannot be exported as a dma-buf (no public RBLN API does this), \
                  so it cannot be registered with the NIC; use host bounce",
        }
    }
}

pub(crate) fn check(call: &'static str, rc: c_int) -> Result<(), RblnError> {
    match rc {
        0 => Ok(()),
        code => Err(RblnError::Call { call, code }),
    }
}
