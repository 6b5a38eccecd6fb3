//! The daemon's control protocol: JSON lines over a Unix socket that only
//! root may open (0600). One request per line, one response per line:
//!
//! ```text
//! > {"command":"block","prefix":"198.18.0.0/24","for_secs":600}
//! < {"ok":true,"result":null}
//! > {"command":"rules_show"}
//! < {"ok":true,"result":{...}}
//! > {"command":"nonsense"}
//! < {"ok":false,"error":"unknown variant `nonsense`, expected one of ..."}
//! ```
//!
//! A line longer than [`MAX_REQUEST`] bytes is refused and the connection
//! closed. Each request has one reply type, named below; the client
//! ([`super::client`]) returns it typed.

use serde::{Deserialize, Serialize};

use crate::trace::TraceFilter;

/// Where the daemon listens unless configured otherwise.
pub const DEFAULT_SOCKET: &str = "/run/limiter/control.sock";
/// The longest request line (a rule file travels inside one).
pub const MAX_REQUEST: usize = 4 << 20;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Interfaces, pin directory, rule-set generation.
    Status,
    /// The counters (what `limiter stats --json` prints).
    Stats,
    /// Validate and apply a rule file; `origin` names it in errors.
    RulesApply {
        text: String,
        origin: String,
    },
    /// The active rules with ids and counters, and the blocks.
    RulesShow,
    Block {
        prefix: String,
        for_secs: Option<f64>,
    },
    Unblock {
        prefix: String,
    },
    /// Dry run for one rule, or for everything when `rule` is absent.
    Shadow {
        rule: Option<String>,
        on: bool,
    },
    /// Detach from every interface, remove every pin, and exit.
    Detach,
    /// Live decisions: one response now (`null`: tracing), then one per
    /// decision traced ([`TraceLine`]) until the client hangs up.
    Trace {
        filter: TraceFilter,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn ok(result: impl Serialize) -> Self {
        Self {
            ok: true,
            result: serde_json::to_value(result).ok(),
            error: None,
        }
    }

    pub fn error(error: impl std::fmt::Display) -> Self {
        Self {
            ok: false,
            result: None,
            error: Some(error.to_string()),
        }
    }
}

// The replies to the other requests: `Stats` → [`Snapshot`], `RulesApply`
// → [`Change`], `RulesShow` → [`RulesView`]; `Block`, `Unblock` and
// `Shadow` → `()` (`null`); `Trace` → `()`, then a [`TraceLine`] a
// decision.
