//! `kvrail._kvrail`, the native module under the `kvrail` Python package: an agent (memory
//! registration of the caller's buffers, metadata, peers, transfers, notifications) and the
//! exception hierarchy that mirrors the library's fault groups. The Python modules
//! (`kvrail.nixl`, `kvrail.vllm`) are written on top of it.
//!
//! Unsafe code here is PyO3 glue only: registering memory at an address Python hands over.

mod agent;
mod connector;
mod errors;
mod logs;
mod raw;

use pyo3::prelude::*;

/// The module.
#[pymodule]
fn _kvrail(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::add(m)?;
    logs::install();
    m.add_function(wrap_pyfunction!(logs::set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(logs::take_logs, m)?)?;
    m.add_function(wrap_pyfunction!(logs::stop_logs, m)?)?;
    m.add_function(wrap_pyfunction!(connector::check_kv_transfer_params, m)?)?;
    m.add_class::<agent::Agent>()?;
    m.add_class::<connector::Scheduler>()?;
    m.add_class::<connector::Worker>()?;
    Ok(())
}
