//! The side channel's authentication: with a cluster secret configured, a connection proves
//! it knows the secret before it gets metadata or an attached data path, and the agent
//! proves it back. Challenge–response with HMAC-SHA-256, both nonces fresh per connection
//! (a recorded answer is worth nothing on the next one), the two directions under different
//! labels (one side's proof cannot be reflected as the other's):
//!
//! ```text
//! connecting side                          listening agent
//!   AuthHello { nonce: c }          ->
//!                                    <-    AuthChallenge { nonce: s, proof: H("server", c, s) }
//!   (checks the agent's proof)
//!   AuthProof { proof: H("client", c, s) } ->
//!                                          (checks; else Refused, counted, logged)
//!   GetMetadata | Attach            ->     as without a secret
//! ```
//!
//! The secret itself never travels. What follows the handshake on the connection is not
//! authenticated message by message (no TLS): the handshake keeps strangers out, it does not
//! stop someone who can rewrite packets on the path.
//!
//! Without a secret an agent is in protected mode (Redis's model): it serves only peers on
//! loopback, unless its configuration says `insecure`.

use std::net::{SocketAddr, TcpStream};

use super::msg::{send, Msg, Reader};
use super::reply::{conn_err, expect_reply};
use crate::agent::error::AgentError;
use crate::agent::secret::ClusterSecret;

/// Bytes of each side's nonce.
pub(crate) const NONCE: usize = 32;

/// The two ways out of protected mode (a literal, for `concat!`).
macro_rules! protected_advice {
    () => {
        "set cluster_secret on every agent of the cluster, or insecure: true \
         (KVRAIL_INSECURE=1 where no configuration can be passed) to accept unauthenticated \
         peers knowingly"
    };
}

/// The two ways out of protected mode, for the agent's log.
pub(crate) const PROTECTED_ADVICE: &str = protected_advice!();

/// What a peer beyond loopback hears from an agent in protected mode.
pub(crate) const PROTECTED: &str = concat!(
    "this agent has no cluster_secret and serves only peers on loopback: ",
    protected_advice!()
);

/// Whether a connection from `ip` comes from this machine's loopback (127.0.0.0/8, ::1, or
/// an IPv4-mapped loopback address).
pub(crate) fn is_loopback(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
        std::net::IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}
const LABEL_SERVER: &[u8] = b"kvrail-auth-v1 agent";
const LABEL_CLIENT: &[u8] = b"kvrail-auth-v1 peer";

/// A fresh nonce.
pub(crate) fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE];
    // the OS's generator: a failure here leaves no safe way on
    getrandom::fill(&mut n).expect("the OS random number generator failed");
    n
}

/// The listening agent's side, between the frames the listener reads.
#[derive(Debug)]
pub(crate) enum Listen {
    /// No secret: the first message is GetMetadata or Attach.
    Off,
    /// Waiting for the peer's AuthHello.
    Hello,
    /// Challenge sent: waiting for the peer's proof over these nonces.
    Proof { client: Vec<u8>, server: Vec<u8> },
    /// The peer proved the secret: the next message is GetMetadata or Attach.
    Passed,
}

/// What the listener does with a frame while authenticating.
pub(crate) enum Verdict {
    /// Send this answer and read the next frame.
    Answer(Msg),
    /// Proven: read the next frame (the real first message).
    Passed,
    /// Refuse with these words (and count it).
    Refuse(&'static str),
    /// Not for authentication: the first message proper.
    NotMine(Msg),
}

impl Listen {
    /// The state a new connection starts in.
    pub(crate) fn start(secret: Option<&ClusterSecret>) -> Self {
        if secret.is_some() {
            Self::Hello
        } else {
            Self::Off
        }
    }

    /// Take message `m` under `secret`.
    pub(crate) fn take(&mut self, secret: Option<&ClusterSecret>, m: Msg) -> Verdict {
        match (std::mem::replace(self, Self::Passed), secret) {
            (Self::Off, _) => {
                *self = Self::Off;
                match m {
                    Msg::AuthHello { .. } => {
                        Verdict::Refuse("this agent has no cluster_secret; the peer has one")
                    }
                    m => Verdict::NotMine(m),
                }
            }
            (Self::Passed, _) => Verdict::NotMine(m),
            (Self::Hello, Some(k)) => match m {
                Msg::AuthHello { nonce: client } if client.len() == NONCE => {
                    let server = nonce();
                    let proof = k.proof(LABEL_SERVER, &client, &server);
                    *self = Self::Proof {
                        client,
                        server: server.clone(),
                    };
                    Verdict::Answer(Msg::AuthChallenge {
                        nonce: server,
                        proof,
                    })
                }
                Msg::AuthHello { .. } => Verdict::Refuse("malformed authentication"),
                _ => Verdict::Refuse("authentication required: set cluster_secret"),
            },
            (Self::Proof { client, server }, Some(k)) => match m {
                Msg::AuthProof { proof } if k.verify(LABEL_CLIENT, &client, &server, &proof) => {
                    Verdict::Passed
                }
                _ => Verdict::Refuse("authentication failed: wrong cluster_secret"),
            },
            (Self::Hello | Self::Proof { .. }, None) => Verdict::Refuse("no secret"),
        }
    }
}

/// The connecting side: prove the secret to the agent at `addr` on a fresh connection
/// (writer `w`, reader `r`), and check the agent's proof.
///
/// # Errors
/// [`AgentError::Connection`] naming what failed: the agent refused us (wrong secret, or
/// none there), or it did not prove the secret itself.
pub(crate) fn prove(
    secret: &ClusterSecret,
    w: &mut TcpStream,
    r: &mut Reader<TcpStream>,
    addr: SocketAddr,
) -> Result<(), AgentError> {
    let client = nonce();
    send(
        w,
        &Msg::AuthHello {
            nonce: client.clone(),
        },
    )
    .map_err(|e| conn_err("side channel: send to", addr, e))?;
    let (server, proof) = expect_reply(
        r,
        addr,
        "authenticate with",
        "authentication refused by",
        |m| match m {
            Msg::AuthChallenge { nonce, proof } => Ok((nonce, proof)),
            m => Err(m),
        },
    )?;
    if server.len() != NONCE || !secret.verify(LABEL_SERVER, &client, &server, &proof) {
        return Err(conn_err(
            "authenticate with",
            addr,
            "the agent there did not prove the cluster secret (another cluster, or not kvrail)",
        ));
    }
    let proof = secret.proof(LABEL_CLIENT, &client, &server);
    send(w, &Msg::AuthProof { proof }).map_err(|e| conn_err("side channel: send to", addr, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    fn challenge(l: &mut Listen, k: &ClusterSecret, client: &[u8]) -> (Vec<u8>, Vec<u8>) {
        match l.take(
            Some(k),
            Msg::AuthHello {
                nonce: client.to_vec(),
            },
        ) {
            Verdict::Answer(Msg::AuthChallenge { nonce, proof }) => (nonce, proof),
            _ => panic!("no challenge"),
        }
    }

    #[test]
    fn the_right_secret_passes_both_ways() {
        let key = k("sixteen bytes at least");
        let mut l = Listen::start(Some(&key));
        let c = nonce();
        let (s, agent_proof) = challenge(&mut l, &key, &c);
        assert!(key.verify(LABEL_SERVER, &c, &s, &agent_proof));
        let p = key.proof(LABEL_CLIENT, &c, &s);
        assert!(matches!(
            l.take(Some(&key), Msg::AuthProof { proof: p }),
            Verdict::Passed
        ));
        assert!(matches!(
            l.take(Some(&key), Msg::GetMetadata),
            Verdict::NotMine(Msg::GetMetadata)
        ));
    }

    #[test]
    fn wrong_missing_replayed_and_reflected_proofs_fail() {
        let key = k("the cluster secret");
        let other = k("another cluster secret");
        // a wrong secret
        let mut l = Listen::start(Some(&key));
        let c = nonce();
        let (s, _) = challenge(&mut l, &key, &c);
        let wrong = other.proof(LABEL_CLIENT, &c, &s);
        assert!(matches!(
            l.take(Some(&key), Msg::AuthProof { proof: wrong }),
            Verdict::Refuse(_)
        ));
        // no secret: the first message proper is refused
        let mut l = Listen::start(Some(&key));
        assert!(matches!(
            l.take(Some(&key), Msg::GetMetadata),
            Verdict::Refuse(w) if w.contains("required")
        ));
        // a proof recorded on one connection, replayed on the next (same client nonce)
        let mut l1 = Listen::start(Some(&key));
        let (s1, _) = challenge(&mut l1, &key, &c);
        let recorded = key.proof(LABEL_CLIENT, &c, &s1);
        let mut l2 = Listen::start(Some(&key));
        let (s2, _) = challenge(&mut l2, &key, &c);
        assert_ne!(s1, s2, "the agent's nonce is fresh");
        assert!(matches!(
            l2.take(Some(&key), Msg::AuthProof { proof: recorded }),
            Verdict::Refuse(_)
        ));
        // the agent's own proof sent back as the peer's
        let mut l = Listen::start(Some(&key));
        let (_, agent_proof) = challenge(&mut l, &key, &c);
        assert!(matches!(
            l.take(Some(&key), Msg::AuthProof { proof: agent_proof }),
            Verdict::Refuse(_)
        ));
        // a short nonce
        let mut l = Listen::start(Some(&key));
        assert!(matches!(
            l.take(Some(&key), Msg::AuthHello { nonce: vec![0; 4] }),
            Verdict::Refuse(_)
        ));
    }

    #[test]
    fn short_secrets_are_refused_and_never_printed() {
        assert!(ClusterSecret::new(b"short".to_vec()).is_err());
        let key = k("do not print this secret");
        assert_eq!(format!("{key:?}"), "ClusterSecret(<24 bytes>)");
    }
}
