//! Python exceptions mirroring kvrail's fault groups ([`kvrail::agent::Fault`]): what to fix
//! (misuse, configuration), whom to blame (the peer, the connection, the fabric, memory), or
//! what this host lacks.

use kvrail::agent::{AgentError, Fault, XferError};
use kvrail::mem::ConfigError as KvConfigError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(_kvrail, KvrailError, PyException, "Every kvrail error.");
create_exception!(
    _kvrail,
    MisuseError,
    KvrailError,
    "The caller's fault: a bad argument, an unknown id or peer, a call in the wrong state."
);
create_exception!(
    _kvrail,
    ConfigError,
    MisuseError,
    "A configuration key or value that is not accepted; the message starts with the key."
);
create_exception!(
    _kvrail,
    PeerError,
    KvrailError,
    "The peer's: it refused the handshake, sent unusable metadata, or failed its part."
);
create_exception!(
    _kvrail,
    PeerConnectionError,
    KvrailError,
    "The side channel or data connection: closed, unreachable, lost."
);
create_exception!(
    _kvrail,
    RdmaError,
    KvrailError,
    "The RDMA fabric: work completions in error, no rail left."
);
create_exception!(
    _kvrail,
    MemoryRegionError,
    KvrailError,
    "Memory that cannot be registered (overlap, bad range, a device runtime's refusal)."
);
create_exception!(
    _kvrail,
    UnavailableError,
    KvrailError,
    "This build or host cannot do it (no RDMA, a missing capability)."
);
create_exception!(
    _kvrail,
    DeadlineError,
    KvrailError,
    "Nothing was heard from the peer within the bound."
);

/// Add the exceptions to the module.
pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvrailError", py.get_type::<KvrailError>())?;
    m.add("MisuseError", py.get_type::<MisuseError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("PeerConnectionError", py.get_type::<PeerConnectionError>())?;
    m.add("RdmaError", py.get_type::<RdmaError>())?;
    m.add("MemoryRegionError", py.get_type::<MemoryRegionError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("DeadlineError", py.get_type::<DeadlineError>())?;
    Ok(())
}

/// The exception for a fault group.
pub(crate) fn of_fault(fault: Fault, msg: String) -> PyErr {
    match fault {
        Fault::Misuse => MisuseError::new_err(msg),
        Fault::Peer => PeerError::new_err(msg),
        Fault::Connection => PeerConnectionError::new_err(msg),
        Fault::Rdma => RdmaError::new_err(msg),
        Fault::Memory => MemoryRegionError::new_err(msg),
        Fault::Timeout => DeadlineError::new_err(msg),
        _ => UnavailableError::new_err(msg),
    }
}

/// An agent error as its exception.
pub(crate) fn agent(e: AgentError) -> PyErr {
    of_fault(e.fault(), e.to_string())
}

/// A failed transfer as its exception.
pub(crate) fn xfer(e: &XferError) -> PyErr {
    of_fault(e.fault(), e.to_string())
}

/// A configuration error (its message starts with the key).
pub(crate) fn config(e: KvConfigError) -> PyErr {
    ConfigError::new_err(e.to_string())
}

/// A bad argument, named.
pub(crate) fn misuse(arg: &str, why: impl std::fmt::Display) -> PyErr {
    MisuseError::new_err(format!("{arg}: {why}"))
}
