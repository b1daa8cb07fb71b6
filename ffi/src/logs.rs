//! kvrail's log records for C: a callback the caller installs (rustls-ffi's
//! `set_log_callback` shape) and the level below which records are not made.

use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{PoisonError, RwLock};

/// Log levels (`level` in [`kvrail_log_callback`], and [`kvrail_set_log_level`]).
pub const KVRAIL_LOG_ERROR: u32 = 1;
/// Warnings (the default level).
pub const KVRAIL_LOG_WARN: u32 = 2;
/// Information: the backend chosen and why, peers connected.
pub const KVRAIL_LOG_INFO: u32 = 3;
/// Debugging detail.
pub const KVRAIL_LOG_DEBUG: u32 = 4;
/// Everything.
pub const KVRAIL_LOG_TRACE: u32 = 5;

/// A log record for the caller: `level` (`KVRAIL_LOG_*`), `target` (the Rust module, e.g.
/// `kvrail::agent`) and `message`, both NUL-terminated and valid only during the call, and
/// the `userdata` given to [`kvrail_set_log_callback`]. It is called from kvrail's own
/// threads as well as the caller's: it must be thread-safe, return quickly, and not call
/// into kvrail.
pub type kvrail_log_callback = Option<
    unsafe extern "C" fn(
        level: u32,
        target: *const c_char,
        message: *const c_char,
        userdata: *mut c_void,
    ),
>;

struct Sink {
    cb: kvrail_log_callback,
    userdata: usize,
}

static SINK: RwLock<Sink> = RwLock::new(Sink {
    cb: None,
    userdata: 0,
});

/// The level asked for (applied when the bridge is installed, too).
static LEVEL: AtomicU32 = AtomicU32::new(KVRAIL_LOG_WARN);

fn filter(level: u32) -> log::LevelFilter {
    match level {
        0 => log::LevelFilter::Off,
        KVRAIL_LOG_ERROR => log::LevelFilter::Error,
        KVRAIL_LOG_WARN => log::LevelFilter::Warn,
        KVRAIL_LOG_INFO => log::LevelFilter::Info,
        KVRAIL_LOG_DEBUG => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    }
}

struct Bridge;

impl log::Log for Bridge {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let s = SINK.read().unwrap_or_else(PoisonError::into_inner);
        let Some(cb) = s.cb else {
            return;
        };
        let level = match r.level() {
            log::Level::Error => KVRAIL_LOG_ERROR,
            log::Level::Warn => KVRAIL_LOG_WARN,
            log::Level::Info => KVRAIL_LOG_INFO,
            log::Level::Debug => KVRAIL_LOG_DEBUG,
            log::Level::Trace => KVRAIL_LOG_TRACE,
        };
        let nul = |s: String| CString::new(s.replace('\0', " ")).unwrap_or_default();
        let (target, message) = (nul(r.target().to_owned()), nul(r.args().to_string()));
        // SAFETY: the caller installed `cb` with the promise that it may be called from any
        // thread with two NUL-terminated strings valid for the call and its `userdata`.
        unsafe {
            cb(
                level,
                target.as_ptr(),
                message.as_ptr(),
                s.userdata as *mut c_void,
            )
        };
    }

    fn flush(&self) {}
}

/// Install `cb` to receive kvrail's log records (NULL: none; the default), with `userdata`
/// handed back on every call. Records below the level of [`kvrail_set_log_level`] (default
/// `KVRAIL_LOG_WARN`) are not made.
///
/// # Safety
/// `cb` is NULL or a function that can be called as [`kvrail_log_callback`] says, from any
/// thread, until it is replaced; `userdata` is whatever it needs.
#[no_mangle]
pub unsafe extern "C" fn kvrail_set_log_callback(cb: kvrail_log_callback, userdata: *mut c_void) {
    let _ = crate::util::boundary(|| {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            if log::set_logger(&Bridge).is_ok() {
                log::set_max_level(filter(LEVEL.load(Ordering::Relaxed)));
            }
        });
        let mut s = SINK.write().unwrap_or_else(PoisonError::into_inner);
        *s = Sink {
            cb,
            userdata: userdata as usize,
        };
        Ok(())
    });
}

/// Make records at `level` (`KVRAIL_LOG_*`) and more severe; 0 makes none.
#[no_mangle]
pub extern "C" fn kvrail_set_log_level(level: u32) {
    LEVEL.store(level, Ordering::Relaxed);
    log::set_max_level(filter(level));
}
