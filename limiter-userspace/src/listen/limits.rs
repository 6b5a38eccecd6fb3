//! What one listener allows (connections at once, in all and per source;
//! header and write deadlines; header size), as configured, with defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What one listener allows.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Connections served at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections served at once from one client address (default: a
    /// quarter of `max_connections`, at least 1), so that one client
    /// cannot hold every slot.
    #[serde(default)]
    pub max_connections_per_source: Option<usize>,
    /// How long a client may take to send a request's header (or, on an
    /// idle connection, to start the next one).
    #[serde(default = "default_header_timeout", with = "humantime_serde")]
    pub header_timeout: Duration,
    /// The largest request header block (bytes; at least 8192): larger
    /// gets 431.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// How long a write to a client may wait for it to read.
    #[serde(default = "default_write_timeout", with = "humantime_serde")]
    pub write_timeout: Duration,
}

fn default_write_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_max_header_bytes() -> usize {
    16384
}

fn default_max_connections() -> usize {
    256
}

fn default_header_timeout() -> Duration {
    Duration::from_secs(10)
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            max_connections_per_source: None,
            header_timeout: default_header_timeout(),
            max_header_bytes: default_max_header_bytes(),
            write_timeout: default_write_timeout(),
        }
    }
}

impl Limits {
    /// `max_connections_per_source`, or its default.
    pub fn per_source(&self) -> usize {
        self.max_connections_per_source
            .unwrap_or_else(|| default_per_source(self.max_connections))
    }
}

/// A listener's connections from one address unless configured: a
/// quarter of all it serves at once, at least 1.
pub fn default_per_source(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}
