//! Standard output that a reader who went away ends quietly: `kvrail-perf -a | head -1`
//! exits with 141 (128 + SIGPIPE, what a C tool killed by the signal reports) at the first
//! line nobody reads, where `println!` panicked (exit 101).

use std::io::Write;

/// The exit status when standard output's reader is gone.
pub(crate) const CLOSED: i32 = 141;

/// `println!` that ends the process quietly (status [`CLOSED`]) when stdout is closed.
macro_rules! outln {
    () => { $crate::out::write(format_args!("\n")) };
    ($($t:tt)*) => { $crate::out::write(format_args!("{}\n", format_args!($($t)*))) };
}

/// `print!` that ends the process quietly (status [`CLOSED`]) when stdout is closed.
#[allow(unused_macros)]
macro_rules! out {
    ($($t:tt)*) => { $crate::out::write(format_args!($($t)*)) };
}

/// Write `a` to stdout; a closed pipe ends the process (status [`CLOSED`]).
pub(crate) fn write(a: std::fmt::Arguments<'_>) {
    let mut o = std::io::stdout().lock();
    if let Err(e) = o.write_fmt(a) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(CLOSED);
        }
        // anything else (a full disk) is not worth dying for mid-run: say it once
        eprintln!("stdout: {e}");
    }
}

/// Flush stdout; a closed pipe ends the process (status [`CLOSED`]).
#[allow(dead_code)]
pub(crate) fn flush() {
    if let Err(e) = std::io::stdout().flush() {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(CLOSED);
        }
    }
}
