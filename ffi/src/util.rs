//! The panic boundary and the pointer / buffer helpers every export uses.

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::result::{kvrail_result, set_last, Failure};

/// Run `f`, turning its failure into a code (and the thread's last error) and a panic into
/// [`kvrail_result::Panic`].
pub(crate) fn boundary(f: impl FnOnce() -> Result<(), Failure>) -> kvrail_result {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => kvrail_result::Ok,
        Ok(Err(Failure(code, msg))) => {
            set_last(&msg);
            code
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_last(&format!("panic inside kvrail: {what}"));
            kvrail_result::Panic
        }
    }
}

pub(crate) fn null(what: &str) -> Failure {
    Failure::new(kvrail_result::NullParameter, format!("{what} is NULL"))
}

/// A C string argument.
///
/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL and, by the caller's promise, NUL-terminated.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Failure::new(kvrail_result::InvalidUtf8, format!("{what} is not UTF-8")))
}

/// A byte-slice argument (`len` 0 allows NULL).
///
/// # Safety
/// `p` is valid for `len` bytes when `len > 0`.
pub(crate) unsafe fn bytes_arg<'a>(
    p: *const u8,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL and valid for `len` bytes by the caller's promise.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// A slice of `T` (`n` 0 allows NULL).
///
/// # Safety
/// `p` is valid for `n` elements when `n > 0`.
pub(crate) unsafe fn slice_arg<'a, T>(
    p: *const T,
    n: usize,
    what: &str,
) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL and valid for `n` elements by the caller's promise.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Write `v` to an out-pointer.
///
/// # Safety
/// `out` is NULL or valid for a write.
pub(crate) unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL and valid for a write by the caller's promise.
    unsafe { out.write(v) };
    Ok(())
}

/// Copy `data` into `buf` (`len` bytes) and its length into `out_len`;
/// [`kvrail_result::BufferTooSmall`] (writing nothing) when it does not fit.
///
/// # Safety
/// `buf` is valid for `len` bytes (or NULL with `len` 0); `out_len` is NULL or writable.
pub(crate) unsafe fn write_bytes(
    data: &[u8],
    buf: *mut u8,
    len: usize,
    out_len: *mut usize,
) -> Result<(), Failure> {
    if out_len.is_null() {
        return Err(null("out_len"));
    }
    if data.len() > len {
        return Err(Failure::new(
            kvrail_result::BufferTooSmall,
            format!("{} bytes needed, the buffer has {len}", data.len()),
        ));
    }
    if !data.is_empty() {
        if buf.is_null() {
            return Err(null("buf"));
        }
        // SAFETY: `buf` is valid for `len >= data.len()` bytes and does not overlap `data`
        // (which the library owns).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, data.len()) };
    }
    // SAFETY: checked non-NULL above; writable by the caller's promise.
    unsafe { out_len.write(data.len()) };
    Ok(())
}
